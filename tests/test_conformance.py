"""Conformance over the space of valid checkpoints and requests (tests/conformance.py draws them).

Each drawn case, with every parameter given and with none given (the reference's defaults): the offline CLI's
latents equal `Cosmos3OmniPipeline`'s (rel-L2 ≤ 1e-4, fp32 CPU); for a share of the cases, the served uint8 video
equals the offline one and the `done` event echoes the parameters the offline run resolved. CI runs
`CONFORMANCE_N` cases (default 6, 2 served); `make conformance` runs the long sweep.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.conformance import Case, Reference, draw
from tests.conftest import rel_l2

N = int(os.environ.get("CONFORMANCE_N", "6"))
N_SERVED = int(os.environ.get("CONFORMANCE_SERVED", "2"))
FIRST = int(os.environ.get("CONFORMANCE_FIRST_SEED", "1000"))
SEEDS = list(range(FIRST, FIRST + N))
FLAGS = {"negative_prompt": "--negative-prompt", "num_frames": "--num-frames", "guidance_scale": "--guidance"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("conformance")

    def get(case: Case) -> tuple[Path, Path]:
        ckpt = case.write(root / f"ckpt-{case.seed}")
        config = root / f"deploy-{case.seed}.yaml"
        config.write_text(yaml.safe_dump({**case.deployment, "checkpoint": str(ckpt)}))
        return ckpt, config

    return get


def cli(config: Path, case: Case, params: dict, out: Path) -> torch.Tensor:
    import imageio.v2 as imageio

    from cosmos3_core.generate import main

    args = ["--config", str(config), "--prompt", case.prompt, "--out", str(out)]
    if case.image is not None:
        imageio.imwrite(out.with_suffix(".png"), case.image)
        args += ["--image", str(out.with_suffix(".png"))]
    for k, v in params.items():
        args += [FLAGS.get(k, f"--{k}"), str(v)]
    assert main(args) == 0
    return torch.load(out)


@pytest.mark.parametrize("seed", SEEDS)
def test_offline_equals_pipeline(seed, checkpoints, tmp_path):
    case = draw(seed)
    ckpt, config = checkpoints(case)
    ref = Reference(ckpt, case)
    for name, params in (("explicit", case.request), ("defaults", {})):
        ours = cli(config, case, params, tmp_path / f"{name}.pt")
        theirs = ref.latents(params)
        assert torch.isfinite(theirs).all(), f"the draw is degenerate: the reference is not finite on {case.label()}"
        assert ours.shape == theirs.shape, (name, case.label())
        err = rel_l2(ours, theirs)
        assert err <= 1e-4, f"{name}: rel-L2 {err:.2e} on {case.label()}"


@pytest.mark.served
@pytest.mark.parametrize("seed", SEEDS[:N_SERVED])
def test_served_equals_offline(seed, checkpoints, tmp_path):
    from client.stream import generate
    from cosmos3_core.deployment import Deployment
    from cosmos3_core.generate import Generator
    from cosmos3_core.triton.launcher import server_env, stop_server, wait_until_ready
    from cosmos3_core.triton.serve import start

    case = draw(seed)
    _, config = checkpoints(case)
    deployment = Deployment.load(config)
    offline = Generator(deployment)
    proc, ports, _ = start(deployment, tmp_path / "serve", server_env())
    try:
        wait_until_ready(ports[1], proc=proc, timeout_s=300)
        for params in (case.request, {}):
            served = generate(f"127.0.0.1:{ports[0]}", case.prompt, params, case.image)
            expected = offline.frames(case.prompt, params, case.image)
            assert np.array_equal(served.video, expected), case.label()
            done = next(e for e in served.events if e["type"] == "done")
            assert done["params"] == offline.prefill.validate(case.prompt, params, case.image).resolved()
    finally:
        stop_server(proc)
