"""python -m client generate --prompt P [same options as the offline CLI] [--url 127.0.0.1:8001] --out FILE
python -m client stream --prompt P [--window-mode chained|kv ...] [--keep-session | --continue ID] --out FILE
python -m client world --prompt P [--window-mode chained|kv ...] [--then-frames N] --out FILE

Streams the request over gRPC, shows a progress bar from the server's first progress event on, writes
.mp4/.png/.npy (and, for an action request, --actions-out .npy/.json) and prints time to first chunk (TTFC), where
the time went (report.py) and, with a cache policy, the steps it skipped. Ctrl-C cancels the request on the server
and exits at once (status 130). `stream --keep-session` prints the session's id on stdout (alone: `ID=$(...)`);
`stream --continue ID` goes on from it (num_frames: the new frames); `world` is that loop interactively (world.py).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from cosmos3_core.media import FRAME_SUFFIXES, write_actions, write_frames
from cosmos3_core.requests import add_request_arguments, params_from_arguments

from .report import cache_lines, timing_lines
from .stream import ServerError, generate, wait_ready


def add_request_args(p: argparse.ArgumentParser, windows: bool = False) -> None:
    p.add_argument("--url", default="127.0.0.1:8001", help="the server's gRPC address (default: %(default)s)")
    p.add_argument("--wait-ready", type=float, default=0.0, help="wait up to this many seconds for the server")
    add_request_arguments(p, windows)


CLIENT_ACTION_SUFFIXES = (".npy", ".json")


def interrupt_once(signum: int, frame: Any) -> None:
    """Ctrl-C: KeyboardInterrupt once (generate then cancels the request); a second one must not cut that short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


class ProgressBar:
    """The denoise bar, shown from the first progress event to the last step: before it the request waits in the
    server, after it the video decodes, and a steps/s rate counting either would not be the denoise rate."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.started = self.closed = False

    def update(self, event: dict) -> None:
        if self.closed:
            return
        total = event["steps"] * event.get("windows", 1)
        n = event.get("window", 0) * event["steps"] + event["step"]
        if self.bar is None:
            from tqdm import tqdm

            self.started = True
            self.bar = tqdm(desc="denoise", unit="step", file=sys.stderr, total=total, initial=n)
        else:
            self.bar.update(n - self.bar.n)
        self.bar.set_postfix_str(f"window {event.get('window', 0) + 1}/{event.get('windows', 1)}")
        if n >= total:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.bar is not None:
            self.bar.close()
        elif self.started:  # Ctrl-C while it first drew itself: end its line
            print(file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m client")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="one request; the whole video at the end")
    add_request_args(g)
    g.add_argument("--out", required=True, help="output file: " + ", ".join(FRAME_SUFFIXES))
    s = sub.add_parser("stream", help="a long video window by window (Nano AR); chunks written as they arrive")
    add_request_args(s, windows=True)
    s.add_argument(
        "--out", required=True, help="the joined video (.mp4/.npy); chunks go next to it as <stem>.chunkNNN.mp4"
    )
    s.add_argument("--keep-session", action="store_true", help="keep the stream's session; its id goes to stdout")
    s.add_argument("--continue", dest="continue_id", metavar="ID",
                   help="continue that session: --num-frames more frames (a multiple of 4), re-prompted by --prompt")  # fmt: skip
    w = sub.add_parser("world", help="an interactive session: each window plays as it arrives; a new prompt (or "
                       "Enter: go on, q: stop) between requests; the whole video at the end")  # fmt: skip
    add_request_args(w, windows=True)
    w.add_argument("--then-frames", type=int, help="new frames per continuation (a multiple of 4; default: a window's)")
    w.add_argument("--out", required=True, help="the whole video (.mp4/.npy); chunks go next to it")
    args = ap.parse_args(argv)
    if args.command == "world":
        from .world import world

        return world(args)

    if not args.out.endswith(FRAME_SUFFIXES):
        print(f"error: out: suffix must be one of {', '.join(FRAME_SUFFIXES)}", file=sys.stderr)
        return 2
    if args.actions_out and not args.actions_out.endswith(CLIENT_ACTION_SUFFIXES):
        print(f"error: actions_out: suffix must be one of {', '.join(CLIENT_ACTION_SUFFIXES)}", file=sys.stderr)
        return 2
    from cosmos3_core.requests import RequestError

    image = video = raw_actions = None
    try:
        params = params_from_arguments(args)  # --cache's JSON is parsed here; the server checks the rest
        if args.command == "stream":
            params.update(session_parameters(params, args.keep_session, args.continue_id))
        if args.image or args.video or args.raw_actions:
            from cosmos3_core.inputs import load_image, load_raw_actions, load_video

            image = load_image(args.image) if args.image else None
            video = load_video(args.video) if args.video else None
            raw_actions = load_raw_actions(args.raw_actions) if args.raw_actions else None
    except RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from tqdm import tqdm

    bar = ProgressBar()
    out = Path(args.out)
    chunks_written: list[str] = []

    def on_event(event: dict, frames) -> None:
        if event["type"] == "progress":
            bar.update(event)
        elif frames is not None and args.command == "stream":
            path = out.with_name(f"{out.stem}.chunk{len(chunks_written):03d}.mp4")
            write_frames(path, frames, event["fps"])  # the server's resolved rate (its default unless sent)
            chunks_written.append(str(path))
            first = event["frame_offset"]  # a window's frames may come in several pieces, each decoded as it can be
            tqdm.write(f"frames {first}-{first + frames.shape[0] - 1} (window {event['window'] + 1}/{event['windows']})"
                       f" → {path}", file=sys.stderr)  # fmt: skip

    # main() may run inside another program (tests call it): its own SIGINT handler comes back after the request
    previous = (
        signal.signal(signal.SIGINT, interrupt_once) if threading.current_thread() is threading.main_thread() else None
    )
    try:
        if args.wait_ready:
            wait_ready(args.url, args.wait_ready)
        result = generate(args.url, args.prompt, params, image, on_event=on_event, video=video, raw_actions=raw_actions)
    except ServerError as e:
        bar.close()
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # generate has cancelled the request on the server
        bar.close()
        print("cancelled (Ctrl-C): the server stops the request", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    bar.close()
    done = next((e for e in result.events if e["type"] == "done"), None)
    if done is None:
        print("error: the server's last response carried no done event", file=sys.stderr)
        return 1
    video = result.video
    write_frames(out, video, done["fps"], result.audio)  # .mp4 carries the audio track, at the server's rate
    print(f"wrote {out}: {video.shape[0]} frames {video.shape[2]}x{video.shape[1]}", file=sys.stderr)
    if args.audio_out and result.audio is not None:
        from cosmos3_core.media import write_audio

        write_audio(args.audio_out, result.audio)
        print(f"wrote {args.audio_out}: audio {list(result.audio.shape)}", file=sys.stderr)
    if args.actions_out and result.actions is not None:
        write_actions(args.actions_out, result.actions)
        print(f"wrote {args.actions_out}: actions {list(result.actions.shape)}", file=sys.stderr)
    gaps = [b - a for a, b in zip(result.chunk_times, result.chunk_times[1:])]
    print(
        f"TTFC {result.ttfc_s:.2f}s  e2e {result.e2e_s:.2f}s  frames/s {video.shape[0] / result.e2e_s:.1f}",
        file=sys.stderr,
    )
    if gaps:
        print("chunk gaps " + " ".join(f"{g:.2f}s" for g in gaps), file=sys.stderr)
    for line in timing_lines(done["timings"], result.e2e_s) + cache_lines(done.get("cache_skipped")):
        print(line, file=sys.stderr)
    if args.command == "stream" and args.keep_session:
        if "session_id" not in done:
            print("error: the server kept no session (draining, or max_sessions reached)", file=sys.stderr)
            return 1
        print(done["session_id"])  # stdout: the id alone
    return 0


def session_parameters(params: dict, keep: bool, continue_id: str | None) -> dict:
    """A stream's `session` and window parameters: a continuation takes its windows from its session (and sends
    none but what the user gave); a new stream is chained unless told otherwise."""
    out: dict = {}
    if continue_id:
        out["session"] = {"continue": continue_id, "keep": keep}
    else:
        out["window_mode"] = params.get("window_mode") or "chained"
        if keep:
            out["session"] = {"keep": True}
    return out


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # outside the request (starting, writing files): nothing runs on the server
        print("interrupted", file=sys.stderr)
        sys.exit(130)
