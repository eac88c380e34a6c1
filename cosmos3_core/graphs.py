"""Step layouts: what a packed step of one shape owns, and its CUDA graph.

A layout is fixed by the packed rows' sizes, branches and commit flags (plus whatever the attention backend's
shapes depend on: SDPA's prefix lengths; nothing for FlashInfer, whose page tables are plan data). It owns:
- the packed input buffers `[S, ...]` (tokens, noisy mask, rotary cos/sin), zero padding included, and the
  per-segment timesteps, refilled each step by `fill` — no per-step allocation of the step's inputs;
- the attention plan, updated by `fill` outside the graph (host work, buffer copies) when the segments' pages
  differ from the last step's;
- on CUDA with graphs on, the captured GEN forward: the first run of a layout is eager (compiles, autotuning,
  allocator growth), the second captures and every later one replays. Layouts that return K/V (AR commit
  passes) always run eager. Graphs share one memory pool: replays are serial and each step's outputs are
  copied out (`DenoiseStep`) before the next replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import Backend
from .model.layers import Cosmos3Transformer
from .model.towers import GenKernels, gen_forward
from .rows import Row, Segment


@dataclass
class PackedStep:
    """A step's inputs; the tensors are buffers its layout owns (refilled every step, never reallocated)."""

    tokens: torch.Tensor  # [S, patch_latent_dim]
    noisy_mask: torch.Tensor  # [S]
    segment_timesteps: torch.Tensor  # [segments, padded to a multiple of 64] fp32
    token_segment: torch.Tensor  # [S] int64: each row's segment (fixed by the layout; padding rows say 0)
    cos: torch.Tensor  # [S, head_dim]
    sin: torch.Tensor  # [S, head_dim]
    segments: list[Segment]


class StepLayout:
    """`graph_pool`: the CUDA graph memory pool its capture shares (None: never capture, e.g. on the CPU)."""

    def __init__(
        self,
        model: Cosmos3Transformer,
        kernels: GenKernels,
        attention: Backend,
        total_rows: int,
        token_dim: int,
        segments: list[Segment],
        graph_pool: tuple | None,
    ):
        cfg = model.cfg
        dev, dt = attention.pool.k_pages.device, attention.pool.k_pages.dtype
        self.model, self.kernels, self.graph_pool = model, kernels, graph_pool
        self.packed: PackedStep = PackedStep(
            tokens=torch.zeros(total_rows, token_dim, dtype=dt, device=dev),
            noisy_mask=torch.zeros(total_rows, dtype=torch.bool, device=dev),
            # rows padded to a multiple of 64, like the segments: the embedding GEMM then has the same shape
            # whatever a request is packed with, so its result does not depend on its neighbours
            segment_timesteps=torch.zeros(-(-len(segments) // 64) * 64, dtype=torch.float32, device=dev),
            token_segment=torch.zeros(total_rows, dtype=torch.long, device=dev),
            cos=torch.zeros(total_rows, cfg.head_dim, dtype=dt, device=dev),
            sin=torch.zeros(total_rows, cfg.head_dim, dtype=dt, device=dev),
            segments=segments,
        )
        for i, s in enumerate(segments):
            self.packed.token_segment[s.start : s.start + s.length] = i
        self.plan = attention.make_plan(total_rows)
        self.planned_for: tuple | None = None  # the pages the plan was last updated with
        self.capturable = graph_pool is not None and not any(s.collect_kv for s in segments)
        self.runs = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_out: torch.Tensor | None = None

    def fill(self, rows: list[Row], segments: list[Segment]) -> None:
        p = self.packed
        seg = iter(enumerate(segments))
        for row in rows:
            for br in row.branches:
                i, s = next(seg)
                sl = slice(s.start, s.start + s.length)
                p.tokens[sl].copy_(row.tokens)
                p.segment_timesteps[i].fill_(row.timestep)  # a kernel argument: no host-to-device copy
                p.noisy_mask[sl].copy_(row.noisy_mask)
                p.cos[sl].copy_(br.cos)
                p.sin[sl].copy_(br.sin)
        p.segments = segments
        # the same requests' next step reads the same pages: re-planning (host work, copies) only when they change
        pages = tuple(tuple((tuple(pl.pages), pl.num_tokens) for pl in s.prefix) for s in segments)
        if pages != self.planned_for:
            self.plan.update(segments)
            self.planned_for = pages

    def _forward(self) -> tuple[torch.Tensor, dict]:
        return gen_forward(self.model, self.packed, self.plan, self.kernels)

    def run(self) -> tuple[torch.Tensor, dict]:
        """→ (predictions [S, patch_latent_dim], K/V of collecting segments). With a graph, the predictions
        are the graph's output buffer: valid until the next replay of any layout."""
        self.runs += 1
        if self.graph is None and self.capturable and self.runs >= 2:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=self.graph_pool):
                self.graph_out, _ = self._forward()
        if self.graph is not None:
            self.graph.replay()
            return self.graph_out, {}
        return self._forward()
