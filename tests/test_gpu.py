"""GPU paths (skipped without CUDA), on tiny checkpoints with head_dim 64 (a size every GPU kernel takes):

- bf16 on the GPU against the fp32 CPU reference, for each attention backend, eager and captured;
- FlashInfer against SDPA, captured against eager, batched against individual requests;
- bucketed layouts (`graph_buckets`): the warmup captures each bucket, and new size mixes replay those captures.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cosmos3_core.deployment import Deployment
from cosmos3_core.generate import Generator, _CollectSink
from cosmos3_core.tools.make_tiny import make_tiny
from tests.conftest import host_syncs_per_tick, rel_l2

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16_TOL = 3e-2  # relative L2 of final latents after a few bf16 steps
REQUESTS = [
    ("a red fox", {"num_frames": 9, "height": 64, "width": 96, "steps": 4, "seed": 1}),
    ("a blue boat", {"num_frames": 5, "height": 96, "width": 64, "steps": 3, "seed": 2, "guidance_scale": 1.0}),
    ("a green hill", {"num_frames": 1, "height": 64, "width": 64, "steps": 5, "seed": 3}),
]
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
VARIANTS = [
    ("sdpa", False),
    ("sdpa", True),
    pytest.param("flashinfer", False, marks=pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer")),
    pytest.param("flashinfer", True, marks=pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer")),
]


@pytest.fixture(scope="module", params=["nano", "edge"])
def ckpt_and_reference(request, tmp_path_factory):
    ckpt = make_tiny(tmp_path_factory.mktemp("d64") / request.param, variant=request.param, seed=7, head_dim=64)
    cpu = Generator(Deployment(checkpoint=str(ckpt), device="cpu", dtype="float32"))
    return ckpt, [cpu.latents(p, q) for p, q in REQUESTS]


def gpu_generator(ckpt, attention: str, cuda_graphs: bool, **deployment) -> Generator:
    d = Deployment(checkpoint=str(ckpt), device="cuda", dtype="bfloat16", attention=attention, cuda_graphs=cuda_graphs,
                   **deployment)  # fmt: skip
    return Generator(d)


def run_batched(gen: Generator) -> list[torch.Tensor]:
    results = gen.run_together([gen.prefill.run(gen.prefill.validate(p, q, None), None) for p, q in REQUESTS])
    assert gen.engine.stats.max_requests_in_tick == len(REQUESTS)
    return [r.latents.float().cpu() for r in results]


@pytest.mark.parametrize("attention,cuda_graphs", VARIANTS)
def test_bf16_gpu_matches_fp32_cpu_solo_and_batched(ckpt_and_reference, attention, cuda_graphs):
    ckpt, reference = ckpt_and_reference
    gen = gpu_generator(ckpt, attention, cuda_graphs)
    assert gen.engine.step.attention.name == attention
    solo = [gen.latents(p, q).float().cpu() for p, q in REQUESTS]
    for (prompt, _), ours, ref in zip(REQUESTS, solo, reference):
        assert rel_l2(ours, ref) < BF16_TOL, prompt
    for ours, alone in zip(run_batched(gen), solo):
        assert rel_l2(ours, alone) < 1e-2
    assert (gen.engine.step.captures > 0) == cuda_graphs  # steps 2.. of each layout replayed a captured graph


@pytest.mark.parametrize("attention", ["sdpa", pytest.param("flashinfer", marks=VARIANTS[2].marks)])
def test_captured_equals_eager(ckpt_and_reference, attention):
    ckpt, _ = ckpt_and_reference
    eager, captured = gpu_generator(ckpt, attention, False), gpu_generator(ckpt, attention, True)
    for prompt, params in REQUESTS:
        a, b = eager.latents(prompt, params).float(), captured.latents(prompt, params).float()
        assert rel_l2(b, a) < 1e-2, prompt
    assert captured.engine.step.captures >= len(REQUESTS)


def test_gen_graphs_compiled_ahead_then_loaded_are_captured_and_agree(ckpt_and_reference, tmp_path, monkeypatch,
                                                                      capsys):  # fmt: skip
    """compile: true on the GPU: the first engine compiles the GEN graphs ahead, a second one (a reloaded stub)
    loads them and gives the same latents; both capture. Inductor's fused kernels round differently from eager's
    bf16 ops (fp32 inside a fusion), so compiled is held to the fp32 reference as eager is, not to eager."""
    from cosmos3_core.precompiled import Precompiled

    ckpt, reference = ckpt_and_reference
    monkeypatch.setenv("COSMOS3_CACHE", str(tmp_path))
    first = gpu_generator(ckpt, "sdpa", True, compile=True)
    compiled = [first.latents(prompt, params).float().cpu() for prompt, params in REQUESTS]
    for (prompt, _), ours, ref in zip(REQUESTS, compiled, reference, strict=True):
        assert rel_l2(ours, ref) < BF16_TOL, prompt
    assert len(list((tmp_path / "kernels" / "precompiled").glob("_gen_*.bin"))) >= 2

    def compiled_again(self, key, args):
        raise AssertionError(f"{self.fn.__name__} compiled again")

    monkeypatch.setattr(Precompiled, "_compile", compiled_again)
    capsys.readouterr()
    loaded = gpu_generator(ckpt, "sdpa", True, compile=True)
    for (prompt, params), want in zip(REQUESTS, compiled, strict=True):
        assert rel_l2(loaded.latents(prompt, params).float().cpu(), want) < 1e-3, prompt
    err = capsys.readouterr().err
    assert "is traced" not in err and "guards refuse" not in err and "did not load" not in err, err
    assert first.engine.step.captures >= len(REQUESTS) and loaded.engine.step.captures >= len(REQUESTS)


@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer")
def test_flashinfer_matches_sdpa(ckpt_and_reference):
    ckpt, _ = ckpt_and_reference
    fi, sd = gpu_generator(ckpt, "flashinfer", False), gpu_generator(ckpt, "sdpa", False)
    for prompt, params in REQUESTS:
        # each is within BF16_TOL of the fp32 reference (test above), so of each other within twice that
        assert rel_l2(fi.latents(prompt, params).float(), sd.latents(prompt, params).float()) < 2 * BF16_TOL, prompt


@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer")
@pytest.mark.parametrize(
    "params",
    [
        {
            "window_mode": "kv",
            "num_frames": 25,
            "window_frames": 9,
            "context_frames": 0,
        },  # 6 tokens/frame: context lists that do not fill whole pages (the gather takes them token by token)
        {"window_mode": "chained", "num_frames": 37, "window_frames": 17, "overlap_frames": 8},
    ],
)
def test_ar_streams_with_flashinfer_match_sdpa(ckpt_and_reference, params):
    """Streams on FlashInfer + graphs equal the all-SDPA ones within bf16, kv context frames that do not fill whole
    pages included: FlashInfer's gathered `[prefix | own]` K/V runs every layout of them (no SDPA fallback)."""
    ckpt, _ = ckpt_and_reference
    fi, sd = gpu_generator(ckpt, "flashinfer", True), gpu_generator(ckpt, "sdpa", False)
    request = {"height": 64, "width": 96, "steps": 3, "seed": 5, "guidance_scale": 4.0, **params}
    a, b = fi.latents("a train crosses a bridge", request), sd.latents("a train crosses a bridge", request)
    assert rel_l2(a.float(), b.float()) < 2 * BF16_TOL
    names = {key[1] for key in fi.engine.step.layouts}
    assert names == {"flashinfer"}


@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer")
def test_bucketed_mixes_replay_the_warmup_captures(ckpt_and_reference, monkeypatch):
    """Every pack of these requests (alone, then batched as they join and leave: a different size mix each time)
    fits a bucket the warmup captured: no new capture, and the results equal eager's within bf16. The warmup packs
    rows of 128 tokens here (2 and 4 segments), as Edge's do of 4,096: captures from other segment mixes serve."""
    import cosmos3_core.step as step_module

    monkeypatch.setattr(step_module, "CAPTURE_SEGMENT", 128)
    ckpt, _ = ckpt_and_reference
    buckets = [256, 512]  # these packs: 64 to 320 rows
    gen = gpu_generator(ckpt, "flashinfer", True, graph_buckets=buckets, max_captures=4)
    step = gen.engine.step
    captured = {k[0][:2] for k, v in step.layouts.items() if v.graph is not None}
    assert step.captures == len(buckets) and captured == {("bucket", b) for b in buckets}
    warmed = set(step.layouts)  # the buckets', and the memory plan's largest request's (eager: past every bucket)
    eager = gpu_generator(ckpt, "flashinfer", False)
    for prompt, params in REQUESTS:
        assert rel_l2(gen.latents(prompt, params).float(), eager.latents(prompt, params).float()) < 1e-2, prompt
    for ours, theirs in zip(run_batched(gen), run_batched(eager)):
        assert rel_l2(ours, theirs) < 1e-2
    assert step.captures == len(buckets)  # every new mix replayed a warmup capture
    assert all(k[0][0] == "bucket" for k in step.layouts if k not in warmed)
    bounded = gpu_generator(ckpt, "flashinfer", True, graph_buckets=buckets, max_captures=1)

    def held() -> int:
        return sum(v.graph is not None for v in bounded.engine.step.layouts.values())

    assert held() == 1 and bounded.engine.step.captures == 2  # the second bucket's capture released the first's
    for prompt, params in REQUESTS[:1]:
        assert rel_l2(bounded.latents(prompt, params).float(), eager.latents(prompt, params).float()) < 1e-2
    assert held() == 1 and bounded.engine.step.captures == 3  # its bucket captured again, in place of the other's


def test_denoise_steps_never_sync_the_host(ckpt_and_reference):
    """A synchronising call leaves the GPU idle while the host launches what follows (the scheduler's small
    kernels, the next row, the graph launch): ~4 ms a step at Edge's size."""
    ckpt, _ = ckpt_and_reference
    gen = gpu_generator(ckpt, "sdpa", True)
    prompt, params = REQUESTS[0]
    p = gen.prefill.validate(prompt, params, None)
    gen.latents_from(gen.prefill.run(p, None))  # this layout: compiled, captured
    gen.engine.submit(gen.prefill.run(p, None), _CollectSink(p.steps, False))
    gen.engine.tick()  # admission (the noise and text K/V reach the GPU) and the first step
    syncs = host_syncs_per_tick(gen.engine)
    assert len(syncs) == p.steps - 1
    assert max(syncs) == 0, syncs
