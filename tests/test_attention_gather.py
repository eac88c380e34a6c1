"""FlashInfer's gathered `[prefix | own]` K/V layout (`attention.gather_layout`), host side, no GPU: the layout's
index buffers applied with the same index ops the plan runs, then one SDPA per request as FlashInfer's ragged
kernel computes it (queries `qo_indptr[r]:qo_indptr[r+1]` over keys `kv_indptr[r]:kv_indptr[r+1]`), equal the
SDPA backend on every segment row. The layout goes through the same packing, unpacking and gather the plan runs.
Every kv row must be written exactly once: FA3 loads K/V by whole tiles bounded by the buffer's length, not a
request's, and multiplies the masked rows' V by 0 (an unwritten NaN · 0 = NaN)."""

from __future__ import annotations

import pytest
import torch

from cosmos3_core.attention import (
    PREFIX_MIN_CAPACITY,
    SdpaAttention,
    _empty_requests,
    gather_kv,
    gather_layout,
    prefix_capacity,
    quantize_fp8,
    sdpa,
    segment_rows,
    unpack_index,
)
from cosmos3_core.kv_pool import KVPool
from cosmos3_core.rows import Segment

HEADS, KV_HEADS, D, PAGE = 4, 2, 16, 4


def ragged_over_layout(pool: KVPool, layer: int, rows: int, capacity: int, segments, q, k, v) -> torch.Tensor:
    layout = gather_layout(segments, rows, PAGE, capacity)
    qo, kv = layout.qo_indptr, layout.kv_indptr
    assert kv[-1] == rows + len([t for s in segments for p in s.prefix for t in range(p.num_tokens)])
    own_dst, prefix_src, prefix_dst = index = unpack_index(layout.packed(), rows)
    assert torch.equal(own_dst, layout.own_dst) and torch.equal(prefix_src, layout.prefix_src)
    written = torch.cat([own_dst, prefix_dst]).sort().values
    assert torch.equal(written, torch.arange(rows + capacity)), "each kv row written exactly once"
    bufs = [gather_kv(k, pool.k_pages[layer], *index), gather_kv(v, pool.v_pages[layer], *index)]
    assert len(bufs[0]) == rows + capacity and all(b.isfinite().all() for b in bufs)
    out = torch.full((rows, HEADS * D), float("nan"))
    for r in range(len(qo) - 1):
        if qo[r + 1] > qo[r]:
            keys = slice(kv[r], kv[r + 1])
            out[qo[r] : qo[r + 1]] = sdpa(q[qo[r] : qo[r + 1]], bufs[0][keys], bufs[1][keys], causal=False)
    return out


def test_gathered_layout_attends_as_sdpa():
    torch.manual_seed(0)
    pool = KVPool(64, PAGE, 2, KV_HEADS, D, torch.float32, "cpu")
    pool.k_pages.normal_()
    pool.v_pages.normal_()
    text = [pool.alloc(n) for n in (7, 8, 3, 5)]
    context = [pool.alloc(n) for n in (6, 6)]  # kv stream context frames: partial pages, two lists in one prefix
    segments = [
        Segment(0, 50, (text[0],), False),
        Segment(64, 64, (text[1], context[0], context[1]), False),  # no padding after it
        Segment(128, 3, (text[2],), False),
        Segment(192, 70, (context[0], text[3]), False),
    ]
    rows = 320  # the last segment's padding runs to a bucket's end
    q = torch.randn(rows, HEADS, D)
    k, v = torch.randn(rows, KV_HEADS, D), torch.randn(rows, KV_HEADS, D)
    capacity = prefix_capacity(segments)
    assert capacity == PREFIX_MIN_CAPACITY
    plan = SdpaAttention(pool).make_plan(rows)
    plan.update(segments)
    for layer in (0, 1):
        ref = plan(q, k, v, layer)
        out = ragged_over_layout(pool, layer, rows, capacity, segments, q, k, v)
        assert out.isfinite().all(), "padding rows must attend to something finite too"
        for s in segments:
            r = slice(s.start, s.start + s.length)
            torch.testing.assert_close(out[r], ref[r], rtol=1e-5, atol=1e-5)


def test_fp8_scales_over_the_gather_equal_the_sdpa_fake_quant():
    """FlashInfer's FP8 path on the gather (q's scales over the segment rows, K's and V's over `segment_keys`:
    every segment's prefix tokens and own rows, not the padding requests' nor the unused capacity entries'), with
    the kernel's per-request attention done by SDPA over the dequantized values, equals the SDPA backend's fake
    quant exactly — outliers in the padding rows and in pool token 0 (in no prefix; unused entries copy the pack's own
    first prefix token) must not count."""
    torch.manual_seed(3)
    pool = KVPool(32, PAGE, 1, KV_HEADS, D, torch.float32, "cpu")
    pool.k_pages.normal_()
    pool.v_pages.normal_()
    pool.alloc(1)  # token 0's page: not in any prefix
    pool.k_pages[0, 0, 0] = pool.v_pages[0, 0, 0] = 1e3
    text, frames = pool.alloc(7), [pool.alloc(6), pool.alloc(6)]
    segments = [Segment(0, 50, (text, frames[0], frames[1]), False), Segment(64, 30, (frames[0],), False)]
    rows, capacity = 128, PREFIX_MIN_CAPACITY
    q, k, v = torch.randn(rows, HEADS, D), torch.randn(rows, KV_HEADS, D), torch.randn(rows, KV_HEADS, D)
    q[50:64], k[94:], v[94:] = 1e3, -1e3, 1e3  # padding rows
    layout = gather_layout(segments, rows, PAGE, capacity)
    index = unpack_index(layout.packed(), rows)
    (q8, sq), (k8, sk), (v8, sv) = (
        quantize_fp8(q, segment_rows(segments, rows)),
        quantize_fp8(gather_kv(k, pool.k_pages[0], *index), layout.segment_keys),
        quantize_fp8(gather_kv(v, pool.v_pages[0], *index), layout.segment_keys),
    )
    qd, kd, vd = ((x8.float() * s[:, None]) for x8, s in ((q8, sq), (k8, sk), (v8, sv)))
    plan = SdpaAttention(pool, fp8=True).make_plan(rows)
    plan.update(segments)
    ref = plan(q, k, v, 0)
    qo, kv = layout.qo_indptr, layout.kv_indptr
    for r, seg in zip((0, 2), segments):  # requests 0 and 2: the segments (1 and 3: their padding)
        assert qo[r] == seg.start and qo[r + 1] == seg.start + seg.length
        out = sdpa(qd[qo[r] : qo[r + 1]], kd[kv[r] : kv[r + 1]], vd[kv[r] : kv[r + 1]], causal=False)
        assert torch.equal(out, ref[qo[r] : qo[r + 1]]), seg


def test_gathered_layout_requests_and_capacity():
    pool = KVPool(64, PAGE, 1, KV_HEADS, D, torch.float32, "cpu")
    text = pool.alloc(9)
    segments = [Segment(64 * i, 40, (text,), False) for i in range(3)]
    layout = gather_layout(segments, 512, PAGE, 32)
    qo, kv = layout.qo_indptr, layout.kv_indptr
    assert qo == [0, 40, 64, 104, 128, 168, 512]  # each segment, then its padding as a request of its own
    assert kv == [0, 49, 73, 122, 146, 195, 539]  # a segment's keys: its 9 prefix tokens, then its 40 rows
    assert layout.prefix_src[:9].tolist() == [text.pages[t // PAGE] * PAGE + t % PAGE for t in range(9)]
    assert layout.prefix_dst[27:].tolist() == [539, 540, 541, 542, 543]  # unused: the rows after the last keys
    _empty_requests(qo, kv, 16)  # a bucket of 8 segment slots
    assert len(qo) == len(kv) == 17 and qo[-1] == 512 and kv[-1] == 539
    with pytest.raises(ValueError, match="requests exceed"):
        _empty_requests(qo, kv, 8)
    with pytest.raises(ValueError, match="capacity of 16"):
        gather_layout(segments, 512, PAGE, 16)  # 27 prefix tokens


@pytest.mark.parametrize(("tokens", "capacity"), [(1, 8192), (8192, 8192), (8193, 16384), (20000, 32768)])
def test_prefix_capacity_is_a_power_of_two_of_at_least_the_minimum(tokens, capacity):
    pool = KVPool(8192, PAGE, 1, KV_HEADS, D, torch.float32, "cpu")
    assert prefix_capacity([Segment(0, 64, (pool.alloc(tokens),), False)]) == capacity
