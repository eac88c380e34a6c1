"""A reloaded prefill (its encoder's peak proven by its first load) serves text requests while its VAE encoder loads on
a thread of its own; a request that encodes waits for the encoder and gets what a first load's stage gives, or the
encoder load's own error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from cosmos3_core.deployment import Deployment
from cosmos3_core.model.checkpoint import Checkpoint, CheckpointError
from cosmos3_core.stages import PrefillStage

PROMPT = "a red ball rolls across a wooden table"


@pytest.fixture(scope="module")
def first(nano_ckpt) -> tuple[Deployment, PrefillStage]:
    d = Deployment(checkpoint=str(nano_ckpt), device="cpu", dtype="float32", pool_pages=64)
    return d, PrefillStage.from_deployment(d.open_checkpoint(), d, "cpu")


def _image(stage: PrefillStage) -> np.ndarray:
    h, w = stage.defaults.height, stage.defaults.width
    return np.random.default_rng(3).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _held_encoder(monkeypatch, error: Exception | None = None) -> threading.Event:
    """The encoder's load waits for the returned event (then raises `error`, if given)."""
    gate, load_vae = threading.Event(), Checkpoint.load_vae

    def held(self, *args, **kwargs):
        assert gate.wait(20), "the test never released the encoder's load"
        if error is not None:
            raise error
        return load_vae(self, *args, **kwargs)

    monkeypatch.setattr(Checkpoint, "load_vae", held)
    return gate


def test_a_reload_serves_text_before_its_encoder_is_in_and_then_encodes_as_a_first_load(first, monkeypatch):
    d, stage = first
    gate = _held_encoder(monkeypatch)
    try:
        again = PrefillStage.from_deployment(d.open_checkpoint(), d, "cpu", peak_warmup=False)  # returns: not waiting
        assert again._encoder is None and again._encoder_loading is not None
        p = again.validate(PROMPT, {}, None)
        text, expected = again.run(p, None), stage.run(p, None)
        assert again._encoder is None  # served without it
        assert all(torch.equal(a, b) for a, b in zip(text.text_k + text.text_v, expected.text_k + expected.text_v))
    finally:
        gate.set()
    image = _image(stage)
    pi = again.validate(PROMPT, {}, image)
    assert torch.equal(again.run(pi, image).cond_latent, stage.run(pi, image).cond_latent)


def test_an_encoder_that_fails_to_load_in_the_background_is_loaded_again_by_the_next_request_that_encodes(
    first, monkeypatch, capfd
):
    d, stage = first
    gate = _held_encoder(monkeypatch, CheckpointError("vae/diffusion_pytorch_model.safetensors: truncated"))
    again = PrefillStage.from_deployment(d.open_checkpoint(), d, "cpu", peak_warmup=False)
    gate.set()
    image = _image(stage)
    pi = again.validate(PROMPT, {}, image)
    with pytest.raises(CheckpointError, match="truncated"):  # the background load failed, and so does this one
        again.run(pi, image)
    assert "the VAE encoder's load in the background failed (CheckpointError" in capfd.readouterr().err
    assert again.run(again.validate(PROMPT, {}, None), None).cond_latent is None  # text requests still serve
    monkeypatch.undo()  # the file is whole again: the next request that encodes loads it
    assert torch.equal(again.run(pi, image).cond_latent, stage.run(pi, image).cond_latent)


def test_a_first_load_holds_its_encoder_before_it_returns(first):
    _, stage = first
    assert stage._encoder is not None and stage._encoder_loading is None and "VAE encoder" in stage.startup


def test_the_flow_shift_is_kept_per_config_so_a_restarted_part_imports_no_diffusers_for_it(nano_ckpt, tmp_path):
    script = (
        "import sys, json; from cosmos3_core.model.checkpoint import Checkpoint; "
        "from cosmos3_core.sampling import checkpoint_shift; "
        f"s = checkpoint_shift(Checkpoint.open({str(nano_ckpt)!r}).scheduler_config); "
        "print(json.dumps([s, 'diffusers' in sys.modules]))"
    )
    env = {**os.environ, "COSMOS3_CACHE": str(tmp_path)}
    runs = [json.loads(subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                      check=True).stdout.splitlines()[-1]) for _ in range(2)]  # fmt: skip
    from diffusers import UniPCMultistepScheduler

    expected = UniPCMultistepScheduler.from_config(Checkpoint.open(nano_ckpt).scheduler_config).config.flow_shift
    assert runs == [[expected, True], [expected, False]]  # counted by diffusers' class once, then read


def test_a_tower_built_on_the_meta_device_imports_no_dynamo(action_ckpt):
    """nn.Embedding's own init, run on the meta device, imports torch._dynamo: a second of every stub's start (the
    plan and the loaders build each tower there) for a value the load overwrites."""
    script = (
        "import sys, torch; from cosmos3_core.model.checkpoint import Checkpoint; "
        "from cosmos3_core.model.layers import Cosmos3Transformer, UND, GEN; "
        f"cfg = Checkpoint.open({str(action_ckpt)!r}).config\n"
        "with torch.device('meta'): m = Cosmos3Transformer(cfg, frozenset({UND, GEN}))\n"
        "assert hasattr(m, 'embed_tokens') and hasattr(m, 'action_proj_in')\n"
        "assert all(p.is_meta for p in m.parameters())\n"
        "print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"]
