"""python -m client generate --prompt P [same options as the offline CLI] [--url 127.0.0.1:8001] --out FILE

Streams the request over gRPC, shows a progress bar from the server's progress events, writes
.mp4/.png/.npy and prints time to first chunk (TTFC) and end-to-end time.
"""

from __future__ import annotations

import argparse
import sys

from cosmos3_core.media import FRAME_SUFFIXES, write_frames

from .stream import ServerError, generate, wait_ready

PARAMS = {"negative_prompt": str, "height": int, "width": int, "num_frames": int, "fps": float, "steps": int,
          "guidance_scale": float, "shift": float, "seed": int}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m client")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="one request, the whole video at the end")
    g.add_argument("--url", default="127.0.0.1:8001")
    g.add_argument("--wait-ready", type=float, default=0.0, help="wait up to this many seconds for the server")
    g.add_argument("--prompt", required=True)
    g.add_argument("--image")
    for name, typ in PARAMS.items():
        flag = {"guidance_scale": "--guidance"}.get(name, "--" + name.replace("_", "-"))
        g.add_argument(flag, dest=name, type=typ)
    g.add_argument("--no-system-prompt", dest="use_system_prompt", action="store_const", const=False)
    g.add_argument("--no-templates", dest="add_templates", action="store_const", const=False)
    g.add_argument("--out", required=True, help="output file: " + ", ".join(FRAME_SUFFIXES))
    args = ap.parse_args(argv)

    if not args.out.endswith(FRAME_SUFFIXES):
        print(f"error: out: suffix must be one of {', '.join(FRAME_SUFFIXES)}", file=sys.stderr)
        return 2
    params = {
        k: getattr(args, k) for k in (*PARAMS, "use_system_prompt", "add_templates") if getattr(args, k) is not None
    }
    image = None
    if args.image:
        from cosmos3_core.generate import load_image
        from cosmos3_core.requests import RequestError

        try:
            image = load_image(args.image)
        except RequestError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    from tqdm import tqdm

    bar = tqdm(desc="denoise", unit="step", file=sys.stderr)

    def on_event(event: dict) -> None:
        if event["type"] == "progress":
            bar.total = event["steps"]
            bar.n = event["step"]
            bar.refresh()

    try:
        if args.wait_ready:
            wait_ready(args.url, args.wait_ready)
        result = generate(args.url, args.prompt, params, image, on_event=on_event)
    except ServerError as e:
        bar.close()
        print(f"error: {e}", file=sys.stderr)
        return 1
    bar.close()
    done = next((e for e in result.events if e["type"] == "done"), {})
    write_frames(args.out, result.video, params.get("fps") or 16.0)
    print(
        f"wrote {args.out}: {result.video.shape[0]} frames {result.video.shape[2]}x{result.video.shape[1]}",
        file=sys.stderr,
    )
    print(f"TTFC {result.ttfc_s:.2f}s  e2e {result.e2e_s:.2f}s  server {done.get('timings', {})}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
