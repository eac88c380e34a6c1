"""The GPU matrix: every shipped model × bf16 / FP8 × no cache / SeaCache, each cell a served check.

  python -m bench.matrix --model edge --precision fp8 --json out/matrix_edge_fp8.json

One server per (model, precision), on the shipped config (`MODELS`; Nano's modes on one checkpoint with sound and
action heads, warmed with every Nano config's `warmup_requests`, so its buckets are derived from all of them;
compile off: the matrix checks paths, `bench.served` times them). For each cache setting and each row kind
(`ROWS`: t2v + i2v, AR chained, AR kv, sound, action) a cell:
- runs each request of the row alone (`STEPS` steps; SeaCache `SEA_STEPS`; `FRAMES` frames but AR and action);
- runs a mixed pack of 3 concurrent requests: the row's kind beside a t2v and an i2v (t2v + i2v + t2v for the
  t2v/i2v row) and checks each against its solo run (frames within bf16 tolerance, `PACK_TOL`; actions and audio
  present where the request asks for them);
- a cell is ✓ when all of that holds, no video is a single value (a NaN decodes to black: two black runs are
  "equal"), and a SeaCache cell reused steps; else the first error. The server must still be ready at the end, and serve
  one more request (`healthy`).
Prints one line per cell and a markdown table (BENCHMARKS.md's "GPU matrix"); `bench/device_matrix.sh` runs it on
the H200.

Timings on the same server, after the cells (so a model's figures cost no second startup): `--time-frames F ...`
one t2v request at the config's steps for each frame count (a 2-step one first, untimed, as `bench.served` does);
`--time-ar JSON` one AR stream (TTFC, chunk gap, server-side phases); `--diffusers-frames F` then diffusers'
pipeline on the same random weights at F frames, once the server has released the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from client.stream import generate
from cosmos3_core.deployment import Deployment
from cosmos3_core.triton.launcher import stop_server, wait_until_ready
from cosmos3_core.triton.serve import start

from .pool import run_pool
from .served import PROMPT, drive, side_by_side, variant_request

NANO_CONFIGS = ["configs/bench_nano_t2v.yaml", "configs/bench_nano_ar.yaml", "configs/bench_nano_sound.yaml",
                "configs/bench_nano_action.yaml"]  # fmt: skip
MODELS = {
    "tiny": {"config": "configs/tiny.yaml", "rows": ["t2v/i2v", "AR chained", "AR kv", "sound", "action"],
             "action": {"resolution_tier": 256}},  # CPU: the script's own check
    "edge": {"config": "configs/bench_edge.yaml", "rows": ["t2v/i2v"]},
    "nano": {"config": "configs/bench_nano_t2v.yaml", "checkpoint": "random:nano_sound_action",
             "warmup_from": NANO_CONFIGS, "rows": ["t2v/i2v", "AR chained", "AR kv", "sound", "action"]},
}  # fmt: skip
AR = {"num_frames": 45, "window_frames": 29}
ROWS = {  # row → (request kind for bench.served.variant_request, extra parameters)
    "t2v/i2v": ("t2v", {}),
    "AR chained": ("t2v", {**AR, "window_mode": "chained", "overlap_frames": 8}),
    "AR kv": ("t2v", {**AR, "window_mode": "kv", "context_frames": 29}),
    "sound": ("t2v+sound", {}),
    "action": ("policy", {}),
}
STEPS, SEA_STEPS = 2, 4
FRAMES = 33  # t2v / i2v / sound requests: the paths at a fraction of 121 frames' decode (AR and action set their own)
# SeaCache that reuses every step its gate allows (steps 1 and 2 of 4): the reuse path runs, not only the recording
SEA = {"cache": {"policy": "sea", "threshold": 1e9, "retention_steps": 1, "cache_end_steps": 1}}
PACK_TOL = 0.05  # relative L2 of a packed request's frames against its solo run's (bf16, random weights)


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-9))


def deployment_of(model: str, precision: str) -> Deployment:
    spec = MODELS[model]
    d = Deployment.load(spec["config"], precision="fp8" if precision == "fp8" else None, compile=False)
    if "checkpoint" in spec:
        warmup = [r for path in spec["warmup_from"] for r in Deployment.load(path).warmup_requests]
        d = dataclasses.replace(d, checkpoint=spec["checkpoint"], warmup_requests=warmup)
    # the cells' frames are the default size: frames up to it keep the plan (eager kernels) within an 80 GB card
    frame = d.defaults.height * d.defaults.width
    frame = min(d.limits.max_frame_pixels or frame, frame)
    return dataclasses.replace(d, limits=dataclasses.replace(d.limits, max_frame_pixels=frame))


class Cell:
    """One row × cache setting on a running server."""

    def __init__(self, url: str, d: Deployment, row: str, cached: bool, action: dict | None = None):
        self.url, self.row, self.cached = url, row, cached
        size = (d.defaults.height, d.defaults.width)
        steps = {"steps": SEA_STEPS if cached else STEPS, **(SEA if cached else {}), "num_frames": FRAMES}
        kind, extra = ROWS[row]
        main = variant_request(kind, {**steps, **extra}, *size, action)
        t2v, i2v = variant_request("t2v", steps, *size), variant_request("i2v", steps, *size)
        # (parameters, image, clip, raw actions, seed): the row's kind, then its pack mates
        self.requests = [(*main, 1), (*i2v, 2), (*t2v, 3)]

    def run_one(self, request) -> dict:
        params, image, clip, raw, seed = request
        r = generate(self.url, PROMPT, {**params, "seed": seed}, image, video=clip, raw_actions=raw, timeout_s=900)
        if r.video.size == 0:
            raise RuntimeError("no frames came back")
        if params.get("enable_sound") and r.audio is None:
            raise RuntimeError("a sound request came back without audio")
        if "action" in params and params["action"]["mode"] != "forward_dynamics" and r.actions is None:
            raise RuntimeError("an action request came back without actions")
        done = next(e for e in r.events if e["type"] == "done")
        return {"seed": seed, "video": r.video, "skipped": done.get("cache_skipped"), "e2e": r.e2e_s}

    def check(self) -> str:
        """→ "✓" or the first error."""
        try:
            solo = {s: self.run_one(r) for r in self.requests for s in [r[-1]]}
            packed = {out["seed"]: out for out in run_pool(self.requests, 3, self.run_one)}
            for seed, alone in solo.items():
                d = rel_l2(packed[seed]["video"], alone["video"])
                if d > PACK_TOL:
                    return f"✗ packed request {seed} differs from its solo run: rel L2 {d:.3f} > {PACK_TOL}"
            for seed, out in [*((s, o) for s, o in solo.items()), *((s, o) for s, o in packed.items())]:
                if np.ptp(out["video"]) == 0:  # black (a NaN decodes to 0): equal to another black run, and wrong
                    return f"✗ request {seed}'s video is one value ({out['video'].flat[0]}): NaN or dead output"
            skipped = solo[1]["skipped"]
            if self.cached and not any(steps for window in _windows(skipped) for steps in window.values()):
                return (
                    f"✗ SeaCache reused no step (threshold {SEA['cache']['threshold']:g} reuses all it may): {skipped}"
                )
            return "✓" + (f" (skipped {skipped})" if self.cached and skipped is not None else "")
        except Exception as e:  # noqa: BLE001 - the cell's result is its error
            return f"✗ {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def _windows(skipped: dict | list | None) -> list[dict]:
    """`done.cache_skipped` → one {branch: steps} per window (a request without windows has one)."""
    return [] if skipped is None else [skipped] if isinstance(skipped, dict) else skipped


def healthy(url: str, http_port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=5) as r:
            if r.status != 200:
                return f"✗ ready answered {r.status}"
        generate(url, PROMPT, {"steps": 2, "seed": 9}, timeout_s=600)
        return "✓"
    except Exception as e:  # noqa: BLE001
        return f"✗ {type(e).__name__}: {str(e)[:200]}"


def timings(url: str, args: argparse.Namespace, result: dict) -> None:
    """`--time-frames` and `--time-ar` on the running server, into `result` and printed."""
    for frames in args.time_frames:
        generate(url, PROMPT, {"num_frames": frames, "steps": 2, "seed": 0}, timeout_s=900)
        r = result[f"t2v @{frames}"] = drive(url, {"num_frames": frames}, 1, 1)
        print(f"{args.model} {args.precision}: t2v {frames} frames e2e {r['e2e_p50']:.2f}s  TTFC {r['ttfc_p50']:.2f}s"
              f"  server " + "  ".join(f"{k} {v:.2f}" for k, v in r["server_p50"].items()), flush=True)  # fmt: skip
    if args.time_ar:
        params = json.loads(args.time_ar)
        generate(url, PROMPT, {**params, "steps": 2, "seed": 0}, timeout_s=900)
        r = result["AR"] = drive(url, params, 1, 1)
        print(f"{args.model} {args.precision}: AR {params} e2e {r['e2e_p50']:.2f}s  TTFC {r['ttfc_p50']:.2f}s  chunk gap "
              f"p50 {r.get('chunk_gap_p50', float('nan')):.2f}s  skipped {100 * r['skipped_fraction']:.0f}%"
              f"  server " + "  ".join(f"{k} {v:.2f}" for k, v in r["server_p50"].items()), flush=True)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=list(MODELS), required=True)
    ap.add_argument("--precision", choices=["bf16", "fp8"], required=True, help="bf16: the config's own dtype")
    ap.add_argument("--rows", nargs="+", help="a subset of the model's rows")
    ap.add_argument("--time-frames", type=int, nargs="+", default=[], help="then one t2v request at each length")
    ap.add_argument("--time-ar", default="", help="then one AR stream with these JSON parameters")
    ap.add_argument("--diffusers-frames", type=int, default=0, help="then diffusers' t2v at this length")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    d = deployment_of(args.model, args.precision)
    workdir = Path(tempfile.mkdtemp(prefix="cosmos3-matrix-"))
    proc, ports, deployment = start(d, workdir)
    url = f"127.0.0.1:{ports[0]}"
    result: dict = {"model": args.model, "precision": args.precision, "cells": {}}
    try:
        result["startup_s"] = wait_until_ready(ports[1], proc=proc, timeout_s=900)
        print(f"{args.model} {args.precision}: ready in {result['startup_s']:.0f}s", flush=True)
        for row in args.rows or MODELS[args.model]["rows"]:
            for cached in (False, True):
                t0 = time.perf_counter()
                status = Cell(url, deployment, row, cached, MODELS[args.model].get("action")).check()
                column = f"{args.precision}{' + SeaCache' if cached else ''}"
                result["cells"][f"{row} | {column}"] = status
                print(f"{args.model} {row:10} {column:16} {status}  ({time.perf_counter() - t0:.0f}s)", flush=True)
        result["healthy"] = healthy(url, ports[1])
        print(f"{args.model} {args.precision}: healthy at the end {result['healthy']}", flush=True)
        timings(url, args, result)
    except Exception as e:  # noqa: BLE001
        result["error"] = f"{type(e).__name__}: {e}"
        print(f"matrix failed: {e}\n--- server log tail ---\n{(workdir / 'tritonserver.log').read_text()[-3000:]}",
              file=sys.stderr)  # fmt: skip
    finally:
        stop_server(proc)
    if args.diffusers_frames:  # same run, same request, once the server has released the GPU
        r = side_by_side(d, {"num_frames": args.diffusers_frames}, 0, 1)["diffusers"]
        result[f"diffusers t2v @{args.diffusers_frames}"] = r["e2e"][0]
        print(f"{args.model}: diffusers t2v {args.diffusers_frames} frames e2e {r['e2e'][0]:.2f}s", flush=True)
    log = (workdir / "tritonserver.log").read_text() if (workdir / "tritonserver.log").exists() else ""
    # the server's own lines, and a GPU tensor that crossed through host memory (Triton's CUDA pool too small)
    wanted = r"(^|\] )cosmos3: |crossed through host memory|falling back to pinned"
    result["log_lines"] = [line for line in log.splitlines() if re.search(wanted, line)][-20:]
    for line in result["log_lines"]:
        print("  log:", line[:300])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, ensure_ascii=False))
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
