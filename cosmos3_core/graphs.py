"""Step layouts: what a packed step of one shape owns, and its CUDA graph.

A layout is fixed by the packed rows' sizes, branches that run (not reused: cache.py), commit flags and FP8
precisions (W8A16 rows are packed first: `PackedStep.a16_rows` is where W8A8 starts), whether the forward returns
the block stack's residual (a cached request is in the pack), how many distinct LoRA adapters its rows read (then
the per-group adapter slots and scales and the K slots read are buffers too, `PackedStep.lora`: which adapters they
are is content; K is the width of the dense delta, model/lora.py), plus whatever the attention backend's shapes depend
on (its `shape_key`: SDPA's prefix lengths; FlashInfer's gather capacity, its prefixes being plan data) — or, bucketed (`capacity`,
chosen by `DenoiseStep` for a backend whose segment boundaries are plan data), by a bucket: its rows, segment slots,
sound and action rows are capacities, and the packs of any size mix that fits run in it, their geometry (each
row's segment `token_segment`, `sound_rows`, `action_rows`) being buffer content. It owns:
- the packed input buffers `[S, ...]` (tokens, noisy mask, rotary cos/sin; sound tokens and their row index
  `sound_rows`, so a sound layout captures like any other; action tokens likewise, with `action_rows` and each
  action row's domain), zero padding included, and the per-segment timesteps, refilled each step by `fill` — no
  per-step allocation of the step's inputs. The geometry buffers are rewritten (a host-to-device copy) only when
  the segments' geometry differs from the last step's: never for an exact layout. Padding of a bucket: rows after
  the last segment (and between segments) are in no segment's attention (`token_segment` says 0, so they take
  segment 0's timestep, masked off by `noisy_mask`; FlashInfer gives them a request of their own over their own
  rows, so no real row attends to them and their outputs are never read), and unused `sound_rows` / `action_rows` entries name the pack's
  last row, always a padding row then (`DenoiseStep` sizes the bucket so): their embeddings land there and their
  predictions are never read;
- the attention plan, updated by `fill` outside the graph (host work, buffer copies) when the segments' pages (or,
  bucketed, their geometry) differ from the last step's;
- on CUDA with graphs on, the captured GEN forward: the first run of a layout is eager (compiles, autotuning,
  allocator growth), the second captures (when the step allows: `run(capture=...)`) and every later one replays.
  A capture only follows an eager run of the same layout *on the capturing thread*: cuBLAS/cuBLASLt handles and
  some kernels' one-time setup are per thread, and their first use inside a capture fails (`cublasCreate` is not
  capturable: an FP8 layout the warmup thread ran once, captured by the engine thread, failed so). A capture that
  fails anyway is not fatal: the layout drops the graph, never captures again and runs that step eagerly
  (`capture_failures` counts them). Layouts that return K/V (AR commit passes) always run eager. Graphs share one
  memory pool: replays are serial and each step's outputs are copied out (`DenoiseStep`) before the next replay.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from dataclasses import dataclass

import torch
from torch._dynamo.decorators import mark_unbacked

from . import faults
from .attention import Backend
from .model.layers import Cosmos3Transformer
from .model.lora import AdapterRows
from .model.towers import GenKernels, GenOutput, gen_forward
from .rows import SEGMENT_ALIGN, Row, Segment


@dataclass
class PackedStep:
    """A step's inputs; the tensors are buffers its layout owns (refilled every step, never reallocated)."""

    tokens: torch.Tensor  # [S, patch_latent_dim]
    noisy_mask: torch.Tensor  # [S]
    segment_timesteps: torch.Tensor  # [segments (bucketed: slots), padded to a multiple of 64] fp32
    token_segment: torch.Tensor  # [S] int64: each row's segment (the geometry; padding rows say 0)
    cos: torch.Tensor  # [S, head_dim]
    sin: torch.Tensor  # [S, head_dim]
    segments: list[Segment]
    sound: torch.Tensor  # [R, sound_dim]: every segment's sound tokens, in segment order (R = 0: no sound)
    sound_rows: torch.Tensor  # [R] int64: where they sit in the pack (the geometry; bucket padding: row S-1)
    action: torch.Tensor  # [A, action_dim]: every segment's action tokens, in segment order (A = 0: none)
    action_rows: torch.Tensor  # [A] int64: where they sit in the pack (the geometry; bucket padding: row S-1)
    action_domain: torch.Tensor  # [A] int64: each action token's embodiment (refilled: requests of one shape differ)
    a16_rows: int  # FP8 linears: rows [0, a16_rows) run W8A16, the rest W8A8 (fixed by the layout)
    residual: bool  # the forward also returns the block stack's residual [S, hidden] (fixed by the layout)
    # LoRA (a layout with adapter rows): one group per segment slot, then one for the rows after them; `offs` is
    # geometry, `slot` / `scale` are refilled each step (kernel arguments; 0: no adapter). None: no adapter rows
    lora: AdapterRows | None = None


class StepLayout:
    """`graph_pool`: the CUDA graph memory pool its capture shares (None: never capture, e.g. on the CPU).
    `a16_rows`: the pack's leading rows whose FP8 linears run W8A16 (the rest W8A8). `capacity`: a bucketed
    layout's (segment slots, sound rows, action rows) — it then runs any `segments` that fit in `total_rows` (and
    leave row `total_rows - 1` free when sound or action rows are fewer than their capacity); None: exactly
    `segments`."""

    def __init__(
        self,
        model: Cosmos3Transformer,
        kernels: GenKernels,
        attention: Backend,
        total_rows: int,
        token_dim: int,
        segments: list[Segment],
        graph_pool: tuple | None,
        a16_rows: int,
        residual: bool = False,
        capacity: tuple[int, int, int] | None = None,
        lora: int = 0,
        lora_merged: bool = False,
    ):
        cfg = model.cfg
        dev, dt = attention.pool.k_pages.device, attention.pool.k_pages.dtype
        self.model, self.kernels, self.graph_pool = model, kernels, graph_pool
        slots, sounds, actions = capacity or (0, sum(s.sound for s in segments), sum(s.action for s in segments))
        self.packed: PackedStep = PackedStep(
            tokens=torch.zeros(total_rows, token_dim, dtype=dt, device=dev),
            noisy_mask=torch.zeros(total_rows, dtype=torch.bool, device=dev),
            # rows padded to a multiple of 64, like the segments: the embedding GEMM then has the same shape
            # whatever a request is packed with, so its result does not depend on its neighbours
            segment_timesteps=torch.zeros(-(-max(slots, len(segments)) // 64) * 64, dtype=torch.float32, device=dev),
            token_segment=torch.zeros(total_rows, dtype=torch.long, device=dev),
            cos=torch.zeros(total_rows, cfg.head_dim, dtype=dt, device=dev),
            sin=torch.zeros(total_rows, cfg.head_dim, dtype=dt, device=dev),
            segments=segments,
            sound=torch.zeros(sounds, cfg.sound_dim, dtype=dt, device=dev),
            sound_rows=torch.zeros(sounds, dtype=torch.long, device=dev),
            action=torch.zeros(actions, cfg.action_dim, dtype=dt, device=dev),
            action_rows=torch.zeros(actions, dtype=torch.long, device=dev),
            action_domain=torch.zeros(actions, dtype=torch.long, device=dev),
            a16_rows=a16_rows,
            residual=residual,
        )
        if lora:  # the groups' buffers (model/lora.py): a slot per segment slot, and the trailing padding's
            groups = max(slots, len(segments)) + 1
            self.packed.lora = AdapterRows(
                torch.zeros(groups, dtype=torch.long, device=dev),
                torch.zeros(groups, dtype=torch.float32, device=dev),
                torch.full((groups,), total_rows, dtype=torch.int32, device=dev),
                torch.zeros(lora, dtype=torch.long, device=dev),  # the `lora` distinct slots the pack reads
                merged=lora_merged,  # every row on one adapter and scale: 16-bit linears merge it into W
            )
            # compiled GEN kernels (`compile: true`) take any number of adapters in one graph: a size-1 `used` would
            # otherwise be specialised, and the first pack of two adapters would compile again while serving
            mark_unbacked(self.packed.lora.used, 0)
        self.placed: tuple | None = None  # the geometry the buffers were last written for
        self._place(segments)
        self.plan = attention.make_plan(total_rows, slots)
        self.planned_for: tuple | None = None  # the geometry and pages the plan was last updated with
        self.capturable = graph_pool is not None and not any(s.collect_kv for s in segments)
        self.runs = 0
        self.eager_threads: set[int] = set()  # threads that ran this layout eagerly: only they may capture it
        self.capture_failed = False
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_out: GenOutput | None = None

    def _place(self, segments: list[Segment]) -> None:
        """Write the segments' geometry (each row's segment, the sound and action rows) into the buffers, when it
        differs from what they hold: host work and host-to-device copies, only when a bucket's mix changes."""
        geometry = tuple((s.start, s.length, s.sound, s.action) for s in segments)
        if geometry == self.placed:
            return
        p, last = self.packed, self.packed.tokens.shape[0] - 1
        # a segment's tokens: vision | sound | action
        ends = [s.start + s.length - s.action for s in segments]  # where each segment's action tokens start
        sound = [r for s, e in zip(segments, ends) for r in range(e - s.sound, e)]
        action = [r for s, e in zip(segments, ends) for r in range(e, e + s.action)]
        if len(sound) > len(p.sound_rows) or len(action) > len(p.action_rows):
            raise ValueError("segments exceed the layout's sound or action capacity")
        token_segment = torch.zeros(len(p.token_segment), dtype=torch.long)
        for i, s in enumerate(segments):
            token_segment[s.start : s.start + s.length] = i
        if self.placed is not None:  # a new mix in a bucket: no row keeps the last one's inputs
            # sound / action entries the new mix leaves unused are still embedded (into the last row): a stale
            # non-finite one there (an earlier request's NaN latents) spreads to the pack's last segment through
            # FA3's whole-tile K/V reads, in every later pack of this layout (tests/test_fa3_tiles.py)
            for buf in (p.tokens, p.noisy_mask, p.cos, p.sin, p.sound, p.action):
                buf.zero_()
        p.token_segment.copy_(token_segment)
        p.sound_rows.copy_(torch.tensor(sound + [last] * (len(p.sound_rows) - len(sound)), dtype=torch.long))
        p.action_rows.copy_(torch.tensor(action + [last] * (len(p.action_rows) - len(action)), dtype=torch.long))
        if p.lora is not None:  # each segment's group ends where the next segment starts (SEGMENT_ALIGN padding)
            ends = [s.start + -(-s.length // SEGMENT_ALIGN) * SEGMENT_ALIGN for s in segments]
            groups = len(p.lora.offs)
            offs = ends + [ends[-1] if ends else 0] * (groups - 1 - len(ends)) + [len(p.tokens)]
            p.lora.offs.copy_(torch.tensor(offs, dtype=torch.int32))
        self.placed = geometry

    def fill(self, rows: list[Row], segments: list[Segment]) -> None:
        self._place(segments)
        p = self.packed
        seg = iter(enumerate(segments))
        at = at_a = 0  # next free row of p.sound, p.action
        for row in rows:
            for br, reuse in zip(row.branches, row.reuse):
                if reuse is not None:  # a reused branch has no segment
                    continue
                i, s = next(seg)
                sl = slice(s.start, s.start + s.length)
                p.tokens[s.start : s.start + row.tokens.shape[0]].copy_(row.tokens)
                if s.sound:  # the same sound tokens in every branch (the uncond branch sees them too)
                    p.sound[at : at + s.sound].copy_(row.sound)
                    at += s.sound
                if s.action:  # likewise the action tokens
                    p.action[at_a : at_a + s.action].copy_(row.action)
                    p.action_domain[at_a : at_a + s.action].fill_(row.action_domain)  # a kernel argument
                    at_a += s.action
                p.segment_timesteps[i].fill_(row.timestep)  # a kernel argument: no host-to-device copy
                if p.lora is not None:  # likewise the segment's adapter (scale 0: none)
                    p.lora.slot[i].fill_(row.lora[0] if row.lora else 0)
                    p.lora.scale[i].fill_(row.lora[1] if row.lora else 0.0)
                p.noisy_mask[sl].copy_(row.noisy_mask)
                p.cos[sl].copy_(br.cos)
                p.sin[sl].copy_(br.sin)
        if p.lora is not None:  # the distinct slots the rows read, in order of first use (kernel arguments)
            used = list(dict.fromkeys(row.lora[0] for row in rows if row.lora and any(x is None for x in row.reuse)))
            if len(used) != len(p.lora.used):
                raise ValueError(f"a layout for {len(p.lora.used)} adapters got a pack of {len(used)}")
            for i, slot in enumerate(used):
                p.lora.used[i].fill_(slot)
        p.segments = segments
        # the same requests' next step reads the same pages: re-planning (host work, copies) only when they (or, in
        # a bucket, the segments' geometry) change
        pages = self.placed, tuple(tuple((tuple(pl.pages), pl.num_tokens) for pl in s.prefix) for s in segments)
        if pages != self.planned_for:
            self.plan.update(segments)
            self.planned_for = pages

    def _forward(self) -> GenOutput:
        return gen_forward(self.model, self.packed, self.plan, self.kernels)

    def release_graph(self) -> None:
        """Drop the captured graph (its memory returns to the shared pool); the next run captures again."""
        self.graph = self.graph_out = None

    def run(self, capture: bool = True) -> GenOutput:
        """→ the pass's `GenOutput` (predictions [S, patch_latent_dim], sound [R, sound_dim] and action
        [A, action_dim] predictions or None, the block stack's residual [S, hidden] or None, K/V of collecting
        segments). With a graph, its tensors are the graph's output buffers: valid until the next replay of any
        layout. `capture`: this run may capture the graph (after an eager run on this thread, if capturable); the
        step says False while it holds its bound of captures."""
        self.runs += 1
        faults.maybe_fail_forward()
        if self.captures_next(capture):
            self._capture()
        if self.graph is not None:
            self.graph.replay()
            return self.graph_out  # type: ignore[return-value]
        self.eager_threads.add(threading.get_ident())
        return self._forward()

    def captures_next(self, capture: bool = True) -> bool:
        """Whether `run(capture)` on this thread captures: a capturable layout without a graph, already run eagerly
        here."""
        return self.graph is None and self.capturable and capture and threading.get_ident() in self.eager_threads

    def _capture(self) -> None:
        """Capture the forward into `self.graph`; on failure leave none and never capture this layout again."""
        graph = torch.cuda.CUDAGraph()
        try:
            # thread-local: other threads' stream work goes on during a capture (the denoise stub's execute copies
            # each input on a stream of its own and waits for it, its send thread copies responses: in the default
            # global mode that wait failed, and with it a served request and this capture). No other thread's
            # stream may wait on an event of the capturing stream (or the reverse): it would join the capture
            with torch.cuda.graph(graph, pool=self.graph_pool, capture_error_mode="thread_local"):
                out = self._forward()
                faults.maybe_fail_capture()
        except Exception as e:  # noqa: BLE001 - the step runs eagerly instead (the caller's next line)
            self.capturable = False
            # the failed graph's pool (shared by every layout) is not reused: the step moves all captures to a new
            # one (`DenoiseStep`); a failed capture leaves no sticky error, a real one raises here and the tick heals
            torch.cuda.synchronize()
            print(f"cosmos3: capture of a {self.packed.tokens.shape[0]}-row layout failed; it runs eagerly "
                  f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})", file=sys.stderr)  # fmt: skip
            self.capture_failed = True
            return
        self.graph, self.graph_out = graph, dataclasses.replace(out, kv={})
