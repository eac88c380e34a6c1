"""A safety checker for the behaviour tests, loaded as a deployment's `safety_checker: <this file>:make`
(cosmos3_core/safety.py). Stateless, so concurrent requests through one server cannot disturb each other:

- text: refuses a prompt that holds `REFUSED_WORD`;
- video: frames `BLUR_WIDTH` wide come back with their top-left `PATCH`×`PATCH` block inverted (`blur`, standing in
  for RetinaFace's face pixelation); frames `BLOCK_HEIGHT`×`BLOCK_WIDTH` are blocked when a piece has a multiple of
  4 frames (a stream's first piece has 1 + 4k, its later ones 4k: the first passes, the second is blocked
  mid-stream). Sizes no other test of the session server (the fuzzer's and the soak's draws included) is likely to
  send.
"""

from __future__ import annotations

import numpy as np

REFUSED_WORD = "contraband"
BLUR_WIDTH, BLOCK_HEIGHT, BLOCK_WIDTH, PATCH = 80, 48, 112, 4


def blur(frames: np.ndarray) -> np.ndarray:
    """uint8 [T, H, W, 3] → a copy, as the stand-in returns frames of `BLUR_WIDTH`."""
    out = frames.copy()
    out[:, :PATCH, :PATCH] = 255 - out[:, :PATCH, :PATCH]
    return out


class StandIn:
    def check_text_safety(self, prompt: str) -> bool:
        return REFUSED_WORD not in prompt

    def check_video_safety(self, frames: np.ndarray) -> np.ndarray | None:
        height, width = frames.shape[1:3]
        if (height, width) == (BLOCK_HEIGHT, BLOCK_WIDTH) and frames.shape[0] % 4 == 0:
            return None
        return blur(frames) if width == BLUR_WIDTH else frames


def make() -> StandIn:
    return StandIn()
