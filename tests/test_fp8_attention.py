"""`fp8_attention` on the CPU: the SDPA backend's fake quant (attention.py) — E4M3 q (per-head dynamic scales over the
pack's segment rows) and [prefix | own] K/V (scales over the segments' rows and every prefix token) — checked
against a hand-written reference of one attention call (exactly), through the real step on a tiny checkpoint (near the unquantized result, not equal to
it), and the deployment field's validation. FlashInfer's FA3 FP8 kernel against this reference: test_gpu_fp8attn.py.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cosmos3_core.attention import (
    FP8_CHECK_RATIO,
    SdpaAttention,
    fp8_kernel_check,
    make_attention,
    quantize_fp8,
    quantize_qkv,
    sdpa,
)
from cosmos3_core.deployment import Deployment
from cosmos3_core.generate import Generator
from cosmos3_core.kv_pool import KVPool
from cosmos3_core.rows import Segment
from cosmos3_core.tools.warm import flashinfer_kernels
from tests.conftest import rel_l2

CONFIGS = Path(__file__).parent.parent / "configs"
PROMPT = "a red fox runs through snow"
T2V = {"num_frames": 9, "height": 64, "width": 96, "steps": 4, "seed": 1, "guidance_scale": 4.0}
# rel-L2 of the final latents, fp8_attention vs not, on the nano checkpoint (fp32 CPU): measured 9.5e-3 (E4M3 has 3
# mantissa bits: ~2^-5 relative rounding per element, averaged down by the attention's sums); the bar leaves 3x
FP8_ATTN_TOL = 3e-2


def fake_quant_reference(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Written out: per head h, s_h = max |t[:, h, :]| over all the parts / 448; each t → e4m3(t / s_h) · s_h."""
    out = [torch.empty_like(t) for t in parts]
    for h in range(parts[0].shape[1]):
        s = max(t[:, h].abs().max().item() for t in parts) / 448.0
        for t, o in zip(parts, out):
            o[:, h] = (t[:, h] / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32) * s
    return out


def test_quantize_fp8_scales_per_head_over_the_segment_rows_only():
    torch.manual_seed(0)
    x = torch.randn(10, 3, 8) * torch.tensor([1.0, 10.0, 0.01])[:, None]
    x[8:] = 1e4  # padding rows: never set the scale
    valid = torch.tensor([True] * 8 + [False] * 2)
    x8, scale = quantize_fp8(x, valid)
    assert x8.dtype == torch.float8_e4m3fn and scale.shape == (3,) and scale.dtype == torch.float32
    assert torch.equal(scale, x[:8].abs().amax(dim=(0, 2)) / 448.0)
    assert torch.equal(x8[:8].float().abs().amax(dim=(0, 2)), torch.full((3,), 448.0))  # each head's amax hits 448
    assert torch.equal(x8[8:].float(), torch.full((2, 3, 8), 448.0))  # padding clamps, no inf / nan
    err = rel_l2(x8[:8].float() * scale[:, None], x[:8])
    assert 1e-3 < err < 4e-2, err  # E4M3 rounding: 3 mantissa bits
    zeros, s0 = quantize_fp8(torch.zeros(4, 2, 8), torch.ones(4, dtype=torch.bool))
    assert torch.equal(zeros.float(), torch.zeros(4, 2, 8)) and bool((s0 > 0).all())  # no division by zero


def test_compiled_quantization_equals_the_eager_one():
    """FlashInfer FP8 quantizes through `torch.compile(quantize_qkv, dynamic=True)` when the deployment compiles: one
    graph for every pack size, and the eager values: scales within one fp32 unit (on CUDA Inductor multiplies by
    1/448's fp32 reciprocal; here it divides, and matches exactly), E4M3 codes one step apart at most, rarely. A
    scale from the wrong rows (padding in the amax) or a cast without the clamp fails here."""
    compiled = torch.compile(quantize_qkv, dynamic=True)
    for rows, keys in ((300, 900), (577, 8256)):  # two sizes: the second must not recompile wrongly
        g = torch.Generator().manual_seed(rows)
        q = (torch.randn(rows, 4, 16, generator=g) * torch.linspace(0.5, 3.0, 4)[:, None]).bfloat16()
        k, v = (torch.randn(keys, 2, 16, generator=g).bfloat16() for _ in range(2))
        valid_rows, valid_keys = torch.rand(rows, generator=g) > 0.2, torch.rand(keys, generator=g) > 0.3
        q[~valid_rows] = 1e4  # padding rows: out of range, clamped, and not in the scale
        for (x8, sx), (y8, sy) in zip(compiled(q, k, v, valid_rows, valid_keys),
                                      quantize_qkv(q, k, v, valid_rows, valid_keys)):  # fmt: skip
            torch.testing.assert_close(sx, sy, rtol=2.5e-7, atol=0)
            step = (x8.float() - y8.float()).abs() / y8.float().abs().clamp_min(2**-6)
            assert float(step.max()) <= 0.125 and float((x8.float() != y8.float()).float().mean()) < 1e-3, (rows, keys)


def test_sdpa_fp8_plan_equals_the_hand_written_fake_quant_reference():
    """One attention call of the SDPA backend with fp8: two segments with their own prefix pages (quantized with
    the own K/V: one scale per head over both), padding rows between and after (excluded from the scales), GQA —
    equal, element for element, to the reference."""
    torch.manual_seed(1)
    heads, kv_heads, d, ps = 4, 2, 16, 4
    pool = KVPool(16, ps, 2, kv_heads, d, torch.float32, "cpu")
    pool.k_pages.normal_()
    pool.v_pages.normal_()
    text = [pool.alloc(6), pool.alloc(9)]
    segments = [Segment(0, 20, (text[0],), False), Segment(24, 13, (text[1],), False)]
    n = 40  # rows 20..23 and 37..39: padding
    q, k, v = (torch.randn(n, h, d) for h in (heads, kv_heads, kv_heads))
    q[20:24], k[37:] = 50.0, -50.0  # large padding values: they must not move the scales
    layer = 1

    plan = SdpaAttention(pool, fp8=True).make_plan(n)
    plan.update(segments)
    ours = plan(q, k, v, layer)

    rows = [slice(s.start, s.start + s.length) for s in segments]
    prefixes = [pool.gather(layer, seg.prefix[0]) for seg in segments]  # (k, v) each
    qd = fake_quant_reference([q[r] for r in rows])
    kd = fake_quant_reference([k[r] for r in rows] + [kp for kp, _ in prefixes])
    vd = fake_quant_reference([v[r] for r in rows] + [vp for _, vp in prefixes])
    n_seg = len(segments)
    for i, (seg, r) in enumerate(zip(segments, rows)):
        keys, values = torch.cat([kd[n_seg + i], kd[i]]), torch.cat([vd[n_seg + i], vd[i]])  # [prefix | own]
        ref = F.scaled_dot_product_attention(
            qd[i].transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], enable_gqa=True
        )[0].transpose(0, 1)
        assert torch.equal(ours[r], ref.flatten(-2)), seg
    plain = SdpaAttention(pool).make_plan(n)
    plain.update(segments)
    err = rel_l2(ours[rows[0]], plain(q, k, v, layer)[rows[0]])
    assert 1e-4 < err < 5e-2, err  # quantized: near the unquantized attention, not equal to it


def test_fp8_attention_through_the_real_step_is_near_the_unquantized_result(nano_ckpt):
    """A full request (CFG, 4 steps) on the tiny nano checkpoint, fp32 on the CPU: fp8_attention (SDPA fake quant)
    differs from plain attention by FP8 rounding — within FP8_ATTN_TOL, and not zero (the switch reaches every
    step)."""
    base = Deployment(checkpoint=str(nano_ckpt), device="cpu", dtype="float32")
    plain = Generator(base).latents(PROMPT, dict(T2V))
    gen = Generator(replace(base, fp8_attention=True))
    assert gen.engine.step.attention.fp8
    fp8 = gen.latents(PROMPT, dict(T2V))
    again = gen.latents(PROMPT, dict(T2V))
    err = rel_l2(fp8, plain)
    print(f"fp8_attention vs plain: rel-L2 {err:.2e}")
    assert 1e-4 < err < FP8_ATTN_TOL, err
    assert torch.equal(fp8, again)  # deterministic


def test_make_attention_with_fp8_on_the_cpu():
    pool = KVPool(4, 4, 1, 2, 16, torch.float32, "cpu")
    assert make_attention("auto", pool, 4, 2, 16, fp8=True).fp8  # the CPU: the SDPA fake-quant reference
    assert make_attention("sdpa", pool, 4, 2, 16, fp8=True).fp8
    assert not make_attention("sdpa", pool, 4, 2, 16).fp8
    with pytest.raises(ValueError, match="flashinfer needs a CUDA device"):
        make_attention("flashinfer", pool, 4, 2, 16, fp8=True)


def dequantized_kernel(across: bool = False):
    """A stand-in for FA3's FP8 kernel: exact attention over the dequantized E4M3 inputs, per sequence of `indptr`
    (a correct kernel, but for its own rounding of P); `across`: every query attends every key of the batch, as a
    kernel that loses the sequence boundaries would."""

    def kernel(q8, k8, v8, sq, sk, sv, indptr):
        q, k, v = (x8.float() * s[:, None] for x8, s in ((q8, sq), (k8, sk), (v8, sv)))
        bounds = [0, indptr[-1].item()] if across else indptr.tolist()
        return torch.cat([sdpa(q[a:b], k[a:b], v[a:b], False) for a, b in zip(bounds[:-1], bounds[1:])])

    return kernel


@pytest.mark.parametrize("heads, kv_heads", [(8, 8), (8, 2)], ids=["mha", "gqa"])
def test_the_fp8_load_check_passes_a_right_kernel_and_refuses_a_wrong_one(heads, kv_heads):
    """`fp8_kernel_check` (FlashInfer's FP8 kernel at load, GPU-tested in test_gpu_fp8attn.py) on the CPU: a kernel
    that attends each sequence over the E4M3 inputs is at the rounding's own error; one that attends across the
    batch's sequences is far outside FP8_CHECK_RATIO."""
    err, rounding = fp8_kernel_check(dequantized_kernel(), heads, kv_heads, 128, "cpu")
    assert 1e-2 < rounding < 0.1 and err == pytest.approx(rounding, rel=1e-6), (err, rounding)
    err, rounding = fp8_kernel_check(dequantized_kernel(across=True), heads, kv_heads, 128, "cpu")
    assert err > 3 * FP8_CHECK_RATIO * rounding, (err, rounding)


@pytest.mark.parametrize(
    "text, message",
    [
        ("fp8_attention: fp8\n", "fp8_attention: true or false; got 'fp8'"),
        ("fp8_attention: 1\n", "fp8_attention: true or false; got 1"),
        ("fp8_attention: true\nparallel: {cfg: 2}\n", "fp8_attention: a single-GPU denoise only"),
        ("fp8_attention: true\nparallel: {ulysses: 2}\n", "fp8_attention: a single-GPU denoise only"),
    ],
)
def test_fp8_attention_is_validated_at_load_naming_the_field(tmp_path, text, message):
    path = tmp_path / "d.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        Deployment.load(path)


def test_the_fp8attn_bench_config_is_the_fp8_one_with_fp8_attention():
    fp8, ours = Deployment.load(CONFIGS / "bench_edge_fp8.yaml"), Deployment.load(CONFIGS / "bench_edge_fp8attn.yaml")
    assert ours.fp8_attention and not fp8.fp8_attention
    assert {**fp8.__dict__, "fp8_attention": True} == ours.__dict__
    assert not Deployment.load(CONFIGS / "bench_edge.yaml").fp8_attention  # off by default
    # warm builds the FP8 module (attention.flashinfer_module_specs: fa3 only)
    assert flashinfer_kernels(ours, 128, "9.0a") == [("fa3", torch.bfloat16, 128, True)]
