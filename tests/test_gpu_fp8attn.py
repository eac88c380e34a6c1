"""`fp8_attention` on the GPU (skipped without CUDA, flashinfer or a Hopper GPU): FlashInfer's FA3 FP8 kernel for the
GEN attention over [prefix | own], held to the SDPA fake-quant reference (attention.py; its maths is checked on the CPU in
test_fp8_attention.py). Run on an H100/H200:

    .venv/bin/python -m pytest tests/test_gpu_fp8attn.py -v -rs

The first run JIT-builds the FP8 module (fa3, E4M3 q/kv, bf16 out, head_dim 128) unless `make warm-kernels` built it.
Every assertion message carries the measured numbers. What each test isolates, in the order to read failures:

1. test_warm_builds_exactly_the_modules_plan_loads — flashinfer_module_specs (tools/warm.py) = the modules the
   wrappers' plan() asks for (else the AOT lookup misses and the server JIT-builds at load).
2. test_fa3_fp8_ragged_kernel_matrix — the ragged FP8 kernel alone (run's positional per-head scales) against
   exact attention, over MHA / GQA, one sequence / two (128-aligned, unaligned, long), bf16 output (the cases
   FlashInfer's own FP8 tests do and do not cover; fp16 output, which they use, failed alike on the H200).

FlashInfer 0.6.1's FP8 kernel is wrong on short sequences (100–600 keys failed, 384 passed; H200, 2026-12-02), and
the server refuses fp8_attention at load when the kernel fails `attention.fp8_kernel_check` (test 0 below). While it
does, the matrix cells and the plan / engine tests xfail with their measured numbers in the reason (read them with
-rx); when a FlashInfer passes the check, they must pass. Another FlashInfer beside the pinned one (0.7.4, whose kernel
passes): `FI074=1`-style runs put it first on the path (bench/device_served.sh).
3. test_fa3_fp8_attention_matches_the_sdpa_fake_quant_reference — the whole plan (gathered [prefix | own], FP8),
   exact and bucketed plans, against SDPA fake quant on the same inputs; also that FP8 is really engaged.
4. test_fp8_plan_captured_equals_eager — the plan inside a CUDA graph, replayed with new segments and inputs.
5. test_fp8_attention_engine_requests — full requests through the engine (CUDA graphs, buckets): FP8 attention vs
   bf16 FlashInfer and vs the SDPA fake-quant engine, captured vs eager, batched vs alone.
6. test_fp8_attention_is_refused_where_fa3_cannot_run_it — a load error naming fp8_attention, not a silent fallback.

And first, the load check: test_the_load_check_refuses_fp8_attention_when_the_kernel_fails_it (its verdict here,
and a refusal, not a silent fallback or a JIT retry, through make_attention when it fails), and
test_the_load_check_passes_the_kernel_on_one_sequence (the check's wiring, on the case the kernel gets right).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cosmos3_core.attention import (
    FlashInferAttention,
    Fp8KernelDefect,
    SdpaAttention,
    flashinfer_module_specs,
    make_attention,
    quantize_fp8,
)
from cosmos3_core.deployment import Deployment
from cosmos3_core.generate import Generator
from cosmos3_core.kv_pool import KVPool
from cosmos3_core.model.fp8 import E4M3
from cosmos3_core.rows import Segment
from cosmos3_core.tools.make_tiny import make_tiny
from tests.conftest import capture_plan, rel_l2

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer"),
    pytest.mark.skipif(not HOPPER, reason="FA3 FP8 attention needs a Hopper GPU (compute capability 9.x)"),
]

HEADS, KV_HEADS, HEAD_DIM, PAGE = 8, 2, 128, 16  # GQA 4:1, Edge's head_dim
# Bars, from an fp32 simulation of FA3 FP8's maths on these inputs (E4M3 q/k/v with these scales, P·448 rounded to
# E4M3): random q/k/v are the hard case (the output is an average of uncorrelated values, small beside the
# per-element rounding), so one call's FP8 error is ~3-6e-2 rel-L2:
# - the kernel's error against exact attention is at most RATIO × the fake quant's own (simulated: ≤ 1.1×); a
#   wrong scale or layout gives O(1) errors;
# - kernel vs fake quant ≤ FP8_TOL (simulated 2.4-4.2e-2: the kernel's extra P rounding).
RATIO, FP8_TOL = 2.0, 0.1
BF16_TOL = 1e-2  # FlashInfer bf16 vs SDPA bf16, one attention call (the harness's own noise)
ENGINE_FP8_TOL = 0.1  # final latents, FP8 attention vs bf16 (a few steps: bf16 noise 3e-2 + FP8 rounding ~1e-2)


@pytest.fixture(scope="module")
def fp8_defect() -> str | None:
    """The load check's refusal message for FA3's FP8 kernel here, or None when it passes."""
    pool = KVPool(8, PAGE, 1, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    try:
        FlashInferAttention(pool, HEADS, KV_HEADS, HEAD_DIM, fp8=True).check_fp8_kernel()
    except Fp8KernelDefect as e:
        return str(e)
    return None


def expect(ok: bool, msg: str, defect: str | None) -> None:
    """Assert `ok`, or xfail with the numbers when the load check refuses this kernel (its known defect)."""
    if not ok and defect is not None:
        pytest.xfail(f"{msg} [the load check refuses this kernel: {defect[:160]}]")
    assert ok, msg


def test_the_load_check_refuses_fp8_attention_when_the_kernel_fails_it(fp8_defect, capfd):
    pool = KVPool(8, PAGE, 1, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    if fp8_defect is None:
        assert make_attention("flashinfer", pool, HEADS, KV_HEADS, HEAD_DIM, fp8=True).fp8
        return
    assert "fails its load check" in fp8_defect and "fp8_attention" in fp8_defect, fp8_defect
    for name in ("auto", "flashinfer"):  # refused, not a silent SDPA or bf16 fallback
        with pytest.raises(Fp8KernelDefect, match="fails its load check"):
            make_attention(name, pool, HEADS, KV_HEADS, HEAD_DIM, fp8=True)
    assert "JIT-building" not in capfd.readouterr().err  # a defect is not retried with a rebuilt module
    assert make_attention("flashinfer", pool, HEADS, KV_HEADS, HEAD_DIM).name == "flashinfer"  # bf16 unaffected
    print(fp8_defect)


def test_the_load_check_passes_the_kernel_on_one_sequence(monkeypatch):
    """The check's own wiring (scales, layouts, the output's dtype), on a case the kernel gets right (one
    384-key sequence: measured at the E4M3 rounding's error; a 300-key one is not): within a small factor of it, so
    a refusal above is the kernel's, not the check's."""
    import cosmos3_core.attention as attention

    monkeypatch.setattr(attention, "FP8_CHECK_LENGTHS", (384,))
    pool = KVPool(8, PAGE, 1, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    FlashInferAttention(pool, HEADS, KV_HEADS, HEAD_DIM, fp8=True).check_fp8_kernel()  # no Fp8KernelDefect


def pack(seed: int, heads: int = HEADS):
    """A pool with three prefixes (partial, full and short pages) and a pack of three segments with padding between
    and after: 64-row aligned as the step packs them. → (pool, segments, rows, q, k, v, real-row index)."""
    torch.manual_seed(seed)
    pool = KVPool(64, PAGE, 2, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    pool.k_pages.normal_()
    pool.v_pages.normal_()
    text = [pool.alloc(37), pool.alloc(32), pool.alloc(5)]
    segments = [Segment(0, 300, (text[0],), False), Segment(320, 64, (text[1],), False),
                Segment(384, 150, (text[2],), False)]  # fmt: skip
    rows = 576
    head_scale = torch.linspace(0.5, 2.0, heads, device="cuda")[:, None]  # per-head magnitudes: per-head scales
    q = (torch.randn(rows, heads, HEAD_DIM, device="cuda") * head_scale).bfloat16()
    k = (torch.randn(rows, KV_HEADS, HEAD_DIM, device="cuda") * head_scale[:KV_HEADS]).bfloat16()
    v = torch.randn(rows, KV_HEADS, HEAD_DIM, device="cuda").bfloat16()
    real = torch.cat([torch.arange(s.start, s.start + s.length) for s in segments]).cuda()
    return pool, segments, rows, q, k, v, real


def run_plan(backend, rows: int, segments, q, k, v, slots: int = 0, layer: int = 1, fp32: bool = False):
    """`fp32`: SDPA over an fp32 copy of the pool (the exact reference)."""
    pool = backend.pool
    if fp32:
        saved = pool.k_pages, pool.v_pages
        pool.k_pages, pool.v_pages = pool.k_pages.float(), pool.v_pages.float()
    try:
        plan = backend.make_plan(rows, slots)
        plan.update(segments)
        out = plan(q, k, v, layer)
        torch.cuda.synchronize()
    finally:
        if fp32:
            pool.k_pages, pool.v_pages = saved
    return out


def sdpa_nhd(q, k, v) -> torch.Tensor:
    """q [N, heads, d], k/v [M, kv_heads, d] → [N, heads, d], non-causal, GQA."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], enable_gqa=True
    )
    return out[0].transpose(0, 1)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16_plan", "fp8_plan"])
def test_warm_builds_exactly_the_modules_plan_loads(monkeypatch, fp8):
    """The FlashInfer module a plan loads (its get_batch_prefill_module arguments) is exactly the one
    flashinfer_module_specs lists (tools/warm.py builds it ahead; the AOT lookup is by name): the bf16 prefill
    module, or with fp8 the E4M3 one."""
    import flashinfer.prefill as fp
    from flashinfer.jit.attention import gen_batch_prefill_module

    asked = []
    real = fp.get_batch_prefill_module

    def spy(backend, *args):
        asked.append(gen_batch_prefill_module(backend, *args).name)
        return real(backend, *args)

    monkeypatch.setattr(fp, "get_batch_prefill_module", spy)
    pool, segments, rows, q, k, v, _ = pack(0)
    run_plan(FlashInferAttention(pool, HEADS, KV_HEADS, HEAD_DIM, fp8=fp8), rows, segments, q, k, v)
    specs = {s.name for s in flashinfer_module_specs("fa3", torch.bfloat16, HEAD_DIM, fp8=fp8)}
    assert set(asked) == specs and len(specs) == 1, f"plan loaded {sorted(set(asked))}, specs {specs}"


@pytest.mark.parametrize(
    "lengths, per_call",
    [
        ((384,), False),
        ((300,), False),
        ((128, 256), False),
        ((100, 300), False),
        ((1500, 2600), False),
        ((100, 2600), False),
        ((600,), False),
        ((192,), False),
        ((193,), False),
        ((128, 256), True),
        ((100, 300), True),
        ((1500, 2600), True),
    ],
    ids=[
        "one",
        "one_unaligned",
        "two_aligned",
        "two_unaligned",
        "two_long",
        "short_beside_long",
        "one_600",
        "one_192",
        "one_193",
        "two_aligned_per_call",
        "two_unaligned_per_call",
        "two_long_per_call",
    ],
)
@pytest.mark.parametrize("kv_heads", [HEADS, KV_HEADS], ids=["mha", "gqa"])
def test_fa3_fp8_ragged_kernel_matrix(kv_heads, lengths, per_call, fp8_defect):
    """FlashInfer's own FP8 tests cover MHA, lengths in multiples of 128 and fp16 output at a loose MSE bar; ours
    run GQA 4:1, unaligned segments and bf16 output. This matrix localizes a failure of the tests below to one of
    those: each cell holds the FP8 ragged kernel (own tokens only, per-head scales as `quantize_fp8` makes them)
    to the fp32 exact attention, within RATIO x the fake quant's own error (E4M3 q/k/v, exact softmax).
    One sequence, or two in one call (short / unaligned / long: does the defect need a short sequence?), or
    `per_call`: one call per sequence on views of the same buffers at its offset.
    FlashInfer 0.6.1 on the H200 (2026-12-02): GQA fails on one 300-key sequence (0.122) and on 128 + 256 and
    100 + 300, per call exactly as in one call; it passes on one 384-key sequence and on 1500 + 2600. So the defect
    is short sequences, not batching, and calling per sequence does not go around it. Then one 600-key
    sequence fails too (0.121); beside a 100-key one (0.328) a 2600-key one is right (0.056 against 0.049).
    one_192 / one_193: on and just past the FP8 kernel's KV tile at head_dim 128 (CTA_KV 192; 384, the short length
    that passed, is two tiles)."""
    import flashinfer

    g = torch.Generator(device="cuda").manual_seed(11)
    rows = sum(lengths)
    head_scale = torch.linspace(0.5, 2.0, HEADS, device="cuda")[:, None]
    q = (torch.randn(rows, HEADS, HEAD_DIM, device="cuda", generator=g) * head_scale).bfloat16()
    k = (torch.randn(rows, kv_heads, HEAD_DIM, device="cuda", generator=g) * head_scale[:kv_heads]).bfloat16()
    v = torch.randn(rows, kv_heads, HEAD_DIM, device="cuda", generator=g).bfloat16()
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    valid = torch.ones(rows, dtype=torch.bool, device="cuda")
    (q8, sq), (k8, sk), (v8, sv) = (quantize_fp8(x, valid) for x in (q, k, v))
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    out8 = torch.zeros_like(q)
    # per call: views of the same buffers at the sequence's offset (FlashInfer 0.7.4 requires q's rows to be
    # exactly the plan's qo_indptr[-1], so an offset plan over the whole buffer is refused there)
    for a, b in zip(indptr[:-1].tolist(), indptr[1:].tolist()) if per_call else [(0, rows)]:
        bounds = indptr[: len(lengths) + 1] if not per_call else torch.tensor([0, b - a], dtype=torch.int32)
        w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa3")
        w.plan(bounds, bounds, HEADS, kv_heads, HEAD_DIM, causal=False, q_data_type=E4M3, kv_data_type=E4M3,
               o_data_type=torch.bfloat16)  # fmt: skip
        w.run(q8[a:b], k8[a:b], v8[a:b], sq, sk, sv, out=out8[a:b])
        torch.cuda.synchronize()
    exact, fake = torch.empty(rows, HEADS, HEAD_DIM, device="cuda"), torch.empty(rows, HEADS, HEAD_DIM, device="cuda")
    deq = [x8.float() * s[:, None] for x8, s in ((q8, sq), (k8, sk), (v8, sv))]
    for a, b in zip(indptr[:-1].tolist(), indptr[1:].tolist()):
        exact[a:b] = sdpa_nhd(q[a:b].float(), k[a:b].float(), v[a:b].float())
        fake[a:b] = sdpa_nhd(*(x[a:b] for x in deq))
    err, fake_err = rel_l2(out8.float(), exact), rel_l2(fake, exact)
    per_head = [f"{rel_l2(out8[:, h].float(), exact[:, h]):.2e}" for h in range(HEADS)]
    bounds = list(zip(indptr[:-1].tolist(), indptr[1:].tolist()))  # does a short sequence harm its neighbour?
    per_seq = [f"{b - a}: {rel_l2(out8[a:b].float(), exact[a:b]):.2e}" for a, b in bounds]
    msg = (f"FP8 kernel vs exact {err:.3e}, fake quant vs exact {fake_err:.3e}; per sequence {per_seq}; "
           f"per head {per_head}")  # fmt: skip
    assert bool(out8.isfinite().all()), msg
    expect(err < RATIO * fake_err, msg, fp8_defect)
    print(msg)


@pytest.mark.parametrize("slots", [0, 4], ids=["exact", "bucketed"])
def test_fa3_fp8_attention_matches_the_sdpa_fake_quant_reference(slots, fp8_defect):
    pool, segments, rows, q, k, v, real = pack(2)
    fi8 = run_plan(FlashInferAttention(pool, HEADS, KV_HEADS, HEAD_DIM, fp8=True), rows, segments, q, k, v, slots)
    fi16 = run_plan(FlashInferAttention(pool, HEADS, KV_HEADS, HEAD_DIM), rows, segments, q, k, v, slots)
    sd8 = run_plan(SdpaAttention(pool, fp8=True), rows, segments, q, k, v)
    sd16 = run_plan(SdpaAttention(pool), rows, segments, q, k, v)
    exact = run_plan(SdpaAttention(pool), rows, segments, q.float(), k.float(), v.float(), fp32=True)
    e = {name: rel_l2(a[real].float(), b[real].float()) for name, a, b in
         [("fi8~sd8", fi8, sd8), ("fi8~exact", fi8, exact), ("sd8~exact", sd8, exact), ("fi16~sd16", fi16, sd16),
          ("fi8~fi16", fi8, fi16)]}  # fmt: skip
    summary = ", ".join(f"{n} {x:.3e}" for n, x in e.items())
    assert bool(fi8[real].isfinite().all()), f"FA3 FP8 output not finite ({summary})"
    assert e["fi16~sd16"] < BF16_TOL, f"harness: FlashInfer bf16 vs SDPA bf16 off ({summary})"
    expect(e["fi8~exact"] < RATIO * e["sd8~exact"], f"FA3 FP8 error > {RATIO}x the fake quant's ({summary})",
           fp8_defect)  # fmt: skip
    assert e["fi8~sd8"] < FP8_TOL, f"FA3 FP8 vs SDPA fake quant > {FP8_TOL} ({summary})"
    assert e["fi8~fi16"] > 1e-3, f"FA3 FP8 equals bf16: FP8 not engaged ({summary})"
    print(summary)


def test_fp8_plan_captured_equals_eager():
    """A bucketed FP8 plan captured in a CUDA graph (update outside, call inside), then replayed with another
    segment mix and new inputs copied into the same buffers, equals the eager plan on that mix (≤ 1e-2). A host
    sync inside the call would fail the capture."""
    pool, segments, rows, q, k, v, real = pack(3)
    attn = FlashInferAttention(pool, HEADS, KV_HEADS, HEAD_DIM, fp8=True)
    plan = attn.make_plan(rows, 4)
    plan.update(segments)
    graph, bufs, out = capture_plan(plan, q, k, v)
    eager = run_plan(attn, rows, segments, q, k, v, 4, layer=0)
    first = rel_l2(out[real].float(), eager[real].float())
    assert first < 1e-2, f"replay vs eager, the captured mix: rel-L2 {first:.3e}"

    _, _, _, q2, k2, v2, _ = pack(4)
    text = [pool.alloc(48), pool.alloc(7)]
    mix = [Segment(0, 128, (text[0],), False), Segment(128, 400, (text[1],), False)]  # another mix, same bucket
    plan.update(mix)
    for buf, x in zip(bufs, (q2, k2, v2)):
        buf.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    eager2 = run_plan(attn, rows, mix, q2, k2, v2, 4, layer=0)
    real2 = torch.arange(0, 528, device="cuda")
    second = rel_l2(out[real2].float(), eager2[real2].float())
    assert second < 1e-2, f"replay with a new mix vs eager: rel-L2 {second:.3e} (first mix {first:.3e})"


def test_compiled_fp8_quantization_plan_matches_the_eager_one():
    """`compile: true` quantizes through torch.compile (`FlashInferAttention(compiled=True)`): the plan's output,
    eager and captured, matches the eager-quantized plan's. Not bit for bit on CUDA (Inductor's reciprocal multiply
    for / 448 moves a scale by one fp32 unit, and a rare element by one E4M3 step): far inside FP8's own error
    (~3e-2 here), where a wrong scale or padding in the amax is O(1)."""
    pool, segments, rows, q, k, v, real = pack(5)
    eager = run_plan(FlashInferAttention(pool, HEADS, KV_HEADS, HEAD_DIM, fp8=True), rows, segments, q, k, v, 4, 0)
    attn = FlashInferAttention(pool, HEADS, KV_HEADS, HEAD_DIM, fp8=True, compiled=True)
    compiled = run_plan(attn, rows, segments, q, k, v, 4, 0)
    first = rel_l2(compiled[real].float(), eager[real].float())
    assert first < 1e-3, f"compiled vs eager quantization: rel-L2 {first:.3e}"
    plan = attn.make_plan(rows, 4)
    plan.update(segments)
    _, _, out = capture_plan(plan, q, k, v)  # an eager call first, as a step layout runs before it captures
    second = rel_l2(out[real].float(), eager[real].float())
    assert second < 1e-3, f"captured: rel-L2 {second:.3e} (eager compiled {first:.3e})"


REQUESTS = [
    ("a red fox", {"num_frames": 9, "height": 64, "width": 96, "steps": 4, "seed": 1}),
    ("a blue boat", {"num_frames": 5, "height": 96, "width": 64, "steps": 3, "seed": 2, "guidance_scale": 1.0}),
    ("a green hill", {"num_frames": 1, "height": 64, "width": 64, "steps": 5, "seed": 3}),
]


def test_fp8_attention_engine_requests(tmp_path, fp8_defect):
    """Tiny Nano at head_dim 128 (4 heads, 2 KV heads), bf16 on the GPU, FlashInfer with CUDA graphs and buckets.
    While the load check refuses the kernel, the engine's load is refused naming it (then xfail)."""
    ckpt = make_tiny(tmp_path / "nano", variant="nano", seed=7, head_dim=128)

    def gen(attention: str, fp8: bool, graphs: bool, **kw) -> Generator:
        return Generator(Deployment(checkpoint=str(ckpt), device="cuda", dtype="bfloat16", attention=attention,
                                    cuda_graphs=graphs, fp8_attention=fp8, **kw))  # fmt: skip

    if fp8_defect is not None:
        with pytest.raises(Fp8KernelDefect, match="fails its load check"):
            gen("flashinfer", True, True)
        pytest.xfail(f"fp8_attention refused at load: {fp8_defect[:160]}")

    fp8 = gen("flashinfer", True, True, graph_buckets=[256, 512], max_captures=4)
    step = fp8.engine.step
    assert step.attention.name == "flashinfer" and step.attention.fp8
    assert step.captures == 2, f"warmup captured {step.captures} of the 2 buckets"
    eager, bf16, ref = gen("flashinfer", True, False), gen("flashinfer", False, True), gen("sdpa", True, False)
    lines = []
    for prompt, params in REQUESTS:
        a = fp8.latents(prompt, params).float()
        e = {"captured~eager": rel_l2(a, eager.latents(prompt, params).float()),
             "fp8~bf16": rel_l2(a, bf16.latents(prompt, params).float()),
             "fp8~sdpa_fake_quant": rel_l2(a, ref.latents(prompt, params).float())}  # fmt: skip
        lines.append(f"{prompt}: " + ", ".join(f"{n} {x:.3e}" for n, x in e.items()))
        assert bool(a.isfinite().all()), lines[-1]
        assert e["captured~eager"] < 1e-2, lines[-1]
        assert 1e-4 < e["fp8~bf16"] < ENGINE_FP8_TOL, lines[-1]
        assert e["fp8~sdpa_fake_quant"] < ENGINE_FP8_TOL, lines[-1]
    assert step.captures == 2, f"a mix did not replay a bucket's capture ({step.captures} captures)"
    assert all(key[1] == "flashinfer" for key in step.layouts), [key[1] for key in step.layouts]
    # batched: the per-head scales span the pack, so a request's rounding depends on its batch mates (FP8 noise)
    solo = [fp8.latents(p, q).float().cpu() for p, q in REQUESTS]
    batched = fp8.run_together([fp8.prefill.run(fp8.prefill.validate(p, q, None), None) for p, q in REQUESTS])
    for (prompt, _), r, alone in zip(REQUESTS, batched, solo):
        err = rel_l2(r.latents.float().cpu(), alone)
        assert err < 5e-2, f"{prompt}: batched vs alone rel-L2 {err:.3e}"
    print("\n".join(lines))


def test_fp8_attention_is_refused_where_fa3_cannot_run_it():
    """head_dim 96 is fa2's on Hopper, which has no FP8 kernel: FlashInfer FP8 refuses at load naming the field —
    also under attention auto (no silent SDPA fallback)."""
    pool = KVPool(8, PAGE, 1, KV_HEADS, 96, torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match="fp8_attention: FlashInfer's FP8 attention is its fa3"):
        FlashInferAttention(pool, HEADS, KV_HEADS, 96, fp8=True)
    for name in ("auto", "flashinfer"):
        with pytest.raises(RuntimeError, match="fp8_attention"):
            make_attention(name, pool, HEADS, KV_HEADS, 96, fp8=True)
    assert make_attention("sdpa", pool, HEADS, KV_HEADS, 96, fp8=True).fp8  # the fake-quant reference runs anywhere
