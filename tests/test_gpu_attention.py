"""FlashInfer's bf16 attention plan (`FlashInferPlan`: one ragged call over gathered `[prefix | own]` K/V) on the
GPU, at the attention call, against SDPA in fp32 (skipped without CUDA or flashinfer). The engine-level tests
(test_gpu.py) hold whole requests to the same references; this one localizes a failure to the gather:

    .venv/bin/python -m pytest tests/test_gpu_attention.py -v

Prefixes of several page lists with partial pages (kv streams' context frames), padding between and after the
segments, exact and bucketed plans, eager and a captured CUDA graph replayed with another mix."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cosmos3_core.attention import FlashInferAttention, SdpaAttention
from cosmos3_core.kv_pool import KVPool
from cosmos3_core.rows import Segment
from tests.conftest import capture_plan, rel_l2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer"),
]

HEADS, KV_HEADS, HEAD_DIM, PAGE = 8, 2, 128, 16
BF16_TOL = 1e-2  # one bf16 attention call against fp32 (measured ~3e-3 for SDPA bf16)


def pack(seed: int, pool: KVPool):
    """Segments with text and context-frame prefixes (two partial lists in one prefix), padding after each."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    text = [pool.alloc(n) for n in (37, 32, 5)]
    frames = [pool.alloc(n) for n in (24, 24)]  # 24 tokens a frame: 1.5 pages each
    segments = [Segment(0, 300, (text[0],), False), Segment(320, 64, (text[1], frames[0], frames[1]), False),
                Segment(384, 150, (frames[0], text[2]), False)]  # fmt: skip
    rows = 576
    q = torch.randn(rows, HEADS, HEAD_DIM, device="cuda", generator=g).bfloat16()
    k = torch.randn(rows, KV_HEADS, HEAD_DIM, device="cuda", generator=g).bfloat16()
    v = torch.randn(rows, KV_HEADS, HEAD_DIM, device="cuda", generator=g).bfloat16()
    real = torch.cat([torch.arange(s.start, s.start + s.length) for s in segments]).cuda()
    return segments, rows, q, k, v, real


def exact(pool: KVPool, rows: int, segments, q, k, v, layer: int) -> torch.Tensor:
    saved = pool.k_pages, pool.v_pages
    pool.k_pages, pool.v_pages = pool.k_pages.float(), pool.v_pages.float()
    try:
        plan = SdpaAttention(pool).make_plan(rows)
        plan.update(segments)
        return plan(q.float(), k.float(), v.float(), layer)
    finally:
        pool.k_pages, pool.v_pages = saved


@pytest.fixture()
def pool():
    pool = KVPool(64, PAGE, 2, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
    pool.k_pages.normal_()
    pool.v_pages.normal_()
    return pool


@pytest.mark.parametrize("slots", [0, 8], ids=["exact", "bucketed"])
def test_gathered_ragged_attention_equals_fp32(pool, slots):
    segments, rows, q, k, v, real = pack(0, pool)
    plan = FlashInferAttention(pool, HEADS, KV_HEADS, HEAD_DIM).make_plan(rows, slots)
    plan.update(segments)
    for layer in (0, 1):
        out = plan(q, k, v, layer)
        torch.cuda.synchronize()
        assert bool(out.isfinite().all()), "padding rows too must come out finite"
        ref = exact(pool, rows, segments, q, k, v, layer)
        bf16 = SdpaAttention(pool).make_plan(rows)
        bf16.update(segments)
        e_fi = rel_l2(out[real].float(), ref[real])
        e_sd = rel_l2(bf16(q, k, v, layer)[real].float(), ref[real])
        assert e_fi < BF16_TOL and e_fi < 1.5 * e_sd + 1e-4, f"layer {layer}: flashinfer {e_fi:.3e}, sdpa {e_sd:.3e}"


def test_gathered_plan_captured_and_replayed_with_another_mix(pool):
    segments, rows, q, k, v, real = pack(1, pool)
    plan = FlashInferAttention(pool, HEADS, KV_HEADS, HEAD_DIM).make_plan(rows, 8)
    plan.update(segments)
    graph, bufs, out = capture_plan(plan, q, k, v)
    first = rel_l2(out[real].float(), exact(pool, rows, segments, q, k, v, 0)[real])
    assert first < BF16_TOL, f"replay, the captured mix: {first:.3e}"
    text = [pool.alloc(48), pool.alloc(7)]
    mix = [Segment(0, 128, (text[0],), False), Segment(128, 400, (text[1],), False)]  # another mix, same bucket
    _, _, q2, k2, v2, _ = pack(2, pool)
    plan.update(mix)
    for buf, x in zip(bufs, (q2, k2, v2)):
        buf.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    real2 = torch.arange(0, 528, device="cuda")
    second = rel_l2(out[real2].float(), exact(pool, rows, mix, q2, k2, v2, 0)[real2])
    assert second < BF16_TOL and bool(out.isfinite().all()), f"replay with a new mix: {second:.3e} (first {first:.3e})"
