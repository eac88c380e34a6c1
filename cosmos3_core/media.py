"""Write generated frames: .mp4 (H.264 via imageio-ffmpeg), .png (first frame), .npy (uint8 [T, H, W, 3]).

numpy + imageio only, so the client can use it without torch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

FRAME_SUFFIXES = (".mp4", ".png", ".npy")


def write_frames(path: str | Path, frames: np.ndarray, fps: float) -> None:
    """frames: uint8 [T, H, W, 3]."""
    import imageio.v2 as imageio

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".npy":
        np.save(path, frames)
    elif path.suffix == ".png":
        imageio.imwrite(path, frames[0])
    elif path.suffix == ".mp4":
        # macro_block_size=1 keeps odd-multiple sizes exact instead of resizing
        with imageio.get_writer(path, fps=fps, codec="libx264", quality=8, macro_block_size=1) as writer:
            for frame in frames:
                writer.append_data(frame)
    else:
        raise ValueError(f"unsupported output suffix {path.suffix!r}; use one of {', '.join(FRAME_SUFFIXES)}")
