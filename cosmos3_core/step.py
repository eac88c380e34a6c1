"""The denoise step and the one function that builds its input.

`denoise_step_row` is the only constructor of a `Row` (what one request contributes to a step). Every
caller — the engine's tick, warmup, AR commit passes, tests — gets rows from it; `pack_rows` concatenates
rows (each CFG branch is its own segment) and `denoise_step` runs the GEN tower once over the pack and
returns each row's per-branch velocity.

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
from .towers import gen_forward


@dataclass(frozen=True)
class Branch:
    """One CFG branch of a request: its text K/V pages and the rotary tables of its latent tokens."""

    text_kv: PageList
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


@dataclass(frozen=True)
class Segment:
    start: int
    length: int
    text_kv: PageList


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
) -> Row:
    """Build one request's input to a denoise step.

    latents [1, C, T, H, W] (any dtype; cast to the model dtype), `timestep` the scheduler's t for this step
    (applied to the frames in `noisy_frames`; a commit pass passes no noisy frames), `branches` per CFG branch."""
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
    )


def pack_rows(rows: list[Row]) -> PackedStep:
    tokens, timesteps, masks, cos, sin, segments = [], [], [], [], [], []
    start = 0
    for row in rows:
        n = row.tokens.shape[0]
        for br in row.branches:
            tokens.append(row.tokens)
            timesteps.append(row.timesteps)
            masks.append(row.noisy_mask)
            cos.append(br.cos)
            sin.append(br.sin)
            segments.append(Segment(start, n, br.text_kv))
            start += n
    return PackedStep(
        torch.cat(tokens), torch.cat(timesteps), torch.cat(masks), torch.cat(cos), torch.cat(sin), segments
    )


@torch.inference_mode()
def denoise_step(model: Cosmos3Transformer, pool: KVPool, rows: list[Row]) -> list[list[torch.Tensor]]:
    """One GEN pass over all rows → per row, per branch, the velocity [1, C, T, H, W] fp32."""
    packed = pack_rows(rows)
    preds = gen_forward(model, pool, packed)
    p = model.cfg.latent_patch_size
    out: list[list[torch.Tensor]] = []
    start = 0
    for row in rows:
        n = row.tokens.shape[0]
        frame_keep = torch.zeros(row.token_shape[0], dtype=torch.float32, device=preds.device)
        frame_keep[row.noisy_frames] = 1.0
        velocities = []
        for _ in row.branches:
            v = unpatchify(preds[start : start + n].float(), row.token_shape, p)
            velocities.append(v * frame_keep.view(1, 1, -1, 1, 1))
            start += n
        out.append(velocities)
    return out
