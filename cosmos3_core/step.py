"""The packed denoise step: rows (rows.py) in, per-row velocities or K/V out.

`DenoiseStep` packs rows (each CFG branch is its own segment) into the buffers of their layout
(`graphs.StepLayout`: buffers, attention plan, CUDA graph), runs the GEN tower once over the pack and returns
each row's per-branch velocity, or, for a commit row (an AR window's clean latents, no timestep), its per-branch,
per-layer K/V to append to the stream's context. Tensor layouts: rows.py.

Step caching (cache.py): a branch a row reuses (`Row.reuse`) has no segment in the pack; its velocity comes from
its own embedding plus the reused residual through the output heads (`towers.embed_row`, `output_heads`), so the
packed forward — and every other request's result — is the one it would be without it. For a row that records
(`Row.record`), each branch that runs also returns its block-stack residual, sliced off the pack's.

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
from .model.towers import EAGER, GenKernels, embed_row, output_heads
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
        running = [(r, sum(x is None for x in r.reuse)) for r in rows]
        running = [(r, n) for r, n in running if n]  # a row whose branches all reuse is not in the pack
        residual = any(r.record for r, _ in running)
        key = (  # key[1] names the backend (bench.parity and tests read it)
            tuple((r.tokens.shape[0], r.sound.shape[0], r.action.shape[0], n, r.commit, r.a16) for r, n in running),
            attention.name,
            attention.shape_key(segments),
            residual,
        )
        a16_segments = sum(n for r, n in running if r.a16)  # the running branches' segments only
        a16_rows = segments[a16_segments].start if a16_segments < len(segments) else total
        layout = self.layouts.pop(key, None) or self.layout_class(
            self.model, self.kernels, attention, total, rows[0].tokens.shape[1], segments, self.graph_pool, a16_rows,
            residual,
        )  # fmt: skip
        self.layouts[key] = layout
        while len(self.layouts) > self.MAX_LAYOUTS:
            self.layouts.popitem(last=False)
        return layout, segments

    @torch.inference_mode()
    def __call__(self, rows: list[Row]) -> list[RowOutput]:
        """One GEN pass over all rows' running branches (none when every branch reuses) → per row (in the given
        order) its per-branch velocity (fp32, zero on clean frames), sound and action velocities, and for a recording
        row the residuals; or K/V."""
        order = sorted(range(len(rows)), key=lambda i: not rows[i].a16)  # stable: W8A16 rows first
        if order != sorted(order):
            packed_outputs = self([rows[i] for i in order])
            outputs: list[RowOutput] = [packed_outputs[0]] * len(rows)
            for position, i in enumerate(order):
                outputs[i] = packed_outputs[position]
            return outputs
        fwd = None
        segments: list[Segment] = []
        if any(x is None for r in rows for x in r.reuse):
            layout, segments = self.layout(rows)
            layout.fill(rows, segments)
            had_graph = layout.graph is not None
            fwd = layout.run()
            self.captures += layout.graph is not None and not had_graph
        p = self.model.cfg.latent_patch_size
        out: list[RowOutput] = []
        seg = at = at_a = 0  # at, at_a: the next row of the sound, action predictions
        for row in rows:
            n, s, a = row.tokens.shape[0], row.sound.shape[0], row.action.shape[0]
            result = RowOutput([], [])
            embedded = None  # a reusing row's block-stack input: the same in both branches (no text in it)
            for reuse in row.reuse:
                if row.commit:
                    result.kv.append(fwd.kv[seg])  # type: ignore[union-attr]
                    seg += 1
                    continue
                ran = None  # a running branch's block-stack residual (a copy: the layout's buffer is reused)
                if reuse is not None:
                    if embedded is None:
                        embedded = embed_row(self.model, row.tokens, row.sound, row.action, row.action_domain,
                                             row.noisy_mask, row.timestep)  # fmt: skip
                    v, sv, av = output_heads(self.model, embedded + reuse, n, s, row.action_domain)
                else:
                    start = segments[seg].start
                    v = fwd.preds[start : start + n]  # type: ignore[union-attr]
                    sv = fwd.sound[at : at + s] if s else None  # type: ignore[union-attr,index]
                    av = fwd.action[at_a : at_a + a] if a else None  # type: ignore[union-attr,index]
                    ran = fwd.residual[start : start + n + s + a].clone() if row.record else None  # type: ignore[union-attr,index]
                    at, at_a, seg = at + s, at_a + a, seg + 1
                if row.record:
                    result.residual.append(ran)
                # zero on clean tokens; the product is a new tensor (preds is the layout's, reused next step)
                v = v.float() * row.noisy_mask[:n, None]
                result.velocity.append(unpatchify(v, row.token_shape, p, row.latent_hw))
                if s:  # every sound token is noisy: its velocity as predicted, [sound_dim, T_s]
                    result.sound_velocity.append(sv.float().t().clone())  # type: ignore[union-attr]
                if a:  # zero on clean action tokens (forward dynamics); the product is a new tensor
                    result.action_velocity.append(av.float() * row.noisy_mask[n + s :, None])  # type: ignore[union-attr]
            out.append(result)
        return out
