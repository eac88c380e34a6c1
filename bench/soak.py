"""Soak: N mixed requests (single-shot and AR, random sizes and seeds) at concurrency C against a real server,
cancelling a fraction at random points. Checks that every request ends with exactly one final response or one
clear error, that every completed result equals its solo run, and that K/V pages and the server's RSS return
to baseline.

  python -m bench.soak --config configs/tiny.yaml --n 500 --c 8 --cancel 0.2
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from client.stream import ServerError, generate

from .pool import run_pool


def make_requests(n: int, cancel: float, seed: int, max_steps: int = 3) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = rng.choice(["t2i", "t2v", "t2v", "chained", "kv"])
        p = {"seed": rng.randrange(1 << 30), "steps": rng.randint(1, max_steps),
             "height": rng.choice([32, 64]), "width": rng.choice([32, 64])}  # fmt: skip
        if kind == "t2i":
            p["num_frames"] = 1
        elif kind == "t2v":
            p["num_frames"] = rng.choice([5, 9, 17])
        elif kind == "chained":
            p.update(window_mode="chained", num_frames=rng.choice([17, 25, 33]), window_frames=13, overlap_frames=8)
        else:
            p.update(
                window_mode="kv",
                num_frames=rng.choice([17, 25, 33]),
                window_frames=9,
                context_frames=rng.choice([0, 9]),
            )
        windows = 1 if "window_mode" not in p else 4
        cancel_at = rng.randint(1, p["steps"] * windows) if rng.random() < cancel else None
        out.append({"id": i, "prompt": f"soak {i} {kind}", "params": p, "cancel_at": cancel_at})
    return out


def run_soak(url: str, requests: list[dict], concurrency: int, timeout_s: float = 300) -> list[dict]:
    """→ one outcome per request: completed (with frames and its done-event count), error, or cancelled."""

    def one(req: dict) -> dict:
        seen = {"progress": 0}

        def cancel_after(event: dict) -> bool:
            if event["type"] == "progress":
                seen["progress"] += 1
            return req["cancel_at"] is not None and seen["progress"] >= req["cancel_at"]

        try:
            r = generate(url, req["prompt"], req["params"], cancel_after=cancel_after, timeout_s=timeout_s)
            finals = sum(e["type"] == "done" for e in r.events)
            status = "completed" if finals else ("cancelled" if req["cancel_at"] else "lost")
            return {**req, "status": status, "finals": finals, "video": r.video if finals else None}
        except ServerError as e:
            return {**req, "status": "error", "message": str(e)}

    outcomes = run_pool(requests, concurrency, one)
    return sorted(outcomes, key=lambda o: o["id"])


def server_rss_mb(pid: int) -> float:
    """RSS of tritonserver and its stubs (the process group)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pid or int(entry.name) == pid:
                    total += int(
                        next(
                            ln for ln in (entry / "status").read_text().splitlines() if ln.startswith("VmRSS")
                        ).split()[1]
                    )
            except (OSError, StopIteration, ValueError):
                continue
    return total / 1024


def check(outcomes: list[dict], offline) -> dict:
    """Count outcomes; compare every completed result with its solo run."""
    counts = Counter(o["status"] for o in outcomes)
    mismatched = [o["id"] for o in outcomes if o["status"] == "completed"
                  and not np.array_equal(o["video"], offline.frames(o["prompt"], o["params"]))]  # fmt: skip
    bad_finals = [o["id"] for o in outcomes if o["status"] == "completed" and o["finals"] != 1]
    unclear = [o["id"] for o in outcomes if o["status"] == "error" and not o["message"].strip()]
    return {"counts": dict(counts), "lost": counts.get("lost", 0), "mismatched": mismatched,
            "bad_finals": bad_finals, "unclear_errors": unclear}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--c", type=int, default=8)
    ap.add_argument("--cancel", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    from cosmos3_core.deployment import Deployment
    from cosmos3_core.generate import Generator
    from cosmos3_core.triton.launcher import stop_server, wait_until_ready
    from cosmos3_core.triton.serve import start

    proc, ports, deployment = start(Deployment.load(args.config), Path(tempfile.mkdtemp(prefix="cosmos3-soak-")))
    url = f"127.0.0.1:{ports[0]}"
    try:
        wait_until_ready(ports[1], proc=proc, timeout_s=600)
        run_soak(url, make_requests(16, 0.0, seed=99), args.c)  # warm the server before the RSS baseline
        rss0 = server_rss_mb(proc.pid)
        t0 = time.perf_counter()
        outcomes = run_soak(url, make_requests(args.n, args.cancel, args.seed), args.c)
        wall = time.perf_counter() - t0
        time.sleep(1.0)
        rss1 = server_rss_mb(proc.pid)
        import urllib.request

        metrics = urllib.request.urlopen(f"http://127.0.0.1:{ports[2]}/metrics").read().decode()
        pages = [ln for ln in metrics.splitlines() if ln.startswith("cosmos3_kv_pages_used")]
    finally:
        stop_server(proc)
    report = check(outcomes, Generator(deployment))
    report.update(n=args.n, concurrency=args.c, wall_s=wall, rss_before_mb=rss0, rss_after_mb=rss1, pages=pages)
    print(json.dumps({k: v for k, v in report.items()}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    ok = not (report["lost"] or report["mismatched"] or report["bad_finals"] or report["unclear_errors"])
    return 0 if ok and all(p.endswith(" 0") for p in pages) else 1


if __name__ == "__main__":
    sys.exit(main())
