"""Every shipped deployment config loads, and its defaults and warmup requests are valid requests for the real
checkpoints (the `random:nano` skeleton's configs: Wan2.2 VAE, patch 2): a config that serves 720p accepts 720."""

from __future__ import annotations

from pathlib import Path

import pytest

from cosmos3_core.deployment import Deployment
from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.model.provision import resolve_checkpoint
from cosmos3_core.requests import validate, warmup_inputs

CONFIGS = sorted(Path(__file__).parent.parent.glob("configs/*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_defaults_and_warmup_requests_validate(path):
    cfg = Checkpoint.open(resolve_checkpoint("random:nano")).config
    d = Deployment.load(path)
    for request in [{}, *d.warmup_requests]:  # an action request with the blank inputs warmup gives it
        image, video, raw = warmup_inputs(request, d.defaults)
        p = validate("a prompt", request, image, d.defaults, d.limits, cfg.pixel_alignment, cfg.vae_scale_temporal, 5.0,
                     video, raw)  # fmt: skip
        assert p.height * p.width * p.num_frames > 0


@pytest.mark.parametrize(
    "instances, message",
    [({"vae_decode": 2}, "vae_decode must be 1"), ({"denoise": 0}, "counts ≥ 1"), ({"decoder": 1}, "counts ≥ 1")],
)
def test_instance_counts_are_checked_at_load(tmp_path, instances, message):
    path = tmp_path / "d.yaml"
    path.write_text(f"instances: {instances}\n")
    with pytest.raises(ValueError, match=message):
        Deployment.load(path)
    path.write_text("instances: {denoise: 2}\n")
    assert Deployment.load(path).instances == {"prefill": 1, "denoise": 2, "vae_decode": 1}


def test_perf_analyzer_input_is_a_valid_request_for_the_bench_config():
    """bench/perf_analyzer/edge_t2v.json, in perf_analyzer's real-data format, is the request bench.served times."""
    import json

    root = Path(__file__).parent.parent
    cfg = Checkpoint.open(resolve_checkpoint("random:edge")).config
    d = Deployment.load(root / "configs/bench_edge.yaml")
    (entry,) = json.loads((root / "bench/perf_analyzer/edge_t2v.json").read_text())["data"]
    assert set(entry) == {"prompt", "parameters"}
    params = json.loads(entry["parameters"][0])
    p = validate(
        entry["prompt"][0], params, None, d.defaults, d.limits, cfg.pixel_alignment, cfg.vae_scale_temporal, 5.0
    )
    assert (p.height, p.width, p.num_frames, p.steps, p.guidance_scale) == (480, 832, 121, 20, 6.0)


@pytest.mark.parametrize(
    "text, message",
    [
        ("defaults: {t2v: {steps: 8, bogus: 1}}\n", r"defaults.t2v: unknown keys \['bogus'\]"),
        ("defaults: {heigth: 480}\n", r"defaults: unknown keys \['heigth'\]"),
        ("limits: {max_frame: 9}\n", r"limits: unknown keys \['max_frame'\]"),
        ("defaults: {t2v: 8}\n", r"defaults.t2v: a mapping of fields; got 8"),
        ("bogus: 1\n", r"unknown keys \['bogus'\]"),
    ],
)
def test_a_config_key_no_section_has_is_an_error_naming_it(tmp_path, text, message):
    """Every section of a deployment config names a key it does not know (not a constructor's TypeError)."""
    path = tmp_path / "d.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        Deployment.load(path)
