"""Loader: sharded round trip; missing key, wrong shape, missing component, unknown activation → named errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.model.config import CheckpointError
from cosmos3_core.model.layers import GEN, UND
from cosmos3_core.tools.make_tiny import make_tiny

WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


@pytest.fixture
def ckpt_copy(nano_ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(nano_ckpt, dst)
    return dst


def test_sharded_round_trip(nano_ckpt, tmp_path):
    sharded = make_tiny(tmp_path / "sharded", variant="nano", seed=7, shard_size=200_000)
    assert (sharded / (WEIGHTS + ".index.json")).is_file()
    assert len(list((sharded / "transformer").glob("*.safetensors"))) > 1
    a = Checkpoint.open(nano_ckpt).load_transformer({UND, GEN}, "cpu", torch.float32).state_dict()
    b = Checkpoint.open(sharded).load_transformer({UND, GEN}, "cpu", torch.float32).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_missing_key(ckpt_copy):
    state = load_file(ckpt_copy / WEIGHTS)
    del state["layers.1.self_attn.add_k_proj.weight"]
    save_file(state, ckpt_copy / WEIGHTS)
    ckpt = Checkpoint.open(ckpt_copy)
    with pytest.raises(
        CheckpointError,
        match=r"diffusion_pytorch_model\.safetensors: missing key 'layers\.1\.self_attn\.add_k_proj\.weight'",
    ):
        ckpt.load_transformer({GEN}, "cpu", torch.float32)
    ckpt.load_transformer({UND}, "cpu", torch.float32)  # the UND stage does not need it


def test_wrong_shape(ckpt_copy):
    state = load_file(ckpt_copy / WEIGHTS)
    state["layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(state, ckpt_copy / WEIGHTS)
    with pytest.raises(
        CheckpointError, match=r"key 'layers\.0\.mlp\.up_proj\.weight' has shape \[3, 3\], expected \[128, 64\]"
    ):
        Checkpoint.open(ckpt_copy).load_transformer({UND}, "cpu", torch.float32)


def test_missing_shard_file(tmp_path):
    sharded = make_tiny(tmp_path / "sharded", variant="nano", seed=7, shard_size=200_000)
    victim = sorted((sharded / "transformer").glob("*-of-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"{victim.name}: file not found"):
        Checkpoint.open(sharded).load_transformer({UND, GEN}, "cpu", torch.float32)


@pytest.mark.parametrize("component", ["vae", "scheduler", "text_tokenizer", "transformer"])
def test_missing_component(ckpt_copy, component):
    shutil.rmtree(ckpt_copy / component)
    with pytest.raises(CheckpointError, match=rf"{component}"):
        Checkpoint.open(ckpt_copy)


def test_missing_model_index_and_dir(ckpt_copy, tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint directory not found"):
        Checkpoint.open(tmp_path / "nope")
    (ckpt_copy / "model_index.json").unlink()
    with pytest.raises(CheckpointError, match=r"model_index\.json: file not found"):
        Checkpoint.open(ckpt_copy)


def test_unknown_hidden_act(ckpt_copy):
    path = ckpt_copy / "transformer" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["hidden_act"] = "gelu"
    path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"transformer/config\.json: key 'hidden_act' is 'gelu'"):
        Checkpoint.open(ckpt_copy)


def test_edge_variant_layout(tiny_ckpts):
    ckpt = Checkpoint.open(tiny_ckpts["edge"])
    assert ckpt.config.hidden_act == "relu2" and ckpt.config.has_und_k_norm_for_gen and ckpt.use_native_flow_schedule
    names = ckpt.load_transformer({UND}, "cpu", torch.float32).state_dict().keys()
    assert "layers.0.self_attn.k_norm_und_for_gen.weight" in names
    assert not any("norm_q" in n or "gate_proj" in n for n in names)
