"""3-D interleaved mRoPE: position ids for text and latent tokens, and the cos/sin tables built from them.

Text tokens: the same id on all three axes, 0..n-1. Latent tokens: temporal ids start at
`text_len + temporal_modality_margin` and are fps-modulated for video (`t * base_fps / fps` per latent
frame); spatial ids restart at 0. Tables are `[tokens, head_dim]` (cos, sin), computed in fp32 and cast
to the model dtype, exactly as the reference does, on the device that uses them.
"""

from __future__ import annotations

import torch

from .config import ModelConfig


def text_position_ids(num_tokens: int) -> torch.Tensor:
    """[3, num_tokens] float ids (float because the reference uses float ids when fps modulation is on)."""
    return torch.arange(num_tokens, dtype=torch.float32).unsqueeze(0).expand(3, -1)


def vision_position_ids(
    cfg: ModelConfig, grid: tuple[int, int, int], text_len: int, fps: float, frame_offset: int = 0
) -> torch.Tensor:
    """[3, T*h*w] ids for a latent patch grid (T, h, w) that follows `text_len` text tokens.

    `frame_offset` shifts the temporal ids by whole latent frames (AR windows at absolute positions)."""
    grid_t, grid_h, grid_w = grid
    offset = text_len + cfg.temporal_modality_margin
    frames = torch.arange(grid_t, dtype=torch.float32) + frame_offset
    if cfg.enable_fps_modulation and grid_t > 1:
        # latent frames per second vs the base rate the model was trained at
        frames = frames / (fps / cfg.vae_scale_temporal) * (cfg.base_fps / cfg.vae_scale_temporal)
    t_ids = (frames + offset).view(-1, 1).expand(-1, grid_h * grid_w).flatten()
    h_ids = torch.arange(grid_h, dtype=torch.float32).view(1, -1, 1).expand(grid_t, -1, grid_w).flatten()
    w_ids = torch.arange(grid_w, dtype=torch.float32).view(1, 1, -1).expand(grid_t, grid_h, -1).flatten()
    if not cfg.reset_spatial_ids:
        h_ids, w_ids = h_ids + offset, w_ids + offset
    return torch.stack([t_ids, h_ids, w_ids])


def rotary_tables(
    cfg: ModelConfig, position_ids: torch.Tensor, dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids [3, N] → (cos, sin), each [N, head_dim] in `dtype`."""
    d = cfg.head_dim
    # on `device`: a video's tables are ~1.5 M cos/sin, tens of ms on the host while the GPU waits
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))  # [d/2]
    freqs = position_ids.to(device).float()[:, :, None] * inv_freq[None, None, :]  # [3, N, d/2]
    # interleave: frequency j takes its position from axis H (j%3==1), W (j%3==2) within the mRoPE sections
    mixed = freqs[0].clone()
    for axis, start in ((1, 1), (2, 2)):
        idx = slice(start, cfg.rope_axes_dim[axis] * 3, 3)
        mixed[:, idx] = freqs[axis, :, idx]
    emb = torch.cat([mixed, mixed], dim=-1)  # [N, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, d], cos/sin [N, d] → rotated x (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
