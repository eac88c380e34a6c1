"""Served LoRA cost (BENCHMARKS.md's LoRA rows): one server with adapters, then diffusers with the same adapter.

  python -m bench.lora_bench --config configs/bench_edge.yaml [--rank 32] [--c1 2] [--c4 1] [--diffusers 1]
      [--json out.json] [--md out/bench_rows.md]
  python -m bench.lora_bench --config configs/tiny.yaml --rank 4 --params '{"num_frames": 5, "steps": 2}'  # CPU

Writes six random adapters (tools/make_lora: rank `--rank` on the attention and MLP linears of both towers, fp32
safetensors as `save_lora_adapter` writes them; ~264 MB each at Edge's shapes and rank 32) into a fresh `lora_dir`,
then starts the real tritonserver on `--config` with that `lora_dir`, `max_loras` 4, `max_lora_rank` = the rank, and
each of the config's `warmup_requests` also run with adapter `a0` (the adapter path's compile and layouts belong to
startup, as in a deployment that serves adapters). The request is the config's default (`--params` overrides it),
seed i for a lane's i-th request. In order, on that one server:

- c=1: `--c1` base requests, then `--c1` with adapter `a0` (each after a 2-step one of its kind) → the adapter's
  e2e over the base's (target: ≤ 1.10×);
- c=4: four client lanes at once, each sending `--c4` requests one after another — all base, then lane k with
  adapter `a<k>`, so the four requests in flight always hold four different adapters → e2e p50 and videos/min
  against the base lanes (target: ≤ 1.15×). Before each, a burst of the same lanes with 2/4/6/8-step requests, so
  the packs of 8, 6, 4 and 2 CFG branches have run (eagerly, then captured) before the timed ones;
- first use: a 2-step request with `new0` (never used: its weights are read by prefill and by denoise and copied
  into a slot, evicting the least recently used adapter) between two 2-step requests with a resident adapter
  (`a0`, then `new0` again); its extra e2e over their mean is the first-use cost (target: ≤ 1 s); again for `new1`.

Then, with the server gone, `--diffusers N` runs the same request through diffusers' `Cosmos3OmniPipeline`
(bench.served.diffusers_variants, the same random init at the same shapes as its other rows) without an adapter
and with `a0` (`load_lora_adapter` + `set_adapters`), each after a 2-step run. The figures print as they come (a
run cut short keeps what it printed; `--json` is rewritten after each phase); `--md` appends the row to
BENCHMARKS.md (bench/report.py). Budget on the H200 at Edge's request: adapters ~10 s, startup ~70-100 s, c=1 ~30
s, c=4 ~70 s, first use ~10 s, diffusers ~50 s: ~4-4.5 min.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from client.stream import generate
from cosmos3_core.deployment import Deployment, parse_sets
from cosmos3_core.model.provision import resolve_checkpoint
from cosmos3_core.tools.make_lora import make_lora
from cosmos3_core.triton.launcher import stop_server, wait_until_ready
from cosmos3_core.triton.serve import start

from .served import PROMPT, diffusers_variants, drive

LANES = 4  # the c=4 rows: four client lanes, one adapter each
ADAPTERS = [f"a{k}" for k in range(LANES)] + ["new0", "new1"]  # a0: the c=1 adapter; new*: first use
BURST_STEPS = (2, 4, 6, 8)  # lane k's warm request: packs of 8, 6, 4, 2 CFG branches, each for 2 steps


def lora(name: str) -> dict:
    return {"lora": {"name": name}}


def lanes(url: str, each: list[dict], count: int) -> dict:
    """len(each) client lanes at once, lane k sending `count` requests with parameters each[k] one after another
    (bench.served.drive at c=1 per lane) → drive's figures over all of them (wall: the whole)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(each)) as pool:
        runs = list(pool.map(lambda p: drive(url, p, count, 1), each))
    wall = time.perf_counter() - t0
    e2e = [x for r in runs for x in r["e2e"]]
    server = {k: statistics.median(r["server_p50"][k] for r in runs) for k in runs[0]["server_p50"]}
    return {"count": len(e2e), "concurrency": len(each), "wall_s": wall, "e2e": e2e, "e2e_p50": statistics.median(e2e),
            "videos_per_min": 60 * len(e2e) / wall, "server_p50": server}  # fmt: skip


def one(url: str, params: dict) -> dict:
    """One request → its e2e and the done event's server timings."""
    r = generate(url, PROMPT, {**params, "seed": 0})
    done = next(e for e in r.events if e["type"] == "done")
    return {"e2e": r.e2e_s, **{k: v for k, v in done["timings"].items() if k in ("prefill_s", "queue_s")}}


def write_adapters(checkpoint: str, folder: Path, rank: int) -> float:
    """ADAPTERS as rank-`rank` adapters on both towers' attention and MLP linears → seconds spent."""
    t0 = time.perf_counter()
    root = resolve_checkpoint(checkpoint)
    for seed, name in enumerate(ADAPTERS):
        make_lora(root, folder / name, rank=rank, targets=("gen", "und"), seed=seed)
    return time.perf_counter() - t0


def served(url: str, params: dict, c1: int, c4: int, result: dict, save) -> None:
    """The served rows into `result` (see the module docstring); `save()` after each phase."""
    short = {**params, "steps": 2}
    for key, extra in (("c1:base", {}), ("c1:lora", lora("a0"))):
        t = one(url, {**short, **extra})["e2e"]
        r = result[key] = drive(url, {**params, **extra}, c1, 1)
        print(f"{key}: 2-step first {t:.2f}s, then e2e {' / '.join(f'{x:.2f}' for x in r['e2e'])} s", flush=True)
        save()
    for key, each in (("c4:base", [{}] * LANES), ("c4:lora", [lora(f"a{k}") for k in range(LANES)])):
        t0 = time.perf_counter()
        lanes(url, [{**params, **e, "steps": s} for e, s in zip(each, BURST_STEPS)], 1)
        r = result[key] = lanes(url, [{**params, **e} for e in each], c4)
        print(f"{key}: burst {time.perf_counter() - t0 - r['wall_s']:.1f}s, then {r['count']} requests in "
              f"{r['wall_s']:.1f}s, e2e p50 {r['e2e_p50']:.2f}s", flush=True)  # fmt: skip
        save()
    uses = result["first_use"] = {}
    for new in ("new0", "new1"):
        resident, fresh, again = (one(url, {**short, **lora(n)}) for n in ("a0", new, new))
        cost = fresh["e2e"] - (resident["e2e"] + again["e2e"]) / 2
        uses[new] = {"resident": resident, "first": fresh, "again": again, "first_use_s": cost}
        print(f"first use of {new}: +{cost:.2f}s (2-step e2e {fresh['e2e']:.2f}s vs resident {resident['e2e']:.2f} / "
              f"{again['e2e']:.2f}s)", flush=True)  # fmt: skip
    save()


def rows(result: dict) -> list[str]:
    """The printed summary: each row and its ratio against its target."""
    out = []

    def p50(key: str) -> float:
        return result[key]["e2e_p50"]

    def line(key: str, label: str) -> str:
        r = result[key]
        return (f"{label:28s} e2e p50 {r['e2e_p50']:7.2f}s  videos/min {r['videos_per_min']:6.2f}  server denoise p50 "
                f"{r['server_p50'].get('denoise_s', float('nan')):.2f}s  (n={r['count']})")  # fmt: skip

    if "c1:lora" in result:
        out += [line("c1:base", "c=1 base"), line("c1:lora", "c=1 adapter a0"),
                f"  adapter / base c=1 e2e: {p50('c1:lora') / p50('c1:base'):.3f}x (target <= 1.10x)"]  # fmt: skip
    if "c4:lora" in result:
        out += [line("c4:base", "c=4 base (4 lanes)"), line("c4:lora", "c=4 4 adapters (4 lanes)"),
                f"  4 adapters / base c=4: e2e p50 {p50('c4:lora') / p50('c4:base'):.3f}x, videos/min "
                f"{result['c4:base']['videos_per_min'] / result['c4:lora']['videos_per_min']:.3f}x fewer "
                "(target <= 1.15x)"]  # fmt: skip
    if result.get("first_use"):
        costs = [u["first_use_s"] for u in result["first_use"].values()]
        out.append(f"first use of a new adapter: {' / '.join(f'+{c:.2f}s' for c in costs)} (target <= 1 s)")
    theirs = result.get("diffusers", {})
    if "t2v" in theirs and "t2v+lora" in theirs:
        base, with_lora = (statistics.median(theirs[k]["e2e"]) for k in ("t2v", "t2v+lora"))
        out.append(f"diffusers: e2e {base:.2f}s, with the adapter {with_lora:.2f}s ({with_lora / base:.3f}x); "
                   f"load_lora_adapter {theirs['t2v+lora']['lora_load_s']:.2f}s")  # fmt: skip
        if "c1:lora" in result:
            out.append(f"  diffusers / served with the adapter, c=1 e2e: {with_lora / p50('c1:lora'):.2f}x")
    if "startup_s" in result:
        out.append(f"server startup (load + compile + warmup, an adapter request included) {result['startup_s']:.0f}s")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/bench_edge.yaml")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--c1", type=int, default=2, help="requests at c=1, base and with an adapter")
    ap.add_argument("--c4", type=int, default=1, help="requests per lane at c=4 (4 lanes), base and with adapters")
    ap.add_argument("--diffusers", type=int, default=1, help="then N through diffusers, without and with the adapter")
    ap.add_argument("--params", default="{}", help="JSON request parameters (default: the config's defaults)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=YAML", help="override a top-level config key")
    ap.add_argument("--json", default="")
    ap.add_argument("--md", default="", help="append a row (date, GPU, command, figures) to this file")
    args = ap.parse_args()
    t_start = time.perf_counter()
    overrides = parse_sets(args.set)
    params = json.loads(args.params)
    base = Deployment.load(args.config, **overrides)
    lora_dir = Path(tempfile.mkdtemp(prefix="cosmos3-loras-"))
    took = write_adapters(base.checkpoint, lora_dir, args.rank)
    print(f"{len(ADAPTERS)} rank-{args.rank} adapters (both towers) written in {took:.1f}s", flush=True)
    warmup = [*base.warmup_requests, *({**w, **lora("a0")} for w in base.warmup_requests)]
    configured = Deployment.load(args.config, **{**overrides, "lora_dir": str(lora_dir), "max_loras": LANES,
                                                  "max_lora_rank": args.rank, "warmup_requests": warmup})  # fmt: skip
    result: dict = {"config": args.config, "rank": args.rank, "params": params, "adapters_write_s": took}

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))

    workdir = Path(tempfile.mkdtemp(prefix="cosmos3-bench-"))
    proc, ports, _ = start(configured, workdir)
    try:
        result["startup_s"] = wait_until_ready(ports[1], proc=proc, timeout_s=900)
        print(f"server ready in {result['startup_s']:.0f}s", flush=True)
        served(f"127.0.0.1:{ports[0]}", params, args.c1, args.c4, result, save)
    except Exception as e:  # noqa: BLE001
        print(f"benchmark failed: {e}\n--- server log tail ---\n{(workdir / 'tritonserver.log').read_text()[-3000:]}",
              file=sys.stderr)  # fmt: skip
        shutil.rmtree(lora_dir, ignore_errors=True)
        return 1
    finally:
        stop_server(proc)
    print("\n".join(rows(result)), flush=True)
    if args.diffusers:  # same run, same request, once the server has released the GPU
        request = (params, None, None, None)
        try:
            result["diffusers"] = diffusers_variants(
                configured, {"t2v": request, "t2v+lora": ({**params, **lora("a0")}, None, None, None)}, args.diffusers
            )
        except Exception as e:  # noqa: BLE001 - the served rows stand without it
            print(f"diffusers failed: {type(e).__name__}: {e}", file=sys.stderr)
    save()
    shutil.rmtree(lora_dir, ignore_errors=True)
    print("\n".join(rows(result)))
    print(f"wall {time.perf_counter() - t_start:.0f}s")
    if args.md:
        from .report import append_row

        figures: dict = {}
        for key in ("c1:base", "c1:lora", "c4:base", "c4:lora"):
            if key in result:
                r = result[key]
                figures |= {f"{key} e2e p50 s": r["e2e_p50"], f"{key} videos/min": r["videos_per_min"]}
        if "c1:lora" in result:
            figures["c1 adapter/base"] = result["c1:lora"]["e2e_p50"] / result["c1:base"]["e2e_p50"]
        if "c4:lora" in result:
            figures["c4 adapters/base"] = result["c4:lora"]["e2e_p50"] / result["c4:base"]["e2e_p50"]
        for name, u in result.get("first_use", {}).items():
            figures[f"first use {name} s"] = u["first_use_s"]
        for name, r in result.get("diffusers", {}).items():
            figures[f"diffusers {name} e2e s"] = statistics.median(r["e2e"])
        figures["startup s"] = result["startup_s"]
        print(append_row(args.md, None, figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
