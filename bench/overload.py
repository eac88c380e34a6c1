"""Overload: factor × max_queue requests sent at once to a real server (each client's stream opened first, then all
released together). Load beyond the server's queue must be refused at the door, at once, with the one
"over capacity" text; every accepted request must complete; the server's outcome counters must account for every
request sent.

  python -m bench.overload --config configs/tiny.yaml --factor 3 [--json out.json]

Prints: accepted / refused / other errors / lost; refusal latency (send → the error, as the client sees it) p50 and
max; the door's own time per request inside the server (Triton's queue and request durations of `cosmos3_admit`, for
the admitted ones); accepted end-to-end p50 and p99 (and the solo request's, for scale); the delta of `cosmos3_requests_total` by outcome and whether
sent = completed + rejected + failed + cancelled. Exit 1 when something was lost, a refusal took longer than
`--refusal-bound-s` (default 0.1), an accepted request failed, or the counters do not add up.
"""

from __future__ import annotations

import argparse
import json
import queue
import re
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from client.stream import build_inputs
from cosmos3_core.errors import OVER_CAPACITY, client_text
from cosmos3_core.wire import decode_event

from . import prom

OUTCOMES = ("completed", "rejected", "failed", "cancelled")


def outcome_counts(metrics_url: str) -> dict[str, float]:
    """`cosmos3_requests_total` by outcome, summed over the models and instances that count (door and engine)."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    out = dict.fromkeys(OUTCOMES, 0.0)
    for labels, value in prom.samples(text, "cosmos3_requests_total"):
        out[labels["outcome"]] = out.get(labels["outcome"], 0.0) + value
    return out


def door_stats(metrics_url: str) -> dict[str, float]:
    """Triton's own cumulative statistics of the door (`cosmos3_admit`) for the requests it admitted: their count and
    the microseconds they spent in its queue and in the whole step (queue + execute)."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    out = {}
    for key, name in (("admitted", "request_success"), ("queue_us", "queue_duration_us"),
                      ("step_us", "request_duration_us")):  # fmt: skip
        m = re.search(rf'^nv_inference_{name}\{{[^}}]*model="cosmos3_admit"[^}}]*\}} (\S+)$', text, re.M)
        out[key] = float(m.group(1)) if m else 0.0
    return out


class Stream:
    """One client with its stream open; `send` then `wait` → its outcome."""

    def __init__(self, url: str, inputs: list[Any]):
        import tritonclient.grpc as grpcclient

        self.inputs, self.responses = inputs, queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(
            callback=lambda result, error: self.responses.put((result, error, time.perf_counter()))
        )
        self.t_send = 0.0

    def send(self) -> None:
        self.t_send = time.perf_counter()
        self.client.async_stream_infer("cosmos3", self.inputs, enable_empty_final_response=True)

    def wait(self, timeout_s: float) -> dict[str, Any]:
        done = False
        try:
            while True:
                result, error, t = self.responses.get(timeout=timeout_s)
                if error is not None:
                    # Triton's own refusal at the door's queue reads the same (errors.client_text)
                    status = "refused" if client_text(str(error), "") == OVER_CAPACITY else "error"
                    return {"status": status, "latency_s": t - self.t_send, "message": str(error)}
                event = result.as_numpy("event")
                if event is not None and event.size:
                    done = done or decode_event(event.reshape(-1)[0])["type"] == "done"
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return {"status": "completed" if done else "lost", "latency_s": t - self.t_send}
        except queue.Empty:
            return {"status": "lost", "latency_s": timeout_s, "message": f"no final response within {timeout_s:.0f}s"}
        finally:
            self.client.stop_stream()
            self.client.close()


def fire(url: str, n: int, params: dict[str, Any], timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """n requests (seeds 0..n-1) sent at once → one outcome each, in order: completed, refused (the over-capacity
    text), error (any other), or lost (no done event, or no final response)."""
    streams = [Stream(url, build_inputs(f"overload {i}", {**params, "seed": i}, None)) for i in range(n)]
    outcomes: list[dict[str, Any]] = [{} for _ in range(n)]
    barrier = threading.Barrier(n)

    def one(i: int) -> None:
        barrier.wait()
        streams[i].send()
        outcomes[i] = {"i": i, **streams[i].wait(timeout_s)}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(outcomes: list[dict[str, Any]], before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    by = {s: [o for o in outcomes if o["status"] == s] for s in ("completed", "refused", "error", "lost")}
    refusal = [o["latency_s"] for o in by["refused"]]
    accepted = [o["latency_s"] for o in by["completed"]]
    counted = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(after) | set(before))}
    return {
        "sent": len(outcomes),
        **{k: len(v) for k, v in by.items()},
        "refusal_p50_s": percentile(refusal, 50),
        "refusal_max_s": max(refusal, default=None),
        "error_p50_s": percentile([o["latency_s"] for o in by["error"]], 50),
        "error_max_s": max((o["latency_s"] for o in by["error"]), default=None),
        "accepted_p50_s": percentile(accepted, 50),
        "accepted_p99_s": percentile(accepted, 99),
        "counted": counted,
        "accounted": sum(counted.values()) == len(outcomes),
        "errors": sorted({o["message"][:200] for o in by["error"] + by["lost"] if "message" in o}),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--factor", type=float, default=3.0, help="requests sent at once, in multiples of max_queue")
    ap.add_argument("--params", default="{}", help="request parameters (JSON) beyond the seed")
    ap.add_argument("--refusal-bound-s", type=float, default=0.1)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    from cosmos3_core.deployment import Deployment
    from cosmos3_core.triton.launcher import stop_server, wait_until_ready
    from cosmos3_core.triton.serve import start

    params = json.loads(args.params)
    proc, ports, deployment = start(Deployment.load(args.config), Path(tempfile.mkdtemp(prefix="cosmos3-overload-")))
    url, metrics_url = f"127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[2]}/metrics"
    n = round(args.factor * deployment.max_queue)
    try:
        wait_until_ready(ports[1], proc=proc, timeout_s=600)
        solo = fire(url, 1, params)[0]  # warms the server; the scale of one request alone
        time.sleep(1.0)  # the engine publishes its counters every 0.2 s
        before, door0 = outcome_counts(metrics_url), door_stats(metrics_url)
        t0 = time.perf_counter()
        outcomes = fire(url, n, params)
        wall = time.perf_counter() - t0
        time.sleep(1.0)
        after, door1 = outcome_counts(metrics_url), door_stats(metrics_url)
    finally:
        stop_server(proc)
    report = {"config": args.config, "max_queue": deployment.max_queue, "factor": args.factor, "params": params,
              "solo_s": solo["latency_s"], "wall_s": wall, **summarize(outcomes, before, after)}  # fmt: skip
    # inside the server, the door's own time per admitted request (Triton's statistics; refusals cost the same)
    admitted = max(door1["admitted"] - door0["admitted"], 1.0)
    report["door_queue_ms"] = (door1["queue_us"] - door0["queue_us"]) / admitted / 1000
    report["door_step_ms"] = (door1["step_us"] - door0["step_us"]) / admitted / 1000
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    slow = report["refused"] and report["refusal_max_s"] > args.refusal_bound_s
    ok = solo["status"] == "completed" and not (report["lost"] or report["error"] or slow) and report["accounted"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
