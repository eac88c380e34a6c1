"""The denoise step and the one function that builds its input.

`denoise_step_row` is the only constructor of a `Row` (what one request contributes to a step). Every
caller — the engine's tick, warmup, AR commit passes, tests — gets rows from it. `DenoiseStep` packs rows
(each CFG branch is its own segment) into the buffers of their layout (`graphs.StepLayout`: buffers,
attention plan, CUDA graph), runs the GEN tower once over the pack and returns each row's per-branch
velocity, or, for a commit row (an AR window's clean latents, no timestep), its per-branch, per-layer K/V
to append to the stream's context.

Layouts:
  latents     [1, C, T, H, W] fp32 (the scheduler's sample; H, W in latent pixels)
  row tokens  [T*h*w, p*p*C] in the model dtype, token order (t, h, w), features (p_h, p_w, C);
              h = ceil(H/p), w = ceil(W/p): a grid that is not a patch multiple is zero-padded (and cropped back)
  velocity    [1, C, T, H, W] fp32, zero on clean (conditioning) frames
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .attention import SdpaAttention, make_attention
from .graphs import StepLayout
from .kv_pool import KVPool, PageList
from .layers import Cosmos3Transformer
from .towers import EAGER, GenKernels


@dataclass(frozen=True)
class Branch:
    """One CFG branch of a request: the K/V its tokens attend to before their own (text, then committed AR
    context frames, oldest first) and the rotary tables of its latent tokens."""

    prefix: tuple[PageList, ...]
    cos: torch.Tensor  # [N, head_dim]
    sin: torch.Tensor  # [N, head_dim]


@dataclass(frozen=True)
class Row:
    tokens: torch.Tensor  # [N, patch_latent_dim], model dtype
    timestep: float  # the step's timestep; its embedding goes to noisy tokens only
    noisy_mask: torch.Tensor  # [N] bool
    token_shape: tuple[int, int, int]  # (T, h, w) patches
    latent_hw: tuple[int, int]  # (H, W) latent pixels; h*p, w*p when the grid needed no padding
    branches: tuple[Branch, ...]  # (cond,) or (cond, uncond)
    commit: bool  # return the tokens' K/V instead of a velocity


@dataclass(frozen=True)
class Segment:
    start: int
    length: int
    prefix: tuple[PageList, ...]
    collect_kv: bool


@dataclass
class RowOutput:
    velocity: list[torch.Tensor]  # per branch [1, C, T, H, W] fp32; empty for a commit row
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # commit rows: per branch (k, v) [layers, N, kv_heads, d]


def patchify(latents: torch.Tensor, p: int) -> torch.Tensor:
    """[1, C, T, H, W] → [T*ceil(H/p)*ceil(W/p), p*p*C], H and W zero-padded up to multiples of p."""
    _, c, t, h, w = latents.shape
    x = torch.nn.functional.pad(latents[0], (0, -w % p, 0, -h % p))
    x = x.reshape(c, t, x.shape[2] // p, p, x.shape[3] // p, p)
    return torch.einsum("cthpwq->thwpqc", x).reshape(-1, p * p * c)


def unpatchify(
    tokens: torch.Tensor, token_shape: tuple[int, int, int], p: int, latent_hw: tuple[int, int]
) -> torch.Tensor:
    """[T*h*w, p*p*C] → [1, C, T, H, W]: the patch grid cropped back to the latent size."""
    t, h, w = token_shape
    x = tokens.reshape(t, h, w, p, p, -1)
    x = torch.einsum("thwpqc->cthpwq", x).reshape(1, -1, t, h * p, w * p)
    return x[..., : latent_hw[0], : latent_hw[1]]


def denoise_step_row(
    latents: torch.Tensor,
    timestep: float,
    noisy_frames: torch.Tensor,
    branches: tuple[Branch, ...],
    patch: int,
    dtype: torch.dtype,
    commit: bool = False,
) -> Row:
    """Build one request's input to a denoise step.

    latents [1, C, T, H, W] (any dtype; cast to the model dtype), `timestep` the scheduler's t for this step
    (applied to the frames in `noisy_frames`), `branches` per CFG branch. `commit`: an AR commit pass over
    clean latents — no noisy frames, no timestep; the step returns the tokens' K/V."""
    if commit and len(noisy_frames):
        raise ValueError("a commit row has no noisy frames")
    _, _, t, h, w = latents.shape
    token_shape = (t, -(-h // patch), -(-w // patch))
    per_frame = token_shape[1] * token_shape[2]
    frame_is_noisy = torch.zeros(t, dtype=torch.bool, device=latents.device)
    frame_is_noisy.index_fill_(0, noisy_frames, True)  # a Python value: no host-to-device copy (a sync)
    noisy_mask = frame_is_noisy.repeat_interleave(per_frame)
    return Row(
        tokens=patchify(latents.to(dtype), patch),
        timestep=0.0 if commit else float(timestep),
        noisy_mask=noisy_mask,
        token_shape=token_shape,
        latent_hw=(h, w),
        branches=branches,
        commit=commit,
    )


SEGMENT_ALIGN = 64  # rows; see segments_of


def segments_of(rows: list[Row]) -> tuple[list[Segment], int]:
    """One segment per CFG branch, each starting at a multiple of SEGMENT_ALIGN rows (zero padding after it) →
    (segments, total rows). Aligned segments see the same GEMM blocking whatever they are packed with, so a
    request's result does not depend on its neighbours (bit for bit on CPU); padding rows never reach attention."""
    segments, start = [], 0
    for row in rows:
        n = row.tokens.shape[0]
        for br in row.branches:
            segments.append(Segment(start, n, br.prefix, row.commit))
            start += -(-n // SEGMENT_ALIGN) * SEGMENT_ALIGN
    return segments, start


class DenoiseStep:
    """Runs denoise steps over packed rows. Owns the attention backend and, per layout (row sizes, branches,
    commit flags, and whatever the backend's shapes depend on), a `StepLayout`: input buffers, attention plan
    and, on CUDA with `cuda_graphs`, the captured forward. The most recent MAX_LAYOUTS layouts are kept."""

    MAX_LAYOUTS = 16

    def __init__(
        self,
        model: Cosmos3Transformer,
        pool: KVPool,
        kernels: GenKernels = EAGER,
        attention: str = "auto",
        cuda_graphs: bool = True,
    ):
        cfg = model.cfg
        self.model, self.pool, self.kernels = model, pool, kernels
        self.attention = make_attention(attention, pool, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.sdpa = self.attention if isinstance(self.attention, SdpaAttention) else SdpaAttention(pool)
        self.cuda_graphs = cuda_graphs and pool.k_pages.is_cuda
        self.graph_pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None  # shared: replays are serial
        self.layouts: OrderedDict[tuple, StepLayout] = OrderedDict()
        self.captures = 0

    def layout(self, rows: list[Row]) -> tuple[StepLayout, list[Segment]]:
        segments, total = segments_of(rows)
        attention = self.attention if self.attention.supports(segments) else self.sdpa
        key = (
            tuple((r.tokens.shape[0], len(r.branches), r.commit) for r in rows),
            attention.name,
            attention.shape_key(segments),
        )
        layout = self.layouts.pop(key, None) or StepLayout(self, attention, total, rows[0].tokens.shape[1], segments)
        self.layouts[key] = layout
        while len(self.layouts) > self.MAX_LAYOUTS:
            self.layouts.popitem(last=False)
        return layout, segments

    @torch.inference_mode()
    def __call__(self, rows: list[Row]) -> list[RowOutput]:
        """One GEN pass over all rows → per row its per-branch velocity (fp32, zero on clean frames) or K/V."""
        layout, segments = self.layout(rows)
        layout.fill(rows, segments)
        preds, collected = layout.run()
        p = self.model.cfg.latent_patch_size
        out: list[RowOutput] = []
        seg = 0
        for row in rows:
            n = row.tokens.shape[0]
            result = RowOutput([], [])
            for _ in row.branches:
                if row.commit:
                    result.kv.append(collected[seg])
                else:
                    start = segments[seg].start
                    # zero on clean tokens; the product is a new tensor (preds is the layout's, reused next step)
                    v = preds[start : start + n].float() * row.noisy_mask[:, None]
                    result.velocity.append(unpatchify(v, row.token_shape, p, row.latent_hw))
                seg += 1
            out.append(result)
        return out
