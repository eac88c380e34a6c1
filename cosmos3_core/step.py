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

Buckets (`graph_buckets`, with a `bucketable` backend: FlashInfer): a pack that is not an AR commit pass runs in the
layout of its bucket — its rows rounded up to the next bucket size (one more row when sound or action rows need a
padding row), segment slots for as many segments as those rows can hold (one per SEGMENT_ALIGN rows), sound and
action rows each rounded up to a power of two — keyed on that with the FP8 split row (the whole bucket when every
row is W8A16), the residual flag, the backend and its `shape_key` (FlashInfer: the prefix tokens its gather
holds, a power of two of at least 8,192: the warmup's 1-token prefix and any mix of up to 8 segments of text). A new size mix within a bucket reuses the layout and replays its
capture; padding never reaches a real row (graphs.py). A pack larger than the largest bucket, a commit pass or a
backend that cannot bucket (SDPA, Ulysses) gets an exact layout. Captures are bounded: at most `max_captures`
layouts hold a graph; a layout that captures beyond that releases the least recently used one's (when no graph is
held then, e.g. `max_captures` 1, the capture takes a new graph pool: torch refuses one into a pool that no graph
holds). The step keeps the
most recently used layouts (max(MAX_LAYOUTS, max_captures); an evicted layout's graph goes with it); the warmup
(`capture_buckets`) captures every bucket first. A bucket's key still holds the FP8 split row, the residual flag
(a cached request in the pack), the sound / action capacities and the backend's shape key (FlashInfer's gather
capacity: above 8,192 prefix tokens, e.g. an AR stream's long context, another key): the warmup captures the no-sound, no-action,
no-residual layouts, all W8A16 and all W8A8; other keys capture on their second use while serving.
"""

from __future__ import annotations

import gc
from collections import OrderedDict

import torch

from .attention import Backend, make_attention
from .graphs import StepLayout
from .kv_pool import KVPool
from .model.fp8 import Fp8Linear
from .model.layers import Cosmos3Transformer
from .model.towers import EAGER, GenKernels, embed_row, output_heads
from .rows import SEGMENT_ALIGN, Branch, Row, RowOutput, Segment, denoise_step_row, segments_of, unpatchify

CAPTURE_SEGMENT = 4096  # tokens per row of a warmup capture's pack (a multiple of SEGMENT_ALIGN)


class DenoiseStep:
    """Runs denoise steps over packed rows. Owns the attention backend and, per layout (row sizes, branches,
    commit flags, and whatever the backend's shapes depend on; or a bucket of them, `graph_buckets`: ascending
    row counts, multiples of SEGMENT_ALIGN), a `StepLayout`: input buffers, attention plan and, on CUDA with
    `cuda_graphs`, the captured forward — at most `max_captures` of them. The max(MAX_LAYOUTS, max_captures) most
    recently used layouts are kept."""

    MAX_LAYOUTS = 16
    layout_class = StepLayout  # parallel/ulysses.py: layouts that split the pack's rows over ranks

    def __init__(
        self,
        model: Cosmos3Transformer,
        pool: KVPool,
        kernels: GenKernels = EAGER,
        attention: str | Backend = "auto",
        cuda_graphs: bool = True,
        graph_buckets: tuple[int, ...] = (),
        max_captures: int = 16,
        fp8_attention: bool = False,
        max_capture_rows: int = 0,
    ):
        """`max_capture_rows`: larger layouts always run eagerly (0: no bound). A graph saves launch time, which a
        step of that many rows does not notice, and holds the step's activations in its pool beside the eager
        ones: the memory plan counts both (memory.py)."""
        cfg = model.cfg
        self.model, self.pool, self.kernels = model, pool, kernels
        heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.attention = (
            make_attention(attention, pool, *heads, fp8_attention, compiled=kernels is not EAGER)
            if isinstance(attention, str)
            else attention  # a backend made by the caller (parallel/ulysses.py: over a head-sharded pool)
        )
        self.cuda_graphs = cuda_graphs and pool.k_pages.is_cuda
        # a pack on one adapter merges it into the 16-bit linears where the delta is dense (model/lora.py: CUDA or
        # compiled); an FP8 tower (every layer linear E4M3) or the CPU's eager groups would only split layouts
        self.merges_adapters = (pool.k_pages.is_cuda or kernels is not EAGER) and not any(
            isinstance(m, Fp8Linear) for m in model.layers[0].modules()
        )
        self.graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None  # shared: replays are serial
        self.pool_captured = False  # a graph was captured into `graph_pool`
        if any(b <= 0 or b % SEGMENT_ALIGN for b in graph_buckets):
            raise ValueError(f"graph_buckets: positive multiples of {SEGMENT_ALIGN} rows; got {list(graph_buckets)}")
        self.buckets = tuple(sorted(graph_buckets))
        self.max_captures = max_captures
        self.max_capture_rows = max_capture_rows
        self.layouts: OrderedDict[tuple, StepLayout] = OrderedDict()
        self.captures = 0  # graphs captured so far (replaced or dropped ones too)
        # when a set: each running row's (rows, sound, action, branches) is added (the warmup derives buckets so)
        self.row_shapes: set[tuple[int, int, int, int]] | None = None
        # a pack runs in a bucket only if that pads it by at most this share (None: any bucket it fits). Derived
        # buckets set it: smaller requests than the warmup's keep exact layouts rather than compute padding
        self.pad_limit: float | None = None

    def reset(self) -> None:
        """After a failed forward: drop every layout and its graph, and start a new graph memory pool, so nothing a
        failed pass touched is replayed or reused."""
        self.layouts.clear()
        self._new_graph_pool()

    def _new_graph_pool(self) -> None:
        """Release every kept layout's graph and give them all a new pool (the old one is freed with its last
        graph). After a failed capture the old pool may not be reused: the failed graph released its share of it,
        and a pool nothing holds cannot take another capture."""
        if not self.cuda_graphs:
            return
        for layout in self.layouts.values():
            layout.release_graph()
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.graph_pool, self.pool_captured = torch.cuda.graph_pool_handle(), False
        for layout in self.layouts.values():
            layout.graph_pool = self.graph_pool

    def bucket(self, segments: list[Segment], total: int, attention: Backend) -> tuple[int, int, int] | None:
        """→ the bucket of a pack of these segments (`total` rows): (rows, sound rows, action rows), or None when
        it gets an exact layout."""
        if not self.buckets or not attention.bucketable or any(s.collect_kv for s in segments):
            return None
        sound, action = sum(s.sound for s in segments), sum(s.action for s in segments)
        need = bucket_rows_needed(total, sound, action)
        rows = next((b for b in self.buckets if b >= need), None)
        if rows is None or (self.pad_limit is not None and rows > need * (1 + self.pad_limit)):
            return None
        return rows, _pow2(sound), _pow2(action)

    def layout(self, rows: list[Row]) -> tuple[StepLayout, list[Segment]]:
        """`rows`: W8A16 rows first (see `__call__`)."""
        segments, total = segments_of(rows)
        attention = self.attention
        running = [(r, sum(x is None for x in r.reuse)) for r in rows]
        running = [(r, n) for r, n in running if n]  # a row whose branches all reuse is not in the pack
        residual = any(r.record for r, _ in running)
        # the distinct adapters the pack reads (its dense delta's width, model/lora.py); 0: it runs without deltas
        lora = len({r.lora[0] for r, _ in running if r.lora is not None})
        # every running row on one adapter at one scale (a request alone): its linears merge it (model/lora.py)
        merged = self.merges_adapters and lora == 1 and len({r.lora for r, _ in running}) == 1
        bucket = self.bucket(segments, total, attention)
        size, capacity = (total, None) if bucket is None else (bucket[0], (bucket[0] // SEGMENT_ALIGN, *bucket[1:]))
        a16_segments = sum(n for r, n in running if r.a16)  # the running branches' segments only
        a16_rows = segments[a16_segments].start if a16_segments < len(segments) else size
        sizes = (
            tuple((r.tokens.shape[0], r.sound.shape[0], r.action.shape[0], n, r.commit, r.a16) for r, n in running)
            if bucket is None
            else ("bucket", *bucket, a16_rows)
        )
        # a bucket's key holds the shape key too (FlashInfer's gather); key[1] names the backend (bench.parity and
        # tests read it)
        key = (sizes, attention.name, attention.shape_key(segments), residual, lora, merged)
        layout = self.layouts.pop(key, None) or self.layout_class(
            self.model, self.kernels, attention, size, rows[0].tokens.shape[1], segments, self.graph_pool, a16_rows,
            residual, capacity, **({"lora": lora, "lora_merged": merged} if lora else {}),  # parallel layouts take none (refused at load)
        )  # fmt: skip
        self.layouts[key] = layout
        while len(self.layouts) > max(self.MAX_LAYOUTS, self.max_captures):
            self.layouts.popitem(last=False)  # the least recently used (and its graph)
        return layout, segments

    def capture_buckets(self, a16: tuple[bool, ...] = (True,)) -> int:
        """Warmup: run and capture each bucket's layout (no sound, no actions, no residual; FP8 linears all W8A16,
        then all W8A8 with `a16` (True, False)) with a pack that fills it — rows of at most CAPTURE_SEGMENT tokens
        on one text token, zeros — so that served mixes replay it. → the number of graphs captured. (A capture
        serves any segment mix of its bucket; short segments keep attention's cost, quadratic in a segment's
        length, small: one 96,768-token segment per bucket made Edge's warmup 31 s.)"""
        if not (self.cuda_graphs and self.buckets and self.attention.bucketable):
            return 0
        assert CAPTURE_SEGMENT % SEGMENT_ALIGN == 0  # else padded rows overflow their bucket
        before = self.captures
        cfg, dev, dt = self.model.cfg, self.pool.k_pages.device, self.pool.k_pages.dtype
        p = cfg.latent_patch_size
        text = self.pool.alloc(1)
        try:
            for size in self.buckets:
                lengths = [min(CAPTURE_SEGMENT, size - start) for start in range(0, size, CAPTURE_SEGMENT)]
                for precision in a16:
                    rows = []
                    for n in lengths:
                        rot = torch.zeros(n, cfg.head_dim, dtype=dt, device=dev)
                        # [1, C, T, H, W]: n tokens
                        latents = torch.zeros(1, cfg.latent_channel, 1, p, n * p, device=dev)
                        rows.append(denoise_step_row(latents, 1.0, torch.zeros(1, dtype=torch.long, device=dev),
                                                     (Branch((text,), rot, rot),), p, dt, a16=precision))  # fmt: skip
                    for _ in range(2):  # eager (compiles, autotunes), then captured
                        self(rows)
        finally:
            self.pool.free(text)
        return self.captures - before

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
        if self.row_shapes is not None:
            for r in rows:
                if not r.commit:
                    s, a = r.sound.shape[0], r.action.shape[0]
                    self.row_shapes.add((r.tokens.shape[0] + s + a, s, a, len(r.branches)))
        fwd = None
        segments: list[Segment] = []
        if any(x is None for r in rows for x in r.reuse):
            layout, segments = self.layout(rows)
            layout.fill(rows, segments)
            had_graph = layout.graph is not None
            rows_total = layout.packed.tokens.shape[0]
            may_capture = self.max_captures > 0 and (not self.max_capture_rows or rows_total <= self.max_capture_rows)
            if layout.captures_next(may_capture):  # it captures now
                held = [v for v in self.layouts.values() if v.graph is not None]
                if len(held) >= self.max_captures:
                    held.pop(0).release_graph()  # the least recently used capture makes room
                if not held and self.pool_captured:  # torch refuses a capture into a pool that no graph holds
                    self._new_graph_pool()  # while its blocks live (an INTERNAL ASSERT): the capture takes a new one
                self.pool_captured = True  # a failed capture moves to a new pool below
            failed = layout.capture_failed
            fwd = layout.run(capture=may_capture)
            self.captures += layout.graph is not None and not had_graph
            if layout.capture_failed and not failed:  # it ran eagerly; later captures go to a new pool
                self._new_graph_pool()
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


def bucket_rows_needed(total: int, sound: int, action: int) -> int:
    """The rows a bucket needs for a pack of `total` rows with `sound` sound and `action` action tokens: one more
    when either count is not a power of two (their unused capacity entries point at the pack's last row)."""
    return total + (_pow2(sound) > sound or _pow2(action) > action)


def derive_buckets(shapes: set[tuple[int, int, int, int]]) -> tuple[int, ...]:
    """Buckets for requests of these shapes — (rows, sound tokens, action tokens, CFG branches) of one branch's
    segment, as the row builder made them — alone in a pack with any number of their branches running (SeaCache
    runs 1 of 2 on a reused step): the smallest multiple of SEGMENT_ALIGN each such pack fits."""
    out = set()
    for n, sound, action, branches in shapes:
        aligned = -(-n // SEGMENT_ALIGN) * SEGMENT_ALIGN
        for k in range(1, branches + 1):
            need = bucket_rows_needed(k * aligned, k * sound, k * action)
            out.add(-(-need // SEGMENT_ALIGN) * SEGMENT_ALIGN)
    return tuple(sorted(out))


def bucket_padding(buckets: tuple[int, ...], shapes: set[tuple[int, int, int, int]]) -> list[tuple[int, int, float]]:
    """For each pack `derive_buckets` would cover, (its rows, the bucket it runs in, the padding's share of that
    pack's rows); a pack larger than every bucket gets an exact layout and is left out."""
    out = []
    for n, sound, action, branches in sorted(shapes):
        aligned = -(-n // SEGMENT_ALIGN) * SEGMENT_ALIGN
        for k in range(1, branches + 1):
            need = bucket_rows_needed(k * aligned, k * sound, k * action)
            rows = next((b for b in buckets if b >= need), None)
            if rows is not None:
                out.append((k * n, rows, rows / (k * n) - 1))
    return out


def _pow2(n: int) -> int:
    """0 stays 0 (no sound: a different forward); else the next power of two."""
    return 1 << (n - 1).bit_length() if n else 0
