"""The denoise step over a group: CFG branches on their rank groups, Ulysses inside each, the pool sharded.

Rank 0 runs the whole engine (scheduler, sinks, AR windows) unchanged; only its pool and its step are these:
- `ShardedPool` (rank 0's pool): page ids are allocated on rank 0 alone; each `write` (text K/V at admission, an
  AR commit's K/V) is also a "write" command, after which every rank holds the same pages with its Ulysses
  rank's K/V heads `[layers, pages, page_size, kv_heads_of(rank), d]`.
- `ParallelStep` (rank 0's step): each tick, the rows (tokens, noisy mask, sound, the action band, per-branch
  rotary tables and prefix page lists) go to every rank as a "step" command, with each branch assigned to a CFG group
  (`assign`). Every rank runs the branches of its group through its local step (`DenoiseStep`, or
  `ulysses.UlyssesStep` when ulysses > 1) — attention is per segment, so a branch's result does not depend on
  which others it is packed with, and the split is exact. The leader of each other CFG group sends its outputs
  (one flat fp32 tensor, in the order `_flatten` writes it) to rank 0, which puts them back in branch order:
  the scheduler sees the same `RowOutput`s a single process gives.
Batching across requests and AR windows (chained, kv with commit passes) go through unchanged: they are rows.

Step caching (cache.py): a branch that reuses a residual this step never leaves rank 0 — it is stripped from the
rows sent (no residual crosses the group) and rank 0 computes it alone, as `DenoiseStep` does (its embedding, plus
the residual, through the output heads: no collective). A recording row's running branches return their
block-stack residual [N + T_s + T_a, hidden] with the other outputs (Ulysses ranks all-gather its rows, other CFG
groups' leaders send it in the flat tensor), so the scheduler records what one process would.

A lost worker (group.WorkerLost) fails the tick, hence its live requests (every live one is in the tick;
`DenoiseEngine._heal` ends them). The pool pages of requests that were live when a group was lost are gone with it:
the first step after a restart fails too unless nothing was live (`_seen`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from ..kv_pool import KVPool, PageList
from ..model.layers import Cosmos3Transformer
from ..model.towers import GenKernels
from ..rows import ActionBand, Branch, Row, RowOutput, denoise_step_row, unpatchify
from ..step import DenoiseStep
from .comm import Comm
from .group import Group, WorkerLost
from .ulysses import UlyssesStep


def assign(rows: list[Row], cfg: int) -> list[list[int]]:
    """Per row, per branch: its CFG group. Two-branch rows put branch b on group b; single-branch rows (guidance
    ≤ 1) and commit passes of single-branch streams go to the least-loaded group (by tokens so far)."""
    load = [0] * cfg
    out = []
    for row in rows:
        n = row.tokens.shape[0] + row.sound.shape[0] + row.action.shape[0]
        if len(row.branches) == cfg:
            groups = list(range(cfg))
        else:
            groups = [min(range(cfg), key=lambda g: load[g]) for _ in row.branches]
        for g in groups:
            load[g] += n
        out.append(groups)
    return out


def encode_rows(
    rows: list[Row], groups: list[list[int]], patch: int
) -> tuple[list[dict[str, Any]], list[torch.Tensor]]:
    """Rows → (metadata, tensors) for a "step" command: each row as the row builder's inputs (latents recovered
    from its tokens, its noisy frames, sound latents, the action band: its latents [T_a, action_dim], domain and
    noisy flag; its FP8 precision `a16`; whether it records its residuals), so workers rebuild it with
    `denoise_step_row` itself. Rows whose branches all run (`strip_reused`)."""
    meta, tensors = [], []
    for row, gs in zip(rows, groups):
        t, h, w = row.token_shape
        n, a = t * h * w, row.action.shape[0]
        # per frame its first token's flag, and the action band's (all noisy or all clean: the mask's last entry),
        # read to the host in one copy
        flags = row.noisy_mask[:n].view(t, h * w)[:, 0]
        flags = (torch.cat([flags, row.noisy_mask[-1:]]) if a else flags).cpu()
        noisy = flags[:t].nonzero().flatten()
        action = {"domain": row.action_domain, "noisy": bool(flags[t])} if a else None
        meta.append({
            "t": row.timestep, "commit": row.commit, "a16": row.a16, "groups": gs, "sound": row.sound.shape[0] > 0,
            "action": action, "record": row.record,
            "prefix": [[(list(p.pages), p.num_tokens) for p in br.prefix] for br in row.branches],
        })  # fmt: skip
        tensors += [unpatchify(row.tokens, row.token_shape, patch, row.latent_hw), noisy]
        tensors += [row.sound.t()] if row.sound.shape[0] else []
        tensors += [row.action] if a else []
        for br in row.branches:
            tensors += [br.cos, br.sin]
    return meta, tensors


class PageLists:
    """A worker's PageList per (pages, tokens), with the page ids on its device made once (no copy per step)."""

    def __init__(self, device: torch.device | str, limit: int = 4096):
        self.device, self.limit, self.lists = device, limit, {}

    def __call__(self, pages: list[int], n: int) -> PageList:
        key = (tuple(pages), n)
        if key not in self.lists:
            if len(self.lists) >= self.limit:
                self.lists.clear()
            self.lists[key] = PageList(list(pages), n, torch.tensor(pages, dtype=torch.long).to(self.device))
        return self.lists[key]


def decode_rows(
    meta: list[dict[str, Any]], tensors: list[torch.Tensor], lists: PageLists, patch: int, dtype: torch.dtype
) -> list[Row]:
    it = iter(tensors)
    rows = []
    for m in meta:
        latents, noisy = next(it), next(it)
        sound = next(it) if m["sound"] else None
        a = m.get("action")
        action = ActionBand(next(it), a["domain"], a["noisy"]) if a else None
        branches = tuple(Branch(tuple(lists(p, n) for p, n in prefix), next(it), next(it)) for prefix in m["prefix"])
        rows.append(denoise_step_row(latents, m["t"], noisy, branches, patch, dtype, m["commit"], sound, action,
                                     m.get("a16", True), record=m["record"]))  # fmt: skip
    return rows


def run_share(
    step: Any, rows: list[Row], groups: list[list[int]], cfg_index: int
) -> list[tuple[int, list[int], RowOutput]]:
    """This CFG group's branches of every row through the local step → (row, its branches here, output)."""
    sub, where = [], []
    for i, (row, gs) in enumerate(zip(rows, groups)):
        mine = [b for b, g in enumerate(gs) if g == cfg_index]
        if mine:
            sub.append(_branches(row, mine))
            where.append((i, mine))
    outs = step(sub) if sub else []
    return [(i, mine, out) for (i, mine), out in zip(where, outs)]


def _flatten(share: list[tuple[int, list[int], RowOutput]]) -> torch.Tensor:
    parts = []
    for _, _, out in share:
        parts += [v.reshape(-1) for v in out.velocity] + [s.reshape(-1) for s in out.sound_velocity]
        parts += [a.reshape(-1) for a in out.action_velocity]
        parts += [t.float().reshape(-1) for kv in out.kv for t in kv]
        parts += [r.float().reshape(-1) for r in out.residual]  # type: ignore[union-attr]
    return torch.cat(parts) if parts else torch.zeros(0)


def _shapes(
    row: Row, branches: int, p: int, kv_shape: tuple[int, int, int], hidden: int
) -> list[list[tuple[int, ...]]]:
    """What `_flatten` wrote for one row: [velocities, sound velocities, action velocities, (k, v) per branch,
    block-stack residuals (a recording row)]."""
    layers, kv_heads, d = kv_shape
    if row.commit:
        return [[], [], [], [(layers, row.tokens.shape[0], kv_heads, d)] * (2 * branches), []]
    c = row.tokens.shape[1] // (p * p)
    vel = [(1, c, row.token_shape[0], *row.latent_hw)] * branches
    n, s, a = row.tokens.shape[0], row.sound.shape[0], row.action.shape[0]
    sound = [(row.sound.shape[1], s)] * branches if s else []
    residual = [(n + s + a, hidden)] * branches if row.record else []
    return [vel, sound, [tuple(row.action.shape)] * branches if a else [], [], residual]


def _unflatten(
    flat: torch.Tensor, at: int, shapes: list[list[tuple[int, ...]]], dtype: torch.dtype
) -> tuple[RowOutput, int]:
    """One row's output read from `flat` at offset `at` → (output, the next row's offset)."""
    lists = []
    for group in shapes:
        out = []
        for shape in group:
            n = int(torch.Size(shape).numel())
            out.append(flat[at : at + n].view(shape))
            at += n
        lists.append(out)
    kv = [(k.to(dtype), v.to(dtype)) for k, v in zip(lists[3][0::2], lists[3][1::2])]
    return RowOutput(lists[0], kv, lists[1], lists[2], [r.to(dtype) for r in lists[4]]), at


def local_step(
    model: Cosmos3Transformer,
    pool: KVPool,
    comm: Comm,
    kernels: GenKernels,
    attention: str,
    cuda_graphs: bool,
    max_captures: int = 16,
) -> DenoiseStep:
    """A rank's step: exact layouts (no `graph_buckets`), at most `max_captures` captured."""
    if comm.parallel.ulysses > 1:
        return UlyssesStep(model, pool, comm, kernels, attention, cuda_graphs, max_captures)
    return DenoiseStep(model, pool, kernels, attention, cuda_graphs, max_captures=max_captures)


def kv_shard(comm: Comm, model: Cosmos3Transformer) -> tuple[int, int]:
    cfg = model.cfg
    return comm.parallel.kv_heads_of(comm.ulysses_index, cfg.num_attention_heads, cfg.num_key_value_heads)


class ShardedPool(KVPool):
    """Rank 0's pool: allocation here only; every write also reaches every rank, each keeping its heads."""

    def __init__(self, group: Group, heads: tuple[int, int], num_pages: int, page_size: int, num_layers: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):  # fmt: skip
        super().__init__(num_pages, page_size, num_layers, heads[1] - heads[0], head_dim, dtype, device)
        self.group, self.heads = group, heads

    def write(self, page_list: PageList, k: torch.Tensor, v: torch.Tensor) -> None:
        lo, hi = self.heads
        with self.group.session("write", {"pages": page_list.pages, "n": page_list.num_tokens}, [k, v]):
            super().write(page_list, k[:, :, lo:hi], v[:, :, lo:hi])


class ParallelStep:
    """Rank 0's step: the `DenoiseStep` interface (`__call__(rows) → [RowOutput]`) over the group."""

    def __init__(self, group: Group, local: DenoiseStep):
        self.group, self.local = group, local
        cfg = local.model.cfg
        self.kv_shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
        self.hidden = cfg.hidden_size
        self._seen: int | None = None  # the group generation the live requests' pages are on (None: none live)

    @property
    def captures(self) -> int:
        return self.local.captures

    def reset(self) -> None:
        """After a failed forward: rank 0's layouts and graphs go (`DenoiseStep.reset`); a failure inside a group
        session ends the group, which restarts with fresh steps on every rank."""
        self.local.reset()

    def __call__(self, rows: list[Row]) -> list[RowOutput]:
        """Each row's running branches over the group, its reusing ones (step caching) here (`strip_reused`)."""
        running, reused = strip_reused(rows)
        sent = [r for r in running if r is not None]
        outs = self._group_step(sent) if sent else []
        if all(r is None for r in reused):
            return outs
        # no layout runs for rows whose branches all reuse: DenoiseStep's embedding + residual + output heads
        mine = iter(self.local([r for r in reused if r is not None]))
        theirs = iter(outs)
        return [
            join_reused(row, next(theirs) if run is not None else None, next(mine) if re is not None else None)
            for row, run, re in zip(rows, running, reused)
        ]

    def _group_step(self, rows: list[Row]) -> list[RowOutput]:
        g = self.group
        if self._seen is not None and (not g.running or g.generation != self._seen):
            self._seen = None  # this tick's requests fail; whatever comes next starts clean
            raise WorkerLost(g.lost or "parallel group restarted; the requests it was serving failed")
        p = self.local.model.cfg.latent_patch_size
        cfg = g.spec.parallel.cfg
        groups = assign(rows, cfg)
        meta, tensors = encode_rows(rows, groups, p)
        try:
            with g.session("step", {"rows": meta}, tensors) as comm:
                if self._seen is None:  # a new group: layouts (plans, graphs) of an old one hold dead communicators
                    self.local.layouts.clear()
                mine = run_share(self.local, rows, groups, 0)
                shares = {0: mine}
                for c in range(1, cfg):
                    expect = [(i, [b for b, x in enumerate(gs) if x == c]) for i, gs in enumerate(groups)]
                    expect = [(i, bs) for i, bs in expect if bs]
                    if not expect:
                        continue
                    shapes = [_shapes(rows[i], len(bs), p, self.kv_shape, self.hidden) for i, bs in expect]
                    size = sum(int(torch.Size(s).numel()) for sh in shapes for grp in sh for s in grp)
                    flat = torch.empty(size, dtype=torch.float32, device=self.local.pool.k_pages.device)
                    dist.recv(flat, src=c * comm.parallel.ulysses)
                    dtype = self.local.pool.k_pages.dtype
                    at, shares[c] = 0, []
                    for (i, bs), sh in zip(expect, shapes):  # views of `flat`, one tensor per group
                        out, at = _unflatten(flat, at, sh, dtype)
                        shares[c].append((i, bs, out))
        except WorkerLost:
            self._seen = None
            raise
        self._seen = g.generation
        return merge(rows, groups, shares)


def merge(
    rows: list[Row], groups: list[list[int]], shares: dict[int, list[tuple[int, list[int], RowOutput]]]
) -> list[RowOutput]:
    """Per-group outputs → one RowOutput per row, its branches in the row's order."""
    parts: dict[tuple[int, int], tuple[int, RowOutput]] = {}
    for share in shares.values():
        for i, branches, out in share:
            for k, b in enumerate(branches):
                parts[(i, b)] = (k, out)
    result = []
    for i, row in enumerate(rows):
        out = RowOutput([], [], [])
        for b in range(len(row.branches)):
            k, src = parts[(i, b)]
            if row.commit:
                out.kv.append(src.kv[k])
            else:
                _append_branch(out, src, k)
                if row.record:
                    out.residual.append(src.residual[k])
        result.append(out)
    return result


def _append_branch(out: RowOutput, src: RowOutput, k: int) -> None:
    """Append branch `k` of `src`'s velocities (vision, and sound / actions where it has them) to `out`."""
    out.velocity.append(src.velocity[k])
    if src.sound_velocity:
        out.sound_velocity.append(src.sound_velocity[k])
    if src.action_velocity:
        out.action_velocity.append(src.action_velocity[k])


def _branches(row: Row, which: list[int]) -> Row:
    """The row with only the branches `which` (in that order), each keeping its reuse entry."""
    if len(which) == len(row.branches):
        return row
    return dataclasses.replace(
        row, branches=tuple(row.branches[b] for b in which), reuse=tuple(row.reuse[b] for b in which)
    )


def strip_reused(rows: list[Row]) -> tuple[list[Row | None], list[Row | None]]:
    """Per row: (its running branches, or None if all reuse; its reusing branches, or None if none) — rank 0 keeps
    the second: a residual never crosses the group. Uncached rows come back as they are."""
    running, reused = [], []
    for row in rows:
        run = [b for b, r in enumerate(row.reuse) if r is None]
        re = [b for b, r in enumerate(row.reuse) if r is not None]
        running.append(_branches(row, run) if run else None)
        reused.append(dataclasses.replace(_branches(row, re), record=False) if re else None)
    return running, reused


def join_reused(row: Row, run: RowOutput | None, re: RowOutput | None) -> RowOutput:
    """A row's outputs from its running (`run`) and reusing (`re`) branches, back in branch order; a reusing
    branch records no residual (None)."""
    if re is None:
        return run  # type: ignore[return-value]
    parts: list[tuple[RowOutput, int] | None] = []
    i = j = 0
    for r in row.reuse:
        if r is None:
            parts.append((run, i))  # type: ignore[arg-type]
            i += 1
        else:
            parts.append((re, j))
            j += 1
    out = RowOutput([], [])
    for src, k in parts:  # type: ignore[misc]
        _append_branch(out, src, k)
        if row.record:
            out.residual.append(src.residual[k] if src is run else None)
    return out


class DenoiseParallel:
    """The engine's hook: its pool and step over `group` (rank 0's side)."""

    def __init__(self, group: Group):
        self.group = group

    def pool(self, model: Cosmos3Transformer, num_pages: int, page_size: int, dtype: torch.dtype,
             device: torch.device | str) -> KVPool:  # fmt: skip
        cfg = model.cfg
        self.group.spec.parallel.check_model(cfg.num_attention_heads, cfg.num_key_value_heads)
        return ShardedPool(self.group, kv_shard(self.group.comm, model), num_pages, page_size, cfg.num_hidden_layers,
                           cfg.head_dim, dtype, device)  # fmt: skip

    def step(self, model: Cosmos3Transformer, pool: KVPool, kernels: GenKernels, attention: str,
             cuda_graphs: bool, max_captures: int = 16) -> ParallelStep:  # fmt: skip
        return ParallelStep(self.group, local_step(model, pool, self.group.comm, kernels, attention, cuda_graphs,
                                                   max_captures))  # fmt: skip


class DenoiseWorker:
    """A worker's side of "write" and "step"."""

    def __init__(self, model: Cosmos3Transformer, comm: Comm, pool_pages: int, page_size: int, kernels: GenKernels,
                 attention: str, cuda_graphs: bool, device: torch.device | str, max_captures: int = 16):  # fmt: skip
        cfg = model.cfg
        self.comm, self.device, self.dtype = comm, device, next(model.parameters()).dtype
        self.heads = kv_shard(comm, model)
        n = self.heads[1] - self.heads[0]
        self.pool = KVPool(pool_pages, page_size, cfg.num_hidden_layers, n, cfg.head_dim, self.dtype, device)
        self.step = local_step(model, self.pool, comm, kernels, attention, cuda_graphs, max_captures)
        self.lists = PageLists(device)
        self.patch = cfg.latent_patch_size

    def write(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        k, v = tensors
        lo, hi = self.heads
        self.pool.write(PageList(header["pages"], header["n"]), k[:, :, lo:hi], v[:, :, lo:hi])

    def run(self, header: dict[str, Any], tensors: list[torch.Tensor]) -> None:
        meta = header["rows"]
        rows = decode_rows(meta, tensors, self.lists, self.patch, self.dtype)
        groups = [m["groups"] for m in meta]
        share = run_share(self.step, rows, groups, self.comm.cfg_index)
        if share and self.comm.cfg_index > 0 and self.comm.ulysses_index == 0:
            dist.send(_flatten(share).to(self.device), dst=0)
