"""The denoise step and the one function that builds its input.

`denoise_step_row` is the only constructor of a `Row` (what one request contributes to a step). Every
caller — the engine's tick, warmup, AR commit passes, tests — gets rows from it; `pack_rows` concatenates
rows (each CFG branch is its own segment) and `denoise_step` runs the GEN tower once over the pack and
returns each row's per-branch velocity, or, for a commit row (an AR window's clean latents, no timestep),
its per-branch, per-layer K/V to append to the stream's context.

Layouts:
  latents     [1, C, T, H, W] fp32 (the scheduler's sample; H, W in latent pixels)
  row tokens  [T*h*w, p*p*C] in the model dtype, token order (t, h, w), features (p_h, p_w, C)
  velocity    [1, C, T, H, W] fp32, zero on clean (conditioning) frames
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_pool import KVPool, PageList
from .layers import Cosmos3Transformer
from .towers import EAGER, GenKernels, gen_forward


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
    timesteps: torch.Tensor  # [N] fp32: the step's timestep on noisy tokens, 0 on clean ones
    noisy_mask: torch.Tensor  # [N] bool
    token_shape: tuple[int, int, int]  # (T, h, w) patches
    noisy_frames: torch.Tensor  # [T_noisy] long
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


@dataclass(frozen=True)
class PackedStep:
    tokens: torch.Tensor  # [S, patch_latent_dim]
    timesteps: torch.Tensor  # [S]
    noisy_mask: torch.Tensor  # [S]
    cos: torch.Tensor  # [S, head_dim]
    sin: torch.Tensor  # [S, head_dim]
    segments: list[Segment]


def patchify(latents: torch.Tensor, p: int) -> torch.Tensor:
    """[1, C, T, H, W] → [T*(H/p)*(W/p), p*p*C]."""
    _, c, t, h, w = latents.shape
    x = latents.reshape(c, t, h // p, p, w // p, p)
    return torch.einsum("cthpwq->thwpqc", x).reshape(-1, p * p * c)


def unpatchify(tokens: torch.Tensor, token_shape: tuple[int, int, int], p: int) -> torch.Tensor:
    """[T*h*w, p*p*C] → [1, C, T, h*p, w*p]."""
    t, h, w = token_shape
    x = tokens.reshape(t, h, w, p, p, -1)
    return torch.einsum("thwpqc->cthpwq", x).reshape(1, -1, t, h * p, w * p)


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
    token_shape = (t, h // patch, w // patch)
    per_frame = token_shape[1] * token_shape[2]
    frame_is_noisy = torch.zeros(t, dtype=torch.bool, device=latents.device)
    frame_is_noisy[noisy_frames] = True
    noisy_mask = frame_is_noisy.repeat_interleave(per_frame)
    timesteps = torch.where(noisy_mask, float(timestep), 0.0).to(torch.float32)
    return Row(
        tokens=patchify(latents.to(dtype), patch),
        timesteps=timesteps,
        noisy_mask=noisy_mask,
        token_shape=token_shape,
        noisy_frames=noisy_frames,
        branches=branches,
        commit=commit,
    )


SEGMENT_ALIGN = 64  # rows; see pack_rows


def _pad(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros((rows, *x.shape[1:]))]) if rows else x


def pack_rows(rows: list[Row]) -> PackedStep:
    """Concatenate rows, one segment per CFG branch, each starting at a multiple of SEGMENT_ALIGN rows (zero
    padding after it). Aligned segments see the same GEMM blocking whatever they are packed with, so a request's
    result does not depend on its neighbours (bit for bit on CPU); padding rows never reach attention."""
    tokens, timesteps, masks, cos, sin, segments = [], [], [], [], [], []
    start = 0
    for row in rows:
        n = row.tokens.shape[0]
        pad = -n % SEGMENT_ALIGN
        for br in row.branches:
            tokens.append(_pad(row.tokens, pad))
            timesteps.append(_pad(row.timesteps, pad))
            masks.append(_pad(row.noisy_mask, pad))
            cos.append(_pad(br.cos, pad))
            sin.append(_pad(br.sin, pad))
            segments.append(Segment(start, n, br.prefix, row.commit))
            start += n + pad
    return PackedStep(
        torch.cat(tokens), torch.cat(timesteps), torch.cat(masks), torch.cat(cos), torch.cat(sin), segments
    )


@torch.inference_mode()
def denoise_step(
    model: Cosmos3Transformer, pool: KVPool, rows: list[Row], kernels: GenKernels = EAGER
) -> list[RowOutput]:
    """One GEN pass over all rows → per row its per-branch velocity (fp32, zero on clean frames) or K/V."""
    packed = pack_rows(rows)
    preds, collected = gen_forward(model, pool, packed, kernels)
    p = model.cfg.latent_patch_size
    out: list[RowOutput] = []
    seg = 0
    for row in rows:
        n = row.tokens.shape[0]
        result = RowOutput([], [])
        frame_keep = torch.zeros(row.token_shape[0], dtype=torch.float32, device=preds.device)
        frame_keep[row.noisy_frames] = 1.0
        for _ in row.branches:
            if row.commit:
                result.kv.append(collected[seg])
            else:
                start = packed.segments[seg].start
                v = unpatchify(preds[start : start + n].float(), row.token_shape, p)
                result.velocity.append(v * frame_keep.view(1, 1, -1, 1, 1))
            seg += 1
        out.append(result)
    return out
