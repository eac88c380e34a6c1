"""A VAE our decoder forward does not cover (Wan2.1-style: no residual blocks, no patchify, ×8 spatial) is served
through diffusers' own decoder: CLI frames equal the pipeline's, streamed chunks equal the whole decode, and one
log line says so."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from cosmos3_core.generate import main
from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.stages import DecodeStage
from cosmos3_core.tools.make_tiny import make_tiny
from tests.conftest import reference_pipeline, run_reference
from tests.test_decoder import reference_frames
from tests.test_oracle import CASES, PROMPT, cli_args

WAN21_VAE = {"base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1, "attn_scales": [],
             "temperal_downsample": [False, True, True], "dropout": 0.0}  # fmt: skip
FALLBACK = "falls back to diffusers"


@pytest.fixture(scope="module")
def wan21_ckpt(tmp_path_factory) -> Path:
    ckpt = make_tiny(tmp_path_factory.mktemp("wan21") / "nano", variant="nano", seed=7, vae_config=WAN21_VAE)
    path = ckpt / "vae" / "config.json"
    cfg = json.loads(path.read_text())
    for key in ("scale_factor_spatial", "scale_factor_temporal"):  # as in Wan2.1's released config
        del cfg[key]
    path.write_text(json.dumps(cfg))
    return ckpt


def fallback_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if FALLBACK in r.getMessage()]


def test_config_takes_diffusers_defaults(wan21_ckpt):
    cfg = Checkpoint.open(wan21_ckpt).config
    assert (cfg.vae_scale_spatial, cfg.vae_scale_temporal, cfg.latent_channel) == (8, 4, 16)


@pytest.mark.parametrize("case", ["t2v", "i2v"])
def test_cli_frames_match_pipeline(wan21_ckpt, case, tmp_path, test_image, caplog):
    import imageio.v2 as imageio

    params, image_path = CASES[case], None
    if case == "i2v":
        image_path = tmp_path / "cond.png"
        imageio.imwrite(image_path, test_image)
    out = tmp_path / "video.npy"
    with caplog.at_level(logging.WARNING, logger="cosmos3_core"):
        assert main(cli_args(wan21_ckpt, params, out, image_path)) == 0
    records = fallback_records(caplog)
    assert len(records) == 1 and "is_residual=False" in records[0].getMessage()
    ours = np.load(out)
    image = test_image if case == "i2v" else None
    ref = run_reference(reference_pipeline(wan21_ckpt), PROMPT, params, image, output_type="np")
    ref_u8 = np.round(ref * 255).astype(np.uint8)
    assert ours.dtype == np.uint8 and ours.shape == ref_u8.shape == (9, 32, 64, 3)
    # fp32 noise ~1e-6 may flip a rounding at .5; nothing more
    assert np.abs(ours.astype(int) - ref_u8.astype(int)).max() <= 1


def test_streamed_chunks_equal_the_whole_decode(wan21_ckpt, caplog):
    with caplog.at_level(logging.WARNING, logger="cosmos3_core"):
        stage = DecodeStage(Checkpoint.open(wan21_ckpt), "cpu", torch.float32)
    assert len(fallback_records(caplog)) == 1
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randn(1, 16, 6, 3, 5, generator=g) for _ in range(2))  # an odd latent grid
    whole_a, whole_b = stage.run(a), stage.run(b)
    assert whole_a.shape == (21, 24, 40, 3)
    diff = np.abs(whole_a.astype(int) - reference_frames(stage.codec.vae, a).astype(int))
    assert diff.max() <= 1 and diff.mean() < 0.01, (diff.max(), diff.mean())
    # two streams interleaved: each keeps its own causal cache
    parts: dict[str, list[np.ndarray]] = {"a": [], "b": []}
    bounds = ((0, 1), (1, 4), (4, 6))
    for i, (lo, hi) in enumerate(bounds):
        for sid, z in (("a", a), ("b", b)):
            parts[sid].append(stage.start_chunk(sid, z[:, :, lo:hi], last=i == len(bounds) - 1)().numpy())
    assert np.array_equal(np.concatenate(parts["a"]), whole_a)
    assert np.array_equal(np.concatenate(parts["b"]), whole_b)
    assert len(fallback_records(caplog)) == 1
