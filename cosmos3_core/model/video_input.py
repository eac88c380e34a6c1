"""Video-to-video conditioning: a clip → the clean conditioning latents, as `Cosmos3OmniPipeline(video=...)` builds them.

Contract (diffusers 0.42.1, `pipeline_cosmos3_omni.py`, "P"):

- Input clip: uint8 numpy ``[T, H, W, 3]`` (any size). The reference's canonical input is a list of PIL frames;
  ours equals it given ``[PIL.Image.fromarray(f) for f in clip]``. (A numpy clip handed to the pipeline itself takes
  another path: ``VaeImageProcessor`` then resizes with nearest and expects floats in [0, 1], so uint8 would be
  wrong there.)
- Each frame is **stretched** to ``height × width`` (PIL bilinear, no aspect-preserving crop, unlike i2v's
  `conditioning.preprocess_image`), scaled to [-1, 1] in fp32 (P:813-816, `VideoProcessor.preprocess_video`).
- The first or last ``max(indexes)·4 + 1`` frames are kept (``keep``, P:817-822), written from t = 0 and the last kept
  frame repeated to ``num_frames`` (P:868-877); the clip is VAE-encoded (distribution mode) and normalised with the
  VAE's ``latents_mean`` / ``latents_std`` (P:507-515, 884).
- Exactly the listed latent frames are clean: a gap such as ``[0, 2]`` leaves frame 1 noisy (P:942-948). Noisy frames
  start as pure noise (P:950-956), so their encoded values are never used.

Encoding only the needed prefix: the Wan encoder is causal in time (first frame alone, then chunks of 4), so latent
frame k depends on pixel frames ``≤ 4k`` only. We encode the ``max(indexes)·4 + 1`` frames that reach the last clean
latent frame instead of all ``num_frames`` (189 → 5 for the default ``(0, 1)``); the clean frames are the
pipeline's to the bit (`tests/test_video_input.py`).

Output layout: `VideoCondition.latents` is ``[1, C, T_lat, h, w]`` fp32 with ``T_lat = 1 + (num_frames-1)//4`` and
``h, w = height/16, width/16``; frames not in `clean` are zero. `initial_latents` merges it with the noise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from PIL import Image

__all__ = [
    "VideoCondition", "check_video_request", "condition_pixels", "encode_video_condition", "initial_latents",
    "stretch_frames",
]  # fmt: skip

Keep = Literal["first", "last"]


@dataclass(frozen=True)
class VideoCondition:
    latents: torch.Tensor  # [1, C, T_lat, h, w] fp32, normalised; zero outside `clean`
    clean: tuple[int, ...]  # sorted latent-frame indexes kept clean (no timestep embedding, zero velocity)


def latent_frames(num_frames: int, temporal: int = 4) -> int:
    return (num_frames - 1) // temporal + 1


def check_video_request(
    clip: np.ndarray, indexes: Sequence[int], keep: str, num_frames: int, temporal: int = 4
) -> tuple[int, ...]:
    """The pipeline's v2v checks (P:1069-1089) plus the clip's own; returns the indexes as a tuple."""
    if not isinstance(clip, np.ndarray) or clip.dtype != np.uint8 or clip.ndim != 4 or clip.shape[-1] != 3:
        what = f"{clip.dtype} {tuple(clip.shape)}" if isinstance(clip, np.ndarray) else type(clip).__name__
        raise ValueError(f"video: must be uint8 [T, H, W, 3], got {what}")
    if clip.shape[0] < 1 or clip.shape[1] < 1 or clip.shape[2] < 1:
        raise ValueError(f"video: empty clip {tuple(clip.shape)}")
    if num_frames == 1:
        raise ValueError("video: conditioning requires num_frames > 1")
    if keep not in ("first", "last"):
        raise ValueError(f"condition_video_keep: must be 'first' or 'last', got {keep!r}")
    # bool is an int subclass the reference accepts too (isinstance(True, int)); numpy ints it rejects
    if isinstance(indexes, (str, bytes)) or not all(isinstance(i, int) and i >= 0 for i in indexes):
        raise ValueError(f"condition_frame_indexes: must be non-negative ints, got {indexes!r}")
    idx = tuple(indexes)
    if not idx:
        raise ValueError("condition_frame_indexes: must contain at least one index")
    if max(idx) >= latent_frames(num_frames, temporal):
        raise ValueError(
            f"condition_frame_indexes: {idx} reaches past the last latent frame "
            f"({latent_frames(num_frames, temporal)} latent frames for num_frames={num_frames})"
        )
    return idx


def stretch_frames(frames: np.ndarray, height: int, width: int) -> torch.Tensor:
    """uint8 [T, H, W, 3] → [1, 3, T, height, width] fp32 in [-1, 1]: `VideoProcessor.preprocess_video` on PIL frames
    (each stretched, no crop)."""
    out = []
    for frame in frames:
        # PIL bilinear with reducing_gap=None, exactly VaeImageProcessor.resize on PIL input (a same-size
        # resize is a copy); then pil_to_numpy's /255 in fp32 and normalize's 2x-1
        img = Image.fromarray(frame).resize((width, height), resample=Image.Resampling.BILINEAR, reducing_gap=None)
        out.append(np.asarray(img, dtype=np.uint8).astype(np.float32) / 255.0)
    x = torch.from_numpy(np.stack(out)).permute(3, 0, 1, 2).unsqueeze(0)  # [T,H,W,3] → [1, 3, T, H, W]
    return 2.0 * x - 1.0


def condition_pixels(
    clip: np.ndarray, indexes: Sequence[int], keep: Keep, height: int, width: int, temporal: int = 4
) -> torch.Tensor:
    """uint8 [T, H, W, 3] → [1, 3, n, height, width] fp32 in [-1, 1], n = max(indexes)·temporal + 1: the prefix of the
    pipeline's repeat-padded conditioning clip that the clean latent frames depend on."""
    n = max(indexes) * temporal + 1
    kept = clip[:n] if keep == "first" else clip[-n:]  # a shorter clip is kept whole (P:819-822)
    x = stretch_frames(kept, height, width)
    if x.shape[2] < n:  # repeat the last kept frame (P:874-877)
        x = torch.cat([x, x[:, :, -1:].expand(-1, -1, n - x.shape[2], -1, -1)], dim=2)
    return x.contiguous()


@torch.inference_mode()
def encode_video_condition(
    codec,  # conditioning.VaeCodec: .vae (AutoencoderKLWan), .mean / .inv_std [1, C, 1, 1, 1], .dtype, .device
    clip: np.ndarray,
    indexes: Sequence[int],
    keep: Keep,
    num_frames: int,
    height: int,
    width: int,
) -> VideoCondition:
    """The v2v conditioning latents and clean frame indexes for one request (validated here too)."""
    temporal = int(codec.vae.config.scale_factor_temporal)
    idx = check_video_request(clip, indexes, keep, num_frames, temporal)
    pixels = condition_pixels(clip, idx, keep, height, width, temporal).to(codec.device)
    mu = codec.vae.encode(pixels.to(codec.dtype)).latent_dist.mode()  # [1, C, max(idx)+1, h, w]
    # (x - mean) * (1/std) in the VAE's dtype, then fp32: the pipeline's _encode_video (P:507-515)
    z = ((mu - codec.mean) * codec.inv_std).float()
    clean = tuple(sorted(set(idx)))
    out = z.new_zeros(z.shape[0], z.shape[1], latent_frames(num_frames, temporal), *z.shape[3:])
    out[:, :, list(clean)] = z[:, :, list(clean)]
    return VideoCondition(latents=out, clean=clean)


def initial_latents(cond: VideoCondition, noise: torch.Tensor) -> torch.Tensor:
    """Noise [1, C, T_lat, h, w] (drawn for the full shape, clean frames included, P:951) with the clean frames
    replaced: `mask·x0 + (1-mask)·noise` of the pipeline, which is exactly this for finite values."""
    out = noise.clone()
    out[:, :, list(cond.clean)] = cond.latents[:, :, list(cond.clean)].to(noise.device, noise.dtype)
    return out
