"""The packed denoise step: rows (rows.py) in, per-row velocities or K/V out.

`DenoiseStep` packs rows (each CFG branch is its own segment) into the buffers of their layout
(`graphs.StepLayout`: buffers, attention plan, CUDA graph), runs the GEN tower once over the pack and returns
each row's per-branch velocity, or, for a commit row (an AR window's clean latents, no timestep), its per-branch,
per-layer K/V to append to the stream's context. Tensor layouts: rows.py.

FP8 precision is per row (`Row.a16`): the step packs W8A16 rows before W8A8 ones (a stable partition) and gives the
layout the row where W8A8 starts; outputs come back in the callers' order.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .attention import Backend, SdpaAttention, make_attention
from .graphs import StepLayout
from .kv_pool import KVPool
from .model.layers import Cosmos3Transformer
from .model.towers import EAGER, GenKernels
from .rows import Row, RowOutput, Segment, segments_of, unpatchify


class DenoiseStep:
    """Runs denoise steps over packed rows. Owns the attention backend and, per layout (row sizes, branches,
    commit flags, and whatever the backend's shapes depend on), a `StepLayout`: input buffers, attention plan
    and, on CUDA with `cuda_graphs`, the captured forward. The most recent MAX_LAYOUTS layouts are kept."""

    MAX_LAYOUTS = 16
    layout_class = StepLayout  # parallel/ulysses.py: layouts that split the pack's rows over ranks

    def __init__(
        self,
        model: Cosmos3Transformer,
        pool: KVPool,
        kernels: GenKernels = EAGER,
        attention: str | Backend = "auto",
        cuda_graphs: bool = True,
    ):
        cfg = model.cfg
        self.model, self.pool, self.kernels = model, pool, kernels
        self.attention = (
            make_attention(attention, pool, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
            if isinstance(attention, str)
            else attention  # a backend made by the caller (parallel/ulysses.py: over a head-sharded pool)
        )
        self.sdpa = self.attention if isinstance(self.attention, SdpaAttention) else SdpaAttention(pool)
        self.cuda_graphs = cuda_graphs and pool.k_pages.is_cuda
        self.graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None  # shared: replays are serial
        self.layouts: OrderedDict[tuple, StepLayout] = OrderedDict()
        self.captures = 0

    def layout(self, rows: list[Row]) -> tuple[StepLayout, list[Segment]]:
        """`rows`: W8A16 rows first (see `__call__`)."""
        segments, total = segments_of(rows)
        attention = self.attention if self.attention.supports(segments) else self.sdpa
        key = (
            tuple(
                (r.tokens.shape[0], r.sound.shape[0], r.action.shape[0], len(r.branches), r.commit, r.a16) for r in rows
            ),
            attention.name,
            attention.shape_key(segments),
        )
        a16_segments = sum(len(r.branches) for r in rows if r.a16)
        a16_rows = segments[a16_segments].start if a16_segments < len(segments) else total
        layout = self.layouts.pop(key, None) or self.layout_class(
            self.model, self.kernels, attention, total, rows[0].tokens.shape[1], segments, self.graph_pool, a16_rows
        )
        self.layouts[key] = layout
        while len(self.layouts) > self.MAX_LAYOUTS:
            self.layouts.popitem(last=False)
        return layout, segments

    @torch.inference_mode()
    def __call__(self, rows: list[Row]) -> list[RowOutput]:
        """One GEN pass over all rows → per row (in the given order) its per-branch velocity (fp32, zero on clean
        frames), sound and action velocities, or K/V."""
        order = sorted(range(len(rows)), key=lambda i: not rows[i].a16)  # stable: W8A16 rows first
        if order != sorted(order):
            packed_outputs = self([rows[i] for i in order])
            outputs: list[RowOutput] = [packed_outputs[0]] * len(rows)
            for position, i in enumerate(order):
                outputs[i] = packed_outputs[position]
            return outputs
        layout, segments = self.layout(rows)
        layout.fill(rows, segments)
        had_graph = layout.graph is not None
        preds, sound_preds, action_preds, collected = layout.run()
        self.captures += layout.graph is not None and not had_graph
        p = self.model.cfg.latent_patch_size
        out: list[RowOutput] = []
        seg = at = at_a = 0  # at, at_a: the next row of sound_preds, action_preds
        for row in rows:
            n, s, a = row.tokens.shape[0], row.sound.shape[0], row.action.shape[0]
            result = RowOutput([], [])
            for _ in row.branches:
                if row.commit:
                    result.kv.append(collected[seg])
                else:
                    start = segments[seg].start
                    # zero on clean tokens; the product is a new tensor (preds is the layout's, reused next step)
                    v = preds[start : start + n].float() * row.noisy_mask[:n, None]
                    result.velocity.append(unpatchify(v, row.token_shape, p, row.latent_hw))
                    if s:  # every sound token is noisy: its velocity as predicted, [sound_dim, T_s]
                        result.sound_velocity.append(sound_preds[at : at + s].float().t().clone())
                        at += s
                    if a:  # zero on clean action tokens (forward dynamics); the product is a new tensor
                        mask = row.noisy_mask[n + s :, None]
                        result.action_velocity.append(action_preds[at_a : at_a + a].float() * mask)
                        at_a += a
                seg += 1
            out.append(result)
        return out
