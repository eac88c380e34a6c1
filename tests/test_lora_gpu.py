"""LoRA on the GPU (skipped without CUDA): CUDA's form of the delta (`dense_delta`), then whole requests on tiny
checkpoints with head_dim 64, CUDA graphs on:

- the delta alone against the CPU's grouped GEMMs: fp32 on the GPU to fp32 rounding, bf16 and fp16 to their
  rounding, rows without an adapter exactly the base output, no host synchronisation, compiled (dynamic shapes, as
  the GEN kernels compile it) equal to eager, an fp16 slot whose x·A overflows leaving the other rows as they were,
  and a captured graph that replays whatever slots, scales, row groups and adapter weights its buffers hold by then;
- requests in fp32 on the GPU against the fp32 CPU run with the same adapters (tight: a wrong delta is far off),
  in bf16 (BF16_TOL), solo and packed with the base model, and in fp16 solo (FP16_TOL);
- FP8 (`precision: fp8`): W8A16 steps with adapters in fp32 against the CPU; a bf16 pack of W8A8 and W8A16 rows
  with adapters against each alone;
- a captured layout reads the adapter slots as buffers: after the slot is rewritten with another adapter (max_loras
  1, so the second adapter evicts the first), the replayed graph gives the new adapter's result, as an eager run does;
- denoise steps with an adapter never synchronise the host.
"""

from __future__ import annotations

import copy

import pytest
import torch

from cosmos3_core.deployment import Deployment
from cosmos3_core.generate import Generator, _CollectSink
from cosmos3_core.model.lora import AdapterRows, dense_delta, grouped_delta
from cosmos3_core.tools.make_lora import make_lora
from cosmos3_core.tools.make_tiny import make_tiny
from tests.conftest import host_syncs_per_tick, rel_l2

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BF16_TOL = 3e-2
FP16_TOL = 1e-2  # these requests in fp16 on the CPU: ≤ 3.7e-3 from fp32 (bf16: ≤ 3.3e-2)
FP32_TOL = 1e-3  # GPU vs CPU reduction order over a few steps; an adapter's own effect here is > 5e-2
REQUESTS = [
    ("a red fox", {"num_frames": 9, "height": 64, "width": 96, "steps": 4, "seed": 1, "lora": {"name": "both"}}),
    ("a blue boat", {"num_frames": 5, "height": 96, "width": 64, "steps": 3, "seed": 2, "guidance_scale": 1.0}),
    ("a green hill", {"num_frames": 1, "height": 64, "width": 64, "steps": 5, "seed": 3,
                      "lora": {"name": "gen", "scale": 0.5}}),
]  # fmt: skip
# the delta alone: (first row, end row, slot, scale) per group — an empty group, one without an adapter, a
# negative scale, and the trailing group (the layout's padding rows) without an adapter
GROUPS = [(0, 128, 2, 1.0), (128, 128, 1, 3.0), (128, 256, 0, 0.0), (256, 448, 1, 0.5), (448, 576, 2, -2.0),
          (576, 640, 0, 0.0)]  # fmt: skip


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 GEMMs in fp32 (the fp32 comparisons' tolerance assumes it), whatever an earlier test set."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def adapter_rows(groups, device) -> AdapterRows:
    return AdapterRows(
        torch.tensor([s for _, _, s, _ in groups], device=device),
        torch.tensor([c for *_, c in groups], dtype=torch.float32, device=device),
        torch.tensor([e for _, e, _, _ in groups], dtype=torch.int32, device=device),
    )


def pooled_linear(fan_in: int, fan_out: int, slots: int, rank: int, seed: int) -> torch.nn.Linear:
    """A CPU fp32 linear with an adapter pool's buffers (model/lora.py's layout: A [slots, R, in], Bᵀ [slots, R,
    out]), every slot holding a different random adapter."""
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(fan_in, fan_out, bias=False)
    lin.weight.data = torch.randn(fan_out, fan_in, generator=g) / fan_in**0.5
    lin.register_buffer("lora_A", torch.randn(slots, rank, fan_in, generator=g) / fan_in**0.5)
    lin.register_buffer("lora_B", torch.randn(slots, rank, fan_out, generator=g) * 0.2)
    return lin


def test_dense_delta_on_cuda_matches_the_cpu_groups():
    lin = pooled_linear(256, 384, slots=3, rank=16, seed=0)
    lin32, lin16 = copy.deepcopy(lin).cuda(), copy.deepcopy(lin).to("cuda", torch.bfloat16)
    lin_h = copy.deepcopy(lin).to("cuda", torch.float16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(640, 256, generator=g)
    y = lin(x).detach()
    with torch.inference_mode():
        want = grouped_delta(y, x, lin, adapter_rows(GROUPS, "cpu"))  # the CPU's form, each group exactly
        rows = adapter_rows(GROUPS, "cuda")
        fp32 = dense_delta(y.cuda(), x.cuda(), lin32, rows)
        assert rel_l2(fp32.cpu(), want) < 1e-5
        x16, y16 = x.cuda().bfloat16(), y.cuda().bfloat16()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host synchronisation in the delta raises
        try:
            bf16 = dense_delta(y16, x16, lin16, rows)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert bf16.dtype == torch.bfloat16 and rel_l2(bf16.float().cpu(), want) < 1e-2
        for start, end, _, scale in GROUPS:
            if scale == 0.0:  # no adapter: the base output itself
                assert torch.equal(bf16[start:end], y16[start:end])
        compiled = torch.compile(dense_delta, dynamic=True)(y16, x16, lin16, rows)
        assert rel_l2(compiled.float(), bf16.float()) < 1e-2
        xh, yh = x.cuda().half(), y.cuda().half()
        fp16 = dense_delta(yh, xh, lin_h, rows)
        assert fp16.dtype == torch.float16 and rel_l2(fp16.float().cpu(), want) < 2e-3
        lin_h.lora_A[1] = 6e4  # slot 1 (rows 256-448): x·A past fp16's 65504; the other rows must not see it
        over = dense_delta(yh, xh, lin_h, rows)
        assert not torch.isfinite(over[256:448]).all()
        assert torch.equal(over[:256], fp16[:256]) and torch.equal(over[448:], fp16[448:])


def test_captured_delta_replays_what_its_buffers_hold():
    """A graph captured over the pack's buffers (as a step layout captures its forward): rewriting the slot and
    scale of each group (a new mix of requests), the groups' ends (a new geometry in a bucket) and a slot's weights
    (an adapter loaded into it), then replaying, gives what an eager call computes from the new contents."""
    lin = pooled_linear(256, 384, slots=3, rank=16, seed=2).to("cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(640, 256, generator=g).to("cuda", torch.bfloat16)
    y = torch.randn(640, 384, generator=g).to("cuda", torch.bfloat16)
    rows = adapter_rows(GROUPS, "cuda")
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # cuBLAS's one-time setup outside the capture
            dense_delta(y, x, lin, rows)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = dense_delta(y, x, lin, rows)
        graph.replay()
        first = out.clone()
        assert rel_l2(first.float(), dense_delta(y, x, lin, rows).float()) < 1e-3
        mix = [(0, 192, 1, -1.0), (192, 192, 0, 0.0), (192, 320, 0, 2.0), (320, 512, 2, 0.0), (512, 576, 1, 1.0),
               (576, 640, 0, 0.0)]  # fmt: skip
        new = adapter_rows(mix, "cuda")
        rows.slot.copy_(new.slot)
        rows.scale.copy_(new.scale)
        rows.offs.copy_(new.offs)
        lin.lora_A[1].copy_(torch.randn(16, 256, generator=g).to("cuda", torch.bfloat16) / 16)
        graph.replay()
        want = dense_delta(y, x, lin, rows)
        assert rel_l2(out.float(), want.float()) < 1e-3
        assert rel_l2(out.float(), first.float()) > 0.1  # the replay did read the new contents
        assert torch.equal(out[320:512], y[320:512])  # scale 0 in the new mix


@pytest.fixture(scope="module", params=["nano", "edge"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_gpu")
    ckpt = make_tiny(root / request.param, variant=request.param, seed=7, head_dim=64)
    make_lora(ckpt, root / "loras" / "both", rank=8, targets=("gen", "und"), seed=2, std=0.2)
    make_lora(ckpt, root / "loras" / "gen", rank=16, targets=("gen",), seed=3, std=0.2)
    make_lora(ckpt, root / "loras" / "mlp", rank=8, targets=("mlp_moe_gen.up_proj", "mlp_moe_gen.down_proj"), seed=5,
              std=0.2)  # fmt: skip
    cpu = Generator(Deployment(checkpoint=str(ckpt), device="cpu", dtype="float32", lora_dir=str(root / "loras")))
    return ckpt, root / "loras", [cpu.latents(p, q) for p, q in REQUESTS]


def gpu(ckpt, loras, dtype: str = "bfloat16", **kw) -> Generator:
    return Generator(Deployment(checkpoint=str(ckpt), device="cuda", dtype=dtype, attention="sdpa",
                                lora_dir=str(loras), max_lora_rank=16, **kw))  # fmt: skip


def packed(gen: Generator, requests) -> list[torch.Tensor]:
    out = gen.run_together([gen.prefill.run(gen.prefill.validate(p, q, None), None) for p, q in requests])
    assert gen.engine.stats.max_requests_in_tick == len(requests)
    return [r.latents.float().cpu() for r in out]


def test_gpu_adapters_match_cpu_solo_and_packed(setup):
    ckpt, loras, reference = setup
    gen = gpu(ckpt, loras)
    solo = [gen.latents(p, q).float().cpu() for p, q in REQUESTS]
    for (prompt, _), ours, ref in zip(REQUESTS, solo, reference):
        assert rel_l2(ours, ref) < BF16_TOL, prompt
    # alone, a request's adapter is merged into the 16-bit weights; packed, it is the dense delta: two roundings,
    # each within bf16's distance of the CPU's fp32 run (an adapter's own effect here is > 5e-2)
    for (prompt, _), r, ref in zip(REQUESTS, packed(gen, REQUESTS), reference):
        assert rel_l2(r, ref) < BF16_TOL, prompt
    assert gen.engine.step.captures > 0


def test_fp32_gpu_adapters_match_cpu_closely(setup):
    """fp32 on the GPU (captured), each request solo and all three packed, against the CPU's fp32 run: the delta's
    CUDA form and the slots' placement to fp32 rounding, not bf16's."""
    ckpt, loras, reference = setup
    gen = gpu(ckpt, loras, "float32")
    for (prompt, params), ref in zip(REQUESTS, reference):
        assert rel_l2(gen.latents(prompt, params).cpu(), ref) < FP32_TOL, prompt
    for (prompt, _), r, ref in zip(REQUESTS, packed(gen, REQUESTS), reference):
        assert rel_l2(r, ref) < FP32_TOL, prompt
    assert gen.engine.step.captures > 0


def test_fp16_gpu_adapters_match_cpu(setup):
    """fp16 (served: the CUDA delta is plain GEMMs), captured, each request solo against the CPU's fp32 run."""
    ckpt, loras, reference = setup
    gen = gpu(ckpt, loras, "float16")
    for (prompt, params), ref in zip(REQUESTS, reference):
        ours = gen.latents(prompt, params).float().cpu()
        assert rel_l2(ours, ref) < FP16_TOL, (prompt, "base" if "lora" not in params else "adapter", rel_l2(ours, ref))
    assert gen.engine.step.captures > 0


def test_fp8_base_with_adapters_on_cuda(setup):
    """`precision: fp8`: the delta over each FP8 linear's output. W8A16 (steps within the policy's first / last 3,
    the reasoner W8A16) in fp32 equals the CPU's fp32 run of the same quantized model with the adapter; in bf16, a
    pack whose 7-step request runs a W8A8 step beside the other's W8A16 step equals each alone."""
    ckpt, loras, _ = setup
    fp8 = {"precision": "fp8", "fp8_policy": {"reasoner": "a16"}}
    cpu = Generator(Deployment(checkpoint=str(ckpt), device="cpu", dtype="float32", lora_dir=str(loras), **fp8))
    prompt, params = REQUESTS[0]
    want = cpu.latents(prompt, params)
    assert rel_l2(gpu(ckpt, loras, "float32", **fp8).latents(prompt, params).cpu(), want) < FP32_TOL
    mixed = [(prompt, {**params, "steps": 7}), ("a blue boat", {**REQUESTS[1][1], "steps": 4, "lora": {"name": "mlp"}})]
    gen = gpu(ckpt, loras, **fp8)
    for r, (p, q) in zip(packed(gen, mixed), mixed):
        assert rel_l2(r, gen.latents(p, q).float().cpu()) < 1e-2


def test_replayed_graph_reads_the_rewritten_slot(setup):
    ckpt, loras, _ = setup
    prompt, params = REQUESTS[0]
    other = {**params, "lora": {"name": "gen"}}
    captured = gpu(ckpt, loras, max_loras=1)
    first = captured.latents(prompt, params).float()
    captures = captured.engine.step.captures
    second = captured.latents(prompt, other).float()  # evicts "both" from the one slot; same layout: replays
    assert captured.engine.step.captures == captures and captured.engine.loras.loads == 2
    eager = gpu(ckpt, loras, cuda_graphs=False).latents(prompt, other).float()
    assert rel_l2(second, eager) < 1e-2
    assert rel_l2(second, first) > 5e-2


def test_adapter_steps_never_sync_the_host(setup):
    """As tests/test_gpu.py's check, with an adapter: after admission (the adapter's load copies its weights in),
    no denoise step synchronises the host."""
    ckpt, loras, _ = setup
    gen = gpu(ckpt, loras)
    prompt, params = REQUESTS[0]
    p = gen.prefill.validate(prompt, params, None)
    gen.latents_from(gen.prefill.run(p, None))  # this layout: captured
    gen.engine.submit(gen.prefill.run(p, None), _CollectSink(p.steps, False))
    gen.engine.tick()
    syncs = host_syncs_per_tick(gen.engine)
    assert len(syncs) == p.steps - 1
    assert max(syncs) == 0, syncs
