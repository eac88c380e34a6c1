"""Robot actions (`Cosmos3OmniPipeline(action=CosmosActionCondition(...))`): the model-level pieces, each equal to
diffusers 0.42.1's pipeline ("P", `pipeline_cosmos3_omni.py`).

- The domain and resolution tables and the sizes derived from them (`ActionGeometry`): `embodiments.py`, plain
  Python, so request validation reads them without torch.
- `canvas_frames(clip, geometry, frames)`: uint8 [T, H, W, 3] → [1, 3, frames, canvas_h, canvas_w] fp32 in [-1, 1]:
  stretched (PIL bilinear), the clip truncated or its last frame repeated to `frames`, downscaled (bicubic,
  antialias), padded right / bottom (reflect; replicate when a pad reaches the content's size).
- `encode_action_condition(codec, clip, mode, chunk, geometry)`: the clean vision latents [1, C, T_lat, lh, lw] fp32
  (T_lat = chunk // 4 + 1). Policy and forward dynamics keep only latent frame 0 clean, so only pixel frame 0 is
  encoded — the anchor encode. The Wan encoder is causal in time (frame 0 alone, then chunks of 4), so that latent
  equals frame 0 of the pipeline's encode of the whole repeat-padded canvas clip, bit for bit, at 1/(chunk+1) of
  the pixels (`tests/test_action.py` checks both and prints the cost ratio). Inverse dynamics encodes the clip.
- `condition_actions(raw, chunk, action_dim)`: forward dynamics' clean action tokens [chunk, action_dim] fp32: the
  last row repeated (or the rows truncated) to `chunk`, channels zero-padded to `action_dim` (P:903-929).
- `action_position_ids(cfg, chunk, text_len, fps)`: [3, chunk] mRoPE ids after the vision start, t = (k+1)·(base_fps
  / 4)/fps: action k lines up with pixel frame k+1; h = w = 0 (P:662-702).

Noise: drawn after vision's (and sound's) from the request's generator, [chunk, action_dim], channels at or above
the domain's raw width set to 0 (P:975-988; `sampling.initial_noise_bands`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .config import ModelConfig
from .embodiments import INVERSE, ActionGeometry
from .video_input import latent_frames, stretch_frames

__all__ = ["action_position_ids", "canvas_frames", "condition_actions", "encode_action_condition"]


def canvas_frames(clip: np.ndarray, geo: ActionGeometry, frames: int) -> torch.Tensor:
    """uint8 [T, H, W, 3] → [1, 3, frames, canvas_h, canvas_w] fp32 in [-1, 1], as the pipeline pads it (P:704-752)."""
    x = stretch_frames(clip[:frames], *geo.frame)  # [1, 3, t, fh, fw]
    if x.shape[2] < frames:  # the last frame repeated
        x = torch.cat([x, x[:, :, -1:].expand(-1, -1, frames - x.shape[2], -1, -1)], dim=2)
    (fh, fw), (th, tw), (ch, cw) = geo.frame, geo.canvas, geo.content
    planes = x[0].permute(1, 0, 2, 3).contiguous()  # [frames, 3, fh, fw]: one image per frame
    if (ch, cw) != (fh, fw):
        planes = F.interpolate(planes, size=(ch, cw), mode="bicubic", align_corners=False, antialias=True)
    pad_right, pad_bottom = tw - cw, th - ch
    if pad_right or pad_bottom:  # reflect needs a pad shorter than the content
        mode = "replicate" if pad_right >= cw or pad_bottom >= ch else "reflect"
        planes = F.pad(planes, (0, pad_right, 0, pad_bottom), mode=mode)
    return planes.permute(1, 0, 2, 3).unsqueeze(0)  # [1, 3, frames, th, tw]


@torch.inference_mode()
def encode_action_condition(
    codec,  # conditioning.VaeCodec: .vae (AutoencoderKLWan), .mean / .inv_std [1, C, 1, 1, 1], .dtype, .device
    clip: np.ndarray,
    mode: str,
    chunk: int,
    geo: ActionGeometry,
) -> torch.Tensor:
    """A request's clean vision latents [1, C, chunk // 4 + 1, lh, lw] fp32, normalised; frames that start as noise
    are zero. `clip`: uint8 [T, H, W, 3] (an image is a clip of one frame)."""
    temporal = int(codec.vae.config.scale_factor_temporal)
    frames = chunk + 1
    encoded = frames if mode == INVERSE else 1  # policy / forward dynamics: the anchor frame alone
    pixels = canvas_frames(clip, geo, encoded).to(codec.device)
    mu = codec.vae.encode(pixels.to(codec.dtype)).latent_dist.mode()  # [1, C, t, th/16, tw/16]
    # (x - mean) * (1/std) in the VAE's dtype, then fp32 and the content crop: the pipeline's _encode_video (P:507-515)
    # and _remove_action_video_padding_from_latent (P:754-761)
    z = ((mu - codec.mean) * codec.inv_std).float()[..., : geo.latent[0], : geo.latent[1]]
    out = z.new_zeros(1, z.shape[1], latent_frames(frames, temporal), *geo.latent)
    out[:, :, : z.shape[2]] = z
    return out


def condition_actions(raw: torch.Tensor, chunk: int, action_dim: int) -> torch.Tensor:
    """raw [T, D] (T ≥ 1, D ≤ action_dim) → [chunk, action_dim] fp32: forward dynamics' clean action tokens."""
    raw = raw.float()
    if raw.shape[0] < chunk:  # actions are transitions: a short sequence holds its last action
        raw = torch.cat([raw, raw[-1:].expand(chunk - raw.shape[0], -1)])
    raw = raw[:chunk]
    return torch.cat([raw, raw.new_zeros(chunk, action_dim - raw.shape[1])], dim=1)


def action_position_ids(cfg: ModelConfig, chunk: int, text_len: int, fps: float) -> torch.Tensor:
    """[3, chunk] float32 ids for the action tokens of a branch whose text prefix has `text_len` tokens.

    The pipeline's `get_3d_mrope_ids_vae_tokens(grid_t=chunk, grid_h=1, grid_w=1, fps=fps,
    temporal_compression_factor=1, base_temporal_compression_factor=4, start_frame_offset=1)`, the arithmetic in the
    same order (P:139-176)."""
    offset = text_len + cfg.temporal_modality_margin  # the vision start: actions are vision's temporal siblings
    k = torch.arange(chunk, dtype=torch.float32)
    if cfg.enable_fps_modulation and chunk > 1:
        t_ids = (k + 1) / float(fps) * (float(cfg.base_fps) / cfg.vae_scale_temporal) + offset
    else:  # the pipeline's integer ids (one action, or no fps modulation); exact in fp32
        t_ids = k + offset + 1
    hw = torch.zeros(chunk, dtype=torch.float32)
    if not cfg.reset_spatial_ids:
        hw = hw + offset
    return torch.stack([t_ids, hw, hw.clone()])
