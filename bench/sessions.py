"""AR sessions served: a continuation's time to first chunk (TTFC) and window time against a fresh stream's.

  python -m bench.sessions --config configs/bench_nano_ar.yaml --set precision=fp8 \
      --params '{"window_mode": "chained", "num_frames": 29, "cache": {"policy": "sea"}}' --repeat 3

Starts the real server on the deployment, runs one untimed stream (warm), then `--repeat` times: a fresh stream of
`--params` that keeps its session (its TTFC is a fresh stream's: prefill, window 0, its decode), a continuation with
the same prompt (no prefill at all: its TTFC should be one window's denoise and decode), and one re-prompted (the
new prompt's text tower only), each `--new-frames` new frames (default: one window's worth, so that, like the
one-window fresh stream, no next window's denoise shares the GPU with its first chunk's decode). Prints per kind
the client's TTFC and chunk gap p50 (pieces of a window, not windows), and the server's window_s and prefill_s
p50; `--json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from client.stream import generate
from cosmos3_core.deployment import Deployment, parse_sets
from cosmos3_core.triton.launcher import stop_server, wait_until_ready
from cosmos3_core.triton.serve import start

PROMPT = "A long drive along the coast at sunset, the camera following a red car"
REPROMPT = "The road turns inland and climbs into snowy mountains"


def one(url: str, prompt: str, params: dict) -> dict:
    out = generate(url, prompt, params)
    done = next(e for e in out.events if e["type"] == "done")
    # the first window's time on the server: from the stream's admission to its first piece
    first = next((e["timings"] for e in out.events if "window_s" in e.get("timings", {})), {})
    gaps = [b - a for a, b in zip(out.chunk_times, out.chunk_times[1:])]
    return {"ttfc_s": out.ttfc_s, "gap_s": statistics.median(gaps) if gaps else None, "e2e_s": out.e2e_s,
            "window_s": first.get("window_s"), "prefill_s": done["timings"].get("prefill_s", 0.0),
            "session_id": done.get("session_id")}  # fmt: skip


def p50(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return statistics.median(values) if values else None


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sessions", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/bench_nano_ar.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=YAML", help="override a deployment key")
    ap.add_argument("--params", default='{"window_mode": "chained", "num_frames": 29}', help="the fresh stream's")
    ap.add_argument("--new-frames", type=int, default=0, help="a continuation's new frames (default: one window's)")
    ap.add_argument("--repeat", type=int, default=3, help="each kind this many times")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    overrides = parse_sets(args.set)
    deployment = Deployment.load(args.config, **overrides)
    params = json.loads(args.params)
    proc, ports, _ = start(deployment, Path(tempfile.mkdtemp(prefix="bench_sessions_")))
    rows: dict[str, list[dict]] = {"fresh": [], "continue": [], "reprompt": []}
    try:
        print(f"server ready in {wait_until_ready(ports[1], proc=proc, timeout_s=1800):.0f} s", flush=True)
        url = f"127.0.0.1:{ports[0]}"
        more = {"num_frames": args.new_frames} if args.new_frames else {}
        warm = one(url, PROMPT, {**params, "session": {"keep": True}})  # untimed: first use of every layout
        one(url, REPROMPT, {**more, "session": {"continue": warm["session_id"]}})
        for _ in range(args.repeat):
            for kind, prompt in (("continue", PROMPT), ("reprompt", REPROMPT)):
                fresh = one(url, PROMPT, {**params, "session": {"keep": True}})
                rows["fresh"].append(fresh)
                if not more:  # one window's new frames: chained (window - overlap), kv a window, in latent frames
                    t = 4
                    window = 1 + (params.get("window_frames", deployment.defaults.window_frames) - 1) // t
                    overlap = params.get("overlap_frames", deployment.defaults.overlap_frames) // t
                    step = window - overlap if params.get("window_mode") == "chained" else window
                    more = {"num_frames": t * step}
                rows[kind].append(one(url, prompt, {**more, "session": {"continue": fresh["session_id"]}}))
                for name, row in (("fresh", fresh), (kind, rows[kind][-1])):  # as they come: a cut-short run says some
                    shown = "-" if row["window_s"] is None else f"{row['window_s']:.2f} s"
                    print(f"{name:9s} TTFC {row['ttfc_s']:.2f} s  window (server) {shown}  "
                          f"e2e {row['e2e_s']:.2f} s", flush=True)  # fmt: skip
                time.sleep(0.1)
    finally:
        stop_server(proc)
    keys = ("ttfc_s", "window_s", "gap_s", "e2e_s", "prefill_s")
    result = {kind: {k: p50(r, k) for k in keys} for kind, r in rows.items()}
    result["command"] = " ".join(sys.argv)
    for kind in ("fresh", "continue", "reprompt"):
        r = result[kind]
        gap, window = ("-" if r[k] is None else f"{r[k]:.2f} s" for k in ("gap_s", "window_s"))
        print(
            f"{kind:9s} TTFC p50 {r['ttfc_s']:.2f} s  window (server) p50 {window}  chunk gap p50 {gap}  "
            f"prefill {r['prefill_s']:.3f} s  e2e {r['e2e_s']:.2f} s"
        )
    print(f"continuation TTFC / fresh: {result['continue']['ttfc_s'] / result['fresh']['ttfc_s']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
