"""The real Cosmos guardrail in served requests on the CPU: `cosmos_guardrail.CosmosSafetyChecker` with
random weights at the real sizes, behind the tiny default deployment, through tritonserver.

  make guardrail-served     (builds .venv-guardrail: torch 2.14.1 + torchvision 0.29.1, where the package imports)
  .venv-guardrail/bin/python -m bench.guardrail_served [--json OUT]

1. A snapshot in build/guardrail/hub, the server's HF_HUB_CACHE, offline (cosmos3_core/tools/guardrail_snapshot.py):
   Qwen3Guard at Qwen3Guard-Gen-0.6B's shape whose verdict ("Safety: Safe") is 1 token (`verdict_tokens`),
   RetinaFace's ResNet-50 with every prior a face (every frame comes back pixelated), the blocklist (`grenade`).
2. configs/tiny.yaml with `safety_checker: cosmos` (and `safety_checker_optional: true`, for step 4's reference),
   served on free loopback ports.
3. An allowed prompt: the text guardrail (blocklist, Qwen3Guard) in prefill, the video guardrail on its frames in
   decode (`safety.CosmosVideoBatched`).
4. The same request with `enable_safety_check: false`: its frames through the package's own RetinaFaceFilter (batch 1,
   in this process) must equal step 3's frames.
5. A refused prompt (a blocklist word): its error text and `cosmos3_requests_total{outcome="refused"}`.
Prints each outcome and its time; stops the server; exits 1 if an outcome is not the expected one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from . import prom

ALLOWED = "A robot arm stacks red and blue cubes on a wooden table, soft daylight."
REFUSED = "A crate of grenades on a wooden table."  # the snapshot's blocklist word, fuzzy-matched
PARAMS = {"height": 128, "width": 192, "num_frames": 17, "steps": 4, "seed": 7}
WORK = Path("build/guardrail")  # the snapshot (hub/), its NLTK copy (home/), the server's workdir (serve/)


def refused_count(metrics_port: int) -> float:
    """cosmos3_requests_total{outcome="refused"}, summed over the models that count it (prefill, vae_decode)."""
    return prom.total(prom.scrape(metrics_port, timeout_s=10), "cosmos3_requests_total", outcome="refused")


def outcome(result, what: str) -> dict:
    """A served request's e2e and its server-side prefill and decode times (the guardrail's two checks run there)."""
    t = result.events[-1].get("timings", {})
    return {"outcome": what, "e2e_s": round(result.e2e_s, 2), **{k: round(t[k], 3) for k in ("prefill_s", "decode_s")}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.guardrail_served", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--qwen", choices=("real", "tiny"), default="real", help="Qwen3Guard's size in the snapshot")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    cache = WORK.absolute() / "hub"
    if os.environ.get("HF_HUB_CACHE") != str(cache):  # the hub reads its cache folder at import: re-run with it set
        env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(cache.parent / "home")}
        os.execve(sys.executable, [sys.executable, "-m", "bench.guardrail_served", *(argv or sys.argv[1:])], env)

    from client.stream import ServerError, generate
    from cosmos3_core.deployment import Deployment
    from cosmos3_core.tools.guardrail_snapshot import write_guardrail_cache
    from cosmos3_core.triton.launcher import stop_server, wait_until_ready
    from cosmos3_core.triton.serve import start

    r: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "params": PARAMS}
    shutil.rmtree(cache, ignore_errors=True)  # this script's own (WORK), written anew
    t = time.perf_counter()
    write_guardrail_cache(cache, qwen=args.qwen, faces="all", verdict_tokens=1)
    r["snapshot_s"] = round(time.perf_counter() - t, 1)
    d = dataclasses.replace(Deployment.load(args.config), safety_checker="cosmos", safety_checker_optional=True)
    t = time.perf_counter()
    proc, ports, _ = start(d, cache.parent / "serve")  # the server's log: WORK/serve/tritonserver.log
    url, ok = f"127.0.0.1:{ports[0]}", False
    try:
        wait_until_ready(ports[1], proc=proc, timeout_s=900)
        r["server_ready_s"] = round(time.perf_counter() - t, 1)

        checked = generate(url, ALLOWED, PARAMS)  # the first: each guardrail model's first call
        r["allowed"] = outcome(checked, f"served, {list(checked.video.shape)} frames")
        again = generate(url, ALLOWED, PARAMS)
        r["allowed, again"] = outcome(again, "served, the same frames" if np.array_equal(again.video, checked.video)
                                      else "served, OTHER frames")  # fmt: skip
        unchecked = generate(url, ALLOWED, {**PARAMS, "enable_safety_check": False})
        r["allowed, enable_safety_check false"] = outcome(unchecked, "served, no check")
        raw = unchecked.video
        ok = r["allowed, again"]["outcome"] == "served, the same frames"

        before = refused_count(ports[2])
        t = time.perf_counter()
        try:
            generate(url, REFUSED, PARAMS)
            r["refused"], ok = {"outcome": "served (expected a refusal)"}, False
        except ServerError as e:
            r["refused"] = {"outcome": f"error: {e}", "e2e_s": round(time.perf_counter() - t, 2)}
            ok = ok and str(e).startswith("prompt: refused by the Cosmos Guardrail (text guardrail)")
        deadline = time.monotonic() + 10  # the engine metrics' publishing interval
        while refused_count(ports[2]) == before and time.monotonic() < deadline:
            time.sleep(0.2)
        r["refused"]["metric refused +"] = refused_count(ports[2]) - before
        ok = ok and r["refused"]["metric refused +"] == 1
    finally:
        stop_server(proc)

    from cosmos_guardrail.cosmos_guardrail import RetinaFaceFilter

    face = RetinaFaceFilter()  # the package's own, from the same snapshot: batch 1, on the CPU
    expected = face.postprocess(raw.copy())
    same = bool(np.array_equal(checked.video, expected))
    pixelated = float((checked.video != raw).any(-1).mean())
    r["allowed"]["frames == the package's RetinaFaceFilter on the unchecked frames"] = same
    r["allowed"]["pixels changed by the check"] = round(pixelated, 3)
    r["retinaface_params"] = sum(p.numel() for p in face.net.parameters())
    ok = ok and same and pixelated > 0
    r["ok"] = ok
    print(json.dumps(r, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
