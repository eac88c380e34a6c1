"""Every shipped deployment config loads, and its defaults and warmup requests are valid requests for the real
checkpoints (the `random:nano` skeleton's configs: Wan2.2 VAE, patch 2): a config that serves 720p accepts 720."""

from __future__ import annotations

from pathlib import Path

import pytest

from cosmos3_core.checkpoint import Checkpoint
from cosmos3_core.deployment import Deployment, resolve_checkpoint
from cosmos3_core.requests import validate

CONFIGS = sorted(Path(__file__).parent.parent.glob("configs/*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_defaults_and_warmup_requests_validate(path):
    cfg = Checkpoint.open(resolve_checkpoint("random:nano")).config
    d = Deployment.load(path)
    for request in [{}, *d.warmup_requests]:
        p = validate("a prompt", request, None, d.defaults, d.limits, cfg.pixel_alignment, cfg.vae_scale_temporal)
        assert p.height * p.width * p.num_frames > 0
