"""The attention a tower layer calls, defined here so the towers (model/towers.py) need nothing from the serving
layers above them: `sdpa`, one sequence's attention (the UND tower's causal text pass, the fused reference), and
`Attend`, what a packed GEN pass calls per layer. The step's attention plans (cosmos3_core/attention.py) are
`Attend`s: they gather each segment's prefix K/V from the pool and attend over `[prefix | own]`.

Layouts: q `[N, heads, d]`, k/v `[M, kv_heads, d]` (GQA: heads a multiple of kv_heads); output `[N, heads * d]`.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """q [N, heads, d], k/v [M, kv_heads, d] → [N, heads*d]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=causal, enable_gqa=True
    )  # [1, heads, N, d]
    return out[0].transpose(0, 1).flatten(-2)


class Attend(Protocol):
    """A packed GEN pass's attention: q [rows, heads, d], k/v [rows, kv_heads, d] of the pack's own rows at
    `layer` → [rows, heads * d], each segment's rows attending to its prefix (wherever the callee keeps it) and its
    own rows."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor: ...
