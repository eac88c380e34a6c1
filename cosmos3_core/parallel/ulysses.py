"""Ulysses sequence parallelism for one CFG group's packed step (DeepSpeed-Ulysses / xDiT's USP, heads-wise).

With u ranks in the group, every rank holds the same packed step (`graphs.StepLayout`'s buffers, `S` rows, a
multiple of 64 so `S / u` is whole) and runs the GEN tower's per-token work (embedding, QKV, norms, rotary,
output projection, MLP) over its own contiguous rows `[j·S/u, (j+1)·S/u)` only (`UlyssesLayout`: views of the
layout's buffers, so a CUDA graph captures them like any other). Attention is the only place rows meet:
`UlyssesPlan` exchanges q/k/v by all-to-all so that rank j holds ALL rows for its heads — query heads
`[j·H/u, (j+1)·H/u)` and the K/V heads they read (`ParallelConfig.kv_heads_of`: GQA groups stay whole; when
u > kv_heads, ranks share a K/V head) — runs the unchanged backend (SDPA or FlashInfer) over the segments with
the pool's pages, which hold exactly those K/V heads (the pool is sharded by heads), and all-to-alls the output
back to rows. A rank embeds and projects out the sound and action tokens among its rows (`sound`, `action`,
their rows and action domains sliced per rank). Predictions, sound and action predictions (and, for step caching,
the block stack's residual rows) are all-gathered to `[S, ...]`, `[R, ...]`, `[A, ...]` (`[S, hidden]`), so
`DenoiseStep` reads them as in one process. FP8: the pack's W8A16 rows come first (`PackedStep.a16_rows`;
`DenoiseStep` orders the rows by precision), so a rank's slice starts with its share of them — its `a16_rows` is
the pack's clamped to the slice — and every FP8 linear is per row (per-token or static activation scales), so
slicing changes no row's result. A commit pass's K/V is
collected inside the plan (rank j: its K/V heads, all rows) and all-gathered over heads.

Layouts: local q `[S/u, H, d]`, k/v `[S/u, KV, d]` → exchanged q `[S, H/u, d]`, k/v `[S, KV_j, d]` → backend
output `[S, H/u·d]` → local `[S/u, H·d]`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..attention import Backend, make_attention
from ..graphs import PackedStep, StepLayout
from ..kv_pool import KVPool
from ..model.layers import Cosmos3Transformer
from ..model.towers import GenKernels, GenOutput, gen_forward
from ..rows import Segment
from ..step import DenoiseStep
from .comm import Comm, all_gather_rows


class UlyssesPlan:
    def __init__(self, inner: Any, comm: Comm, heads: int, kv_heads: int):
        self.inner, self.comm = inner, comm
        u = comm.parallel.ulysses
        self.q_heads = [(j * heads // u, (j + 1) * heads // u) for j in range(u)]
        self.kv_heads = [comm.parallel.kv_heads_of(j, heads, kv_heads) for j in range(u)]
        self.collect: list[tuple[int, slice]] = []
        self.ks: dict[int, list[torch.Tensor]] = {}
        self.vs: dict[int, list[torch.Tensor]] = {}

    def update(self, segments: list[Segment]) -> None:
        self.inner.update(segments)
        self.collect = [(i, slice(s.start, s.start + s.length)) for i, s in enumerate(segments) if s.collect_kv]

    def _to_heads(self, x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """[S/u, heads, d] (my rows) → [S, heads_j, d] (all rows, my heads)."""
        group = self.comm.ulysses_group
        send = [x[:, lo:hi].contiguous() for lo, hi in spans]
        j = self.comm.ulysses_index
        recv = [torch.empty(x.shape[0], spans[j][1] - spans[j][0], x.shape[2], dtype=x.dtype, device=x.device)
                for _ in spans]  # fmt: skip
        dist.all_to_all(recv, send, group=group)
        return torch.cat(recv)

    def _to_rows(self, out: torch.Tensor, d: int) -> torch.Tensor:
        """[S, H/u·d] (all rows, my heads) → [S/u, H·d] (my rows, all heads)."""
        u = len(self.q_heads)
        send = list(out.chunk(u))
        recv = [torch.empty_like(send[0]) for _ in range(u)]
        dist.all_to_all(recv, [s.contiguous() for s in send], group=self.comm.ulysses_group)
        return torch.cat(recv, dim=1)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        q_all = self._to_heads(q, self.q_heads)
        k_all, v_all = self._to_heads(k, self.kv_heads), self._to_heads(v, self.kv_heads)
        if layer == 0:
            self.ks, self.vs = {i: [] for i, _ in self.collect}, {i: [] for i, _ in self.collect}
        for i, rows in self.collect:
            self.ks[i].append(k_all[rows])
            self.vs[i].append(v_all[rows])
        return self._to_rows(self.inner(q_all, k_all, v_all, layer), q.shape[2])

    def collected(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Commit segments' K/V over all K/V heads: [layers, tokens, KV, d] (all-gathered over heads)."""
        out = {}
        for i in self.ks:
            k, v = torch.stack(self.ks[i]), torch.stack(self.vs[i])
            out[i] = (self._all_heads(k), self._all_heads(v))
        return out

    def _all_heads(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in self.kv_heads]
        dist.all_gather(parts, x.contiguous(), group=self.comm.ulysses_group)
        heads, have = [], 0  # ranks that share a K/V head hold it twice: take each head once, in order
        for (lo, hi), part in zip(self.kv_heads, parts):
            if hi > have:
                heads.append(part[:, :, have - lo :])
                have = hi
        return torch.cat(heads, dim=2)


class UlyssesBackend:
    """A backend over the head-sharded pool, its plans wrapped in the all-to-alls. Never bucketable: how many
    sound and action rows each rank holds (`UlyssesLayout`) is a shape, fixed by the exact mix."""

    bucketable = False

    def __init__(self, inner: Backend, comm: Comm, heads: int, kv_heads: int):
        self.inner, self.comm, self.heads, self.kv_heads = inner, comm, heads, kv_heads
        self.name = f"ulysses-{inner.name}"
        self.pool = inner.pool

    def shape_key(self, segments: list[Segment]) -> tuple:
        return self.inner.shape_key(segments)

    def make_plan(self, rows: int, slots: int = 0) -> UlyssesPlan:
        return UlyssesPlan(self.inner.make_plan(rows, slots), self.comm, self.heads, self.kv_heads)


class UlyssesLayout(StepLayout):
    """A step layout whose forward runs over this rank's rows (views of the full buffers)."""

    def __init__(self, model: Cosmos3Transformer, kernels: GenKernels, attention: UlyssesBackend, total_rows: int,
                 token_dim: int, segments: list[Segment], graph_pool: tuple | None, a16_rows: int,
                 residual: bool = False, capacity: None = None):  # fmt: skip
        # capacity: None (exact layouts only: `UlyssesBackend` is not bucketable)
        super().__init__(model, kernels, attention, total_rows, token_dim, segments, graph_pool, a16_rows, residual)
        comm = attention.comm
        u, j = comm.parallel.ulysses, comm.ulysses_index
        per = total_rows // u
        a, b = j * per, (j + 1) * per
        # a segment's tokens: vision | sound | action; both bands' rows are in pack order
        ends = [s.start + s.length - s.action for s in segments]  # where each segment's action tokens start
        sound = [r for s, e in zip(segments, ends) for r in range(e - s.sound, e)]
        action = [r for s, e in zip(segments, ends) for r in range(e, e + s.action)]
        cs, ca = _cuts(sound, per, u), _cuts(action, per, u)
        self.sound_counts = [cs[c + 1] - cs[c] for c in range(u)]
        self.action_counts = [ca[c + 1] - ca[c] for c in range(u)]
        p = self.packed
        self.local = PackedStep(
            tokens=p.tokens[a:b], noisy_mask=p.noisy_mask[a:b], segment_timesteps=p.segment_timesteps,
            token_segment=p.token_segment[a:b], cos=p.cos[a:b], sin=p.sin[a:b],
            segments=[],  # K/V of commit segments is collected by the plan, which sees all rows
            sound=p.sound[cs[j] : cs[j + 1]], sound_rows=p.sound_rows[cs[j] : cs[j + 1]] - a,
            action=p.action[ca[j] : ca[j + 1]], action_rows=p.action_rows[ca[j] : ca[j + 1]] - a,
            action_domain=p.action_domain[ca[j] : ca[j + 1]],  # a view: `fill` refills it in place
            a16_rows=min(max(p.a16_rows - a, 0), per),  # the pack's W8A16 rows lead it, so they lead my slice too
            residual=residual,
        )  # fmt: skip
        self.comm, self.per = comm, per

    def _forward(self) -> GenOutput:
        out = gen_forward(self.model, self.local, self.plan, self.kernels)
        preds, sound, action, residual = out.preds, out.sound, out.action, out.residual
        group, u, cfg = self.comm.ulysses_group, self.comm.parallel.ulysses, self.model.cfg
        preds = all_gather_rows(preds, group, [self.per] * u)
        if residual is not None:  # step caching: every rank's residual rows, like the predictions
            residual = all_gather_rows(residual, group, [self.per] * u)
        if sum(self.sound_counts):
            if sound is None:  # no sound rows here: an empty [0, sound_dim] for the gather
                sound = preds.new_zeros(0, cfg.sound_dim)
            sound = all_gather_rows(sound, group, self.sound_counts)
        if sum(self.action_counts):
            if action is None:  # likewise for action rows
                action = preds.new_zeros(0, cfg.action_dim)
            action = all_gather_rows(action, group, self.action_counts)
        return GenOutput(preds, sound, action, residual, self.plan.collected())


def _cuts(rows: list[int], per: int, u: int) -> list[int]:
    """Rows (ascending) → for each rank boundary c·per (c = 0..u), how many of them lie before it."""
    return [sum(r < c * per for r in rows) for c in range(u + 1)]


class UlyssesStep(DenoiseStep):
    """`DenoiseStep` with Ulysses layouts over a head-sharded pool."""

    layout_class = UlyssesLayout

    def __init__(self, model: Cosmos3Transformer, pool: KVPool, comm: Comm, kernels: GenKernels, attention: str,
                 cuda_graphs: bool, max_captures: int = 16):  # fmt: skip
        cfg = model.cfg
        h, kv, u = cfg.num_attention_heads, cfg.num_key_value_heads, comm.parallel.ulysses
        lo, hi = comm.parallel.kv_heads_of(comm.ulysses_index, h, kv)
        inner = make_attention(attention, pool, h // u, hi - lo, cfg.head_dim)
        backend = UlyssesBackend(inner, comm, h, kv)
        super().__init__(model, pool, kernels, backend, cuda_graphs, max_captures=max_captures)
