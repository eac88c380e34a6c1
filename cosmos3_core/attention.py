"""GEN attention over [prefix K/V in the pool | the segment's own tokens], ragged across a packed step.

A packed step is a list of segments (one per request and CFG branch): rows `start:start+length` of q/k/v
belong to the segment and attend, non-causally and with GQA, to the branch's prefix K/V (text, then any
committed AR context frames) followed by the segment's own K/V. This is the reference path (torch SDPA per segment; CPU and any device); GPU paths
plug in behind `gen_attention` with the same arguments.

Layouts: q `[rows, heads, d]`, k/v `[rows, kv_heads, d]`; output `[rows, heads * d]`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .kv_pool import KVPool

if TYPE_CHECKING:
    from .step import Segment


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """q [N, heads, d], k/v [M, kv_heads, d] → [N, heads*d]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=causal, enable_gqa=True
    )  # [1, heads, N, d]
    return out[0].transpose(0, 1).flatten(-2)


def gen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KVPool, layer: int, segments: list[Segment]
) -> torch.Tensor:
    out = torch.zeros(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)  # padding rows stay 0
    for seg in segments:
        rows = slice(seg.start, seg.start + seg.length)
        prefix = [pool.gather(layer, pages) for pages in seg.prefix]
        keys = torch.cat([pk for pk, _ in prefix] + [k[rows]])
        values = torch.cat([pv for _, pv in prefix] + [v[rows]])
        out[rows] = sdpa(q[rows], keys, values, causal=False)
    return out
