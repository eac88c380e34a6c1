"""GPU paths (skipped without CUDA): bf16 on the GPU against the fp32 CPU reference, batched vs individual."""

from __future__ import annotations

import pytest
import torch

from cosmos3_core.deployment import Deployment
from cosmos3_core.generate import Generator
from tests.conftest import rel_l2

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16_TOL = 3e-2  # relative L2 of final latents after a few bf16 steps
REQUESTS = [
    ("a red fox", {"num_frames": 9, "height": 64, "width": 96, "steps": 4, "seed": 1}),
    ("a blue boat", {"num_frames": 5, "height": 96, "width": 64, "steps": 3, "seed": 2, "guidance_scale": 1.0}),
    ("a green hill", {"num_frames": 1, "height": 64, "width": 64, "steps": 5, "seed": 3}),
]


@pytest.fixture(scope="module", params=["nano", "edge"])
def gens(request, tiny_ckpts):
    ckpt = str(tiny_ckpts[request.param])
    cpu = Generator(Deployment(checkpoint=ckpt, device="cpu", dtype="float32"))
    gpu = Generator(Deployment(checkpoint=ckpt, device="cuda", dtype="bfloat16"))
    return cpu, gpu


def test_bf16_gpu_matches_fp32_cpu(gens):
    cpu, gpu = gens
    for prompt, params in REQUESTS:
        ref = cpu.latents(prompt, params)
        ours = gpu.latents(prompt, params).float().cpu()
        assert rel_l2(ours, ref) < BF16_TOL, prompt


def test_batched_equals_individual_on_gpu(gens):
    _, gpu = gens
    solo = [gpu.latents(p, q) for p, q in REQUESTS]
    sinks = []
    from cosmos3_core.generate import _CollectSink

    for prompt, params in REQUESTS:
        p = gpu.prefill.validate(prompt, params, None)
        sinks.append(_CollectSink(p.steps, False))
        gpu.engine.submit(gpu.prefill.run(p, None), sinks[-1])
    gpu.engine.run_until_idle()
    assert gpu.engine.stats.max_requests_in_tick == 3
    for s, ref in zip(sinks, solo):
        assert rel_l2(s.latents.float(), ref.float()) < 1e-2
