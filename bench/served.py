"""Served speed: start the real tritonserver on a deployment and drive it with concurrent gRPC streams.

  python -m bench.served --config configs/bench_edge.yaml --c1 3 --c4 8 --json out.json
  python -m bench.served --config configs/bench_nano_ar.yaml --c1 0 --c4 0 --ar 1 --ar-params '{...}'

Reports c=1 end-to-end p50, c=4 videos/min and e2e p50 (single-shot t2v), and for `--ar N` Nano-style AR
streams (chained windows): TTFC, chunk gap and aggregate frames/s at c=1 and c=4. `--inprocess N --diffusers N`
then run the same single-shot request, in the same run, through our in-process engine and through diffusers'
`Cosmos3OmniPipeline` on the same random weights (CUDA, `random:` checkpoints).
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
from cosmos3_core.deployment import Deployment
from cosmos3_core.triton.launcher import stop_server, wait_until_ready
from cosmos3_core.triton.serve import start

from .pool import run_pool

PROMPT = "A robot arm stacks red and blue cubes on a wooden table, soft daylight, static camera."


def drive(url: str, params: dict, count: int, concurrency: int) -> dict:
    """`count` requests, `concurrency` at a time. → e2e list, wall time, frames, TTFCs and chunk gaps."""

    def one(i: int) -> dict:
        r = generate(url, PROMPT, {**params, "seed": i})
        gaps = [b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])]
        server = next(e for e in r.events if e["type"] == "done")["timings"]
        return {"e2e": r.e2e_s, "ttfc": r.ttfc_s, "gaps": gaps, "frames": int(r.video.shape[0]), "server": server}

    t0 = time.perf_counter()
    results = run_pool(range(count), concurrency, one)
    wall = time.perf_counter() - t0
    e2e = [r["e2e"] for r in results]
    out = {"count": count, "concurrency": concurrency, "wall_s": wall, "e2e_p50": statistics.median(e2e), "e2e": e2e,
           "videos_per_min": 60 * count / wall, "frames_per_s": sum(r["frames"] for r in results) / wall,
           "ttfc_p50": statistics.median(r["ttfc"] for r in results)}  # fmt: skip
    out["server_p50"] = {k: statistics.median(r["server"][k] for r in results) for k in results[0]["server"]}
    gaps = [g for r in results for g in r["gaps"]]
    if gaps:
        out["chunk_gap_p50"] = statistics.median(gaps)
    return out


def side_by_side(deployment: Deployment, overrides: dict, inprocess: int, diffusers: int) -> dict:
    """The served single-shot request through our engine in this process and through diffusers."""
    from types import SimpleNamespace

    from .inprocess import ours, reference

    t2v = deployment.defaults.t2v
    params = {"height": deployment.defaults.height, "width": deployment.defaults.width,
              "num_frames": deployment.defaults.num_frames, "steps": t2v.steps, "guidance_scale": t2v.guidance_scale,
              "shift": t2v.shift, "seed": 0, **overrides}  # fmt: skip
    if not deployment.checkpoint.startswith("random:"):
        raise SystemExit(
            f"--inprocess/--diffusers build random weights at a preset's shapes; {deployment.checkpoint!r} is not random:"
        )
    preset = deployment.checkpoint.removeprefix("random:")
    out = {}
    if inprocess:
        args = SimpleNamespace(preset=preset, repeat=inprocess, compile=deployment.compile,
                               variants=[deployment.attention + ("+graphs" if deployment.cuda_graphs else "")],
                               precision=deployment.precision, fp8_policy=deployment.fp8_policy)  # fmt: skip
        phases = next(iter(ours(args, params).values()))["phases"]
        out["inprocess"] = {"e2e": phases["e2e"], "phases": phases}
    if diffusers:
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
        out["diffusers"] = reference(SimpleNamespace(preset=preset, repeat=diffusers), params)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/bench_edge.yaml")
    ap.add_argument("--c1", type=int, default=3, help="sequential single-shot requests")
    ap.add_argument("--c4", type=int, default=8, help="single-shot requests at concurrency 4")
    ap.add_argument("--ar", type=int, default=0, help="AR streams at c=1 and at c=4 (×4)")
    ap.add_argument("--ar-params", default='{"window_mode": "chained", "num_frames": 45}')
    ap.add_argument("--params", default="{}", help="JSON request parameters for single-shot runs")
    ap.add_argument(
        "--inprocess", type=int, default=0, help="then N single-shot requests through our in-process engine"
    )
    ap.add_argument(
        "--diffusers", type=int, default=0, help="then N through diffusers' Cosmos3OmniPipeline (same weights)"
    )
    ap.add_argument("--json", default="")
    ap.add_argument("--md", default="", help="append a row (date, GPU, command, figures) to this BENCHMARKS.md")
    args = ap.parse_args()
    configured = Deployment.load(args.config)  # `start` resolves `random:` into a path; side_by_side needs the name
    workdir = Path(tempfile.mkdtemp(prefix="cosmos3-bench-"))
    proc, ports, deployment = start(configured, workdir)
    url = f"127.0.0.1:{ports[0]}"
    result: dict = {"config": args.config}
    try:
        result["startup_s"] = wait_until_ready(ports[1], proc=proc, timeout_s=900)
        params, ar = json.loads(args.params), json.loads(args.ar_params)
        generate(url, PROMPT, {**(params if args.c1 or args.c4 else ar), "steps": 2})  # first-request effects
        if args.c1:
            result["c1"] = drive(url, params, args.c1, 1)
        if args.c4:
            result["c4"] = drive(url, params, args.c4, 4)
        if args.ar:
            result["ar_c1"] = drive(url, ar, args.ar, 1)
            result["ar_c4"] = drive(url, ar, 4 * args.ar, 4)
    except Exception as e:  # noqa: BLE001
        print(
            f"benchmark failed: {e}\n--- server log tail ---\n{(workdir / 'tritonserver.log').read_text()[-3000:]}",
            file=sys.stderr,
        )
        return 1
    finally:
        stop_server(proc)
    if args.json:  # the served figures are kept whatever happens next
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.inprocess or args.diffusers:  # same run, same request, once the server has released the GPU
        result |= side_by_side(configured, json.loads(args.params), args.inprocess, args.diffusers)
    for key in ("c1", "c4", "ar_c1", "ar_c4"):
        if key in result:
            r = result[key]
            extra = f"  TTFC p50 {r['ttfc_p50']:.2f}s" + (
                f"  chunk gap p50 {r['chunk_gap_p50']:.2f}s" if "chunk_gap_p50" in r else ""
            )
            print(f"{key:6s} n={r['count']:2d}  e2e p50 {r['e2e_p50']:7.2f}s  videos/min {r['videos_per_min']:6.2f}  "
                  f"frames/s {r['frames_per_s']:6.1f}{extra}")  # fmt: skip
            print("        server-side p50: " + "  ".join(f"{k} {v:.2f}" for k, v in r["server_p50"].items()))
    print(f"server startup (load + compile + warmup) {result['startup_s']:.0f}s")
    for key in ("inprocess", "diffusers"):
        if key in result:
            print(f"{key:10s} e2e p50 {statistics.median(result[key]['e2e']):7.2f}s  (n={len(result[key]['e2e'])})")
    if "c1" in result and "diffusers" in result:
        served, theirs = result["c1"]["e2e_p50"], statistics.median(result["diffusers"]["e2e"])
        print(f"diffusers / served c=1 e2e: {theirs / served:.2f}x")
        if "inprocess" in result:
            ours = statistics.median(result["inprocess"]["e2e"])
            print(f"served / in-process e2e: {served / ours:.3f}  (server-side denoise {result['c1']['server_p50']['denoise_s']:.2f}s "
                  f"vs in-process {statistics.median(result['inprocess']['phases']['denoise']):.2f}s)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.md:
        import torch

        from .report import append_row

        figures: dict = {}
        for key in ("c1", "c4", "ar_c1", "ar_c4"):
            if key in result:
                r = result[key]
                figures |= {f"{key} e2e p50 s": r["e2e_p50"], f"{key} videos/min": r["videos_per_min"],
                            f"{key} TTFC p50 s": r["ttfc_p50"], f"{key} frames/s": r["frames_per_s"]}  # fmt: skip
                if "chunk_gap_p50" in r:
                    figures[f"{key} chunk gap p50 s"] = r["chunk_gap_p50"]
                figures[f"{key} server denoise p50 s"] = r["server_p50"]["denoise_s"]
        figures["startup s"] = result["startup_s"]
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        print(append_row(args.md, gpu, figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
