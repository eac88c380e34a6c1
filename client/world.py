"""`python -m client world --prompt P [request options] [--then-frames N] --out FILE`: an interactive AR session.

The first request starts a stream that keeps its session (docs/requests.md#sessions); each window's chunk is written
(`<stem>.chunkNNN.mp4` next to `--out`, the way a headless box plays it) as it arrives. After each request a line is
read from stdin: a new prompt re-prompts the next windows, an empty line goes on with the same prompt, `q` (or the end
of input) stops. Every continuation keeps the session again, so the last one is left to expire on the server
(`session_ttl_s`). The whole video is written to `--out` at the end (also after Ctrl-C, with what came).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from cosmos3_core.media import FRAME_SUFFIXES, write_frames
from cosmos3_core.requests import RequestError, params_from_arguments

from .stream import ServerError, generate, wait_ready


def world(args: argparse.Namespace) -> int:
    if not args.out.endswith(FRAME_SUFFIXES):
        print(f"error: out: suffix must be one of {', '.join(FRAME_SUFFIXES)}", file=sys.stderr)
        return 2
    try:
        params = params_from_arguments(args)
    except RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    params["window_mode"] = params.get("window_mode") or "chained"
    out = Path(args.out)
    pieces: list[np.ndarray] = []
    fps = 24.0

    def on_event(event: dict, frames: np.ndarray | None) -> None:
        nonlocal fps
        if frames is None:
            return
        fps = event["fps"]
        path = out.with_name(f"{out.stem}.chunk{len(pieces):03d}.mp4")
        write_frames(path, frames, fps)
        pieces.append(frames)
        print(f"window {event['window'] + 1}: frames {event['frame_offset']}.. ({frames.shape[0]}) → {path}",
              file=sys.stderr)  # fmt: skip

    prompt, ident, status = args.prompt, None, 0
    try:
        if args.wait_ready:
            wait_ready(args.url, args.wait_ready)
        while True:
            if ident is None:
                request = {**params, "session": {"keep": True}}
            else:
                request = {"session": {"continue": ident, "keep": True}}
                if args.then_frames:
                    request["num_frames"] = args.then_frames
            result = generate(args.url, prompt, request, on_event=on_event)
            done = next((e for e in result.events if e["type"] == "done"), {})
            ident = done.get("session_id")
            if ident is None:
                print("the server kept no session (draining, or max_sessions reached): stopping", file=sys.stderr)
                break
            timings = done.get("timings", {})
            print(f"session {ident}: TTFC {result.ttfc_s or 0:.2f}s, e2e {result.e2e_s:.2f}s "
                  f"(prefill {timings.get('prefill_s', 0):.3f}s)", file=sys.stderr)  # fmt: skip
            print("next prompt (Enter: go on, q: stop): ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line or line.strip() == "q":
                break
            prompt = line.strip() or prompt
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        status = 1
    except KeyboardInterrupt:
        print("cancelled (Ctrl-C): the server stops the request", file=sys.stderr)
        status = 130
    if pieces:
        video = np.concatenate(pieces)
        write_frames(out, video, fps)
        print(f"wrote {out}: {video.shape[0]} frames {video.shape[2]}x{video.shape[1]}", file=sys.stderr)
    return status
