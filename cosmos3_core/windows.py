"""AR window planning for long videos (Nano AR), in latent frames.

- `none`: one window covering the whole video (a single-shot request).
- `chained`: each window is a full generation of `window` latent frames whose first `overlap` frames are the
  previous window's tail, pinned clean; temporal rotary ids restart at 0 every window. A window contributes
  its frames after the overlap (the first window all of them).
- `kv`: windows do not overlap; window k covers latent frames [k·W, k·W + W) at absolute temporal positions
  and attends to text + the committed K/V of at most `context` earlier latent frames (0: all of them).

A session's continuation (sessions.py) goes on with `continue_windows`: the next windows of the same plan, their
indexes, latent starts and (kv) rotary offsets counting on from where the kept stream ended; a chained one's first
window pins the kept tail.

Pixel ↔ latent frames: n pixel frames ↔ 1 + (n-1)/4 latent frames; a chunk of latent frames decodes to
1 + 4(n-1) pixel frames if it starts the video, else 4n.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Window:
    index: int
    latent_start: int  # first latent frame of the joined video this window's frames land on
    length: int  # latent frames generated in this window (pinned ones included)
    pinned: int  # leading latent frames copied clean from the previous window (chained)
    rotary_offset: int  # temporal offset of the window's rotary ids, in latent frames

    @property
    def new_frames(self) -> int:
        return self.length - self.pinned


@dataclass(frozen=True)
class WindowPlan:
    mode: str
    windows: tuple[Window, ...]
    context: int  # kv: committed latent frames kept (0 = all)
    total_latent: int

    @property
    def commits(self) -> bool:
        return self.mode == "kv"


def latent_frames(pixel_frames: int, temporal: int) -> int:
    return 1 + (pixel_frames - 1) // temporal


def pixel_frames_of_chunk(latent_start: int, latent_count: int, temporal: int) -> tuple[int, int]:
    """(pixel frame offset, pixel frame count) of latent frames [start, start+count) in the decoded video."""
    offset = 0 if latent_start == 0 else 1 + temporal * (latent_start - 1)
    count = (1 + temporal * (latent_count - 1)) if latent_start == 0 else temporal * latent_count
    return offset, count


def plan_windows(mode: str, total_latent: int, window: int, overlap: int, context: int) -> WindowPlan:
    if mode == "none":
        return WindowPlan(mode, (Window(0, 0, total_latent, 0, 0),), 0, total_latent)
    windows: list[Window] = []
    if mode == "chained":
        start = 0
        while True:
            pinned = 0 if not windows else overlap
            length = min(window, pinned + total_latent - start)
            windows.append(Window(len(windows), start, length, pinned, 0))
            start += length - pinned
            if start >= total_latent:
                break
    elif mode == "kv":
        for k, start in enumerate(range(0, total_latent, window)):
            windows.append(Window(k, start, min(window, total_latent - start), 0, start))
    else:
        raise ValueError(f"unknown window mode {mode!r}")
    return WindowPlan(mode, tuple(windows), context, total_latent)


def continue_windows(
    mode: str, start: int, index: int, new_latent: int, window: int, overlap: int, context: int
) -> WindowPlan:
    """The windows that generate `new_latent` more latent frames of a stream whose windows so far ended before latent
    frame `start`, the next one being window `index`: what `plan_windows` gives a stream of `start + new_latent`
    latent frames from that window on, when the earlier ones were whole windows."""
    windows: list[Window] = []
    end = start + new_latent
    if mode == "chained":  # every window pins the previous one's tail (the first: the kept stream's)
        while start < end:
            length = min(window, overlap + end - start)
            windows.append(Window(index + len(windows), start, length, overlap, 0))
            start += length - overlap
    elif mode == "kv":
        for k, s in enumerate(range(start, end, window)):
            windows.append(Window(index + k, s, min(window, end - s), 0, s))
    else:
        raise ValueError(f"window mode {mode!r} has no continuation")
    return WindowPlan(mode, tuple(windows), context, end)
