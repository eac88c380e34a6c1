"""v2v conditioning (`cosmos3_core.model.video_input`) against the pipeline's own `prepare_latents` on a tiny checkpoint:
the initial latents (clean frames = encoded clip, the rest = the seed's noise) and the clean frame set, for keep
first/last, clean indexes [0, 1] / [0, 2], clips longer and shorter than needed, a clip of another aspect ratio
(stretched, not cropped) and one already at the target size."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.model.conditioning import VaeCodec
from cosmos3_core.model.video_input import condition_pixels, encode_video_condition, initial_latents
from cosmos3_core.sampling import initial_noise
from cosmos3_core.tools.make_tiny import make_tiny
from tests.conftest import reference_pipeline, rel_l2

H, W, F = 32, 48, 17  # 2 x 3 latent grid, 5 latent frames


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("v2v") / "nano", variant="nano", seed=7)


@pytest.fixture(scope="module")
def pipe(ckpt):
    return reference_pipeline(ckpt)


@pytest.fixture(scope="module")
def codec(ckpt):
    return VaeCodec(Checkpoint.open(ckpt).load_vae("cpu", torch.float32))  # our loader, not the pipeline's module


def make_clip(frames: int, h: int = 20, w: int = 36, seed: int = 0) -> np.ndarray:
    """Smooth moving gradients plus noise: every frame differs, and the bilinear resize matters."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    clip = [np.stack([xx * 7 + 9 * t, yy * 11 + 5 * t, (xx + yy) * 3 + 13 * t], -1) for t in range(frames)]
    return ((np.stack(clip) + rng.integers(0, 40, (frames, h, w, 3))) % 256).astype(np.uint8)


def reference(pipe, clip: np.ndarray, indexes, keep: str, seed: int):
    out = pipe.prepare_latents(
        video=[Image.fromarray(f) for f in clip],  # the pipeline's canonical input: PIL frames
        condition_frame_indexes_vision=indexes,
        condition_video_keep=keep,
        num_frames=F,
        height=H,
        width=W,
        generator=torch.Generator().manual_seed(seed),
        device="cpu",
        dtype=torch.float32,
    )
    latents, mask = out[0], out[5]
    return latents, tuple(torch.nonzero(mask[:, 0, 0] > 0).flatten().tolist())


CASES = [  # (clip frames, indexes, keep)
    (12, (0, 1), "first"),  # longer than the 5 frames [0, 1] needs
    (12, (0, 1), "last"),
    (3, (0, 1), "first"),  # shorter: the last frame is repeated
    (3, (0, 1), "last"),
    (12, (0, 2), "first"),  # a gap: latent frame 1 stays noisy
    (12, (2, 0), "last"),
    (6, (0, 2), "first"),  # shorter than the 9 frames [0, 2] needs
    (6, (0, 2), "last"),
    (1, (4,), "first"),  # one frame, conditioning the last latent frame only
]


@pytest.mark.parametrize("frames,indexes,keep", CASES)
def test_equals_pipeline_prepare_latents(pipe, codec, frames, indexes, keep):
    clip = make_clip(frames, seed=frames)
    ref, ref_clean = reference(pipe, clip, indexes, keep, seed=frames)
    cond = encode_video_condition(codec, clip, indexes, keep, num_frames=F, height=H, width=W)
    ours = initial_latents(cond, initial_noise(tuple(ref.shape), seed=frames, device="cpu"))
    assert cond.clean == ref_clean == tuple(sorted(set(indexes)))
    assert ours.shape == ref.shape == (1, 16, 5, 2, 3)
    clean = list(cond.clean)
    err = rel_l2(ours[:, :, clean], ref[:, :, clean])
    assert err <= 1e-6, err  # the encoded frames (prefix encode vs the pipeline's whole-clip encode)
    noisy = [i for i in range(5) if i not in cond.clean]
    assert torch.equal(ours[:, :, noisy], ref[:, :, noisy])  # the seed's noise, untouched


def test_clean_frames_bit_identical(pipe, codec):
    """The prefix encode is exact, not merely close: the Wan encoder is causal in time."""
    clip = make_clip(12)
    ref, _ = reference(pipe, clip, (0, 2), "first", seed=1)
    cond = encode_video_condition(codec, clip, (0, 2), "first", num_frames=F, height=H, width=W)
    assert torch.equal(cond.latents[:, :, [0, 2]], ref[:, :, [0, 2]])
    assert not cond.latents[:, :, [1, 3, 4]].any()  # frames outside `clean` are zero by contract


@pytest.mark.parametrize("src", [(20, 36), (64, 40), (H, W)])
def test_pixels_stretched_like_the_pipeline(pipe, src):
    """Stretched to H x W (no crop), [-1, 1], the last kept frame repeated: the pipeline's preprocess_video + fill."""
    clip = make_clip(3, *src)
    ours = condition_pixels(clip, (0, 2), "first", H, W)  # 9 frames from a 3-frame clip
    pre = pipe.video_processor.preprocess_video([Image.fromarray(f) for f in clip], height=H, width=W).float()
    ref = torch.cat([pre, pre[:, :, -1:].expand(-1, -1, 6, -1, -1)], dim=2)
    assert torch.equal(ours, ref)
    if src != (H, W):  # an aspect-preserving crop (i2v's rule) would give something else
        from cosmos3_core.model.conditioning import preprocess_image

        assert not torch.allclose(ours[:, :, 0], preprocess_image(clip[0], H, W), atol=0.05)


@pytest.mark.parametrize(
    "indexes,keep,num_frames,match",
    [
        ((0, 1), "first", 1, "num_frames > 1"),
        ((), "first", F, "at least one"),
        ((0, 5), "first", F, "past the last latent frame"),
        ((0, -1), "first", F, "non-negative"),
        ((np.int64(0),), "first", F, "non-negative"),  # the pipeline rejects numpy ints too
        ("01", "first", F, "non-negative"),
        ((0,), "middle", F, "first' or 'last"),
    ],
)
def test_rejects_what_the_pipeline_rejects(codec, indexes, keep, num_frames, match):
    with pytest.raises(ValueError, match=match):
        encode_video_condition(codec, make_clip(3), indexes, keep, num_frames=num_frames, height=H, width=W)


@pytest.mark.parametrize(
    "clip", [np.zeros((0, 8, 8, 3), np.uint8), np.zeros((2, 8, 8), np.uint8), np.zeros((2, 8, 8, 3))]
)
def test_rejects_bad_clips(codec, clip):
    with pytest.raises(ValueError, match="video"):
        encode_video_condition(codec, clip, (0,), "first", num_frames=F, height=H, width=W)
