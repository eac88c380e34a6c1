"""A request's file inputs, read for the client and the offline CLI: the i2v image, the v2v clip, forward dynamics'
raw actions → numpy arrays (image uint8 [H, W, 3], clip uint8 [T, H, W, 3], actions float32 [T, D]).

numpy + imageio only (no torch), so the client starts in a fraction of a second. A file that cannot be read is a
`RequestError` naming the request field it was meant for.
"""

from __future__ import annotations

import numpy as np

from .media import read_raw_actions
from .requests import RequestError


def load_image(path: str) -> np.ndarray:
    import imageio.v2 as imageio

    try:
        img = np.asarray(imageio.imread(path))
    except Exception as e:  # noqa: BLE001 - any decoder failure is the same user error
        raise RequestError("image", f"cannot read {path!r} ({e})") from e
    if img.ndim == 2:
        img = np.stack([img] * 3, axis=-1)
    return np.ascontiguousarray(img[..., :3]).astype(np.uint8)


def load_video(path: str) -> np.ndarray:
    """A v2v clip: .npy (uint8 [T, H, W, 3], as stored) or a video imageio-ffmpeg reads (.mp4) → uint8 [T, H, W, 3]."""
    try:
        if path.endswith(".npy"):
            return np.load(path, allow_pickle=False)
        import imageio.v2 as imageio

        return np.stack([np.asarray(f)[..., :3] for f in imageio.mimread(path, memtest=False)]).astype(np.uint8)
    except Exception as e:  # noqa: BLE001 - any decoder failure is the same user error
        raise RequestError("video", f"cannot read {path!r} ({e})") from e


def load_raw_actions(path: str) -> np.ndarray:
    try:
        return read_raw_actions(path)
    except Exception as e:  # noqa: BLE001 - any reader failure is the same user error
        raise RequestError("raw_actions", f"cannot read {path!r} ({e})") from e
