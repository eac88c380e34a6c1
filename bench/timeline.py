"""Where the wall time goes that no kernel fills. One request runs in-process (prefill, denoise as served:
compiled, graphs, the configured attention; each chunk's decode as the decode stage starts it) under the profiler,
after a warm one. Per phase it prints the wall time, the GPU's busy time (union of kernel, copy and memset
intervals), the idle time, the largest idle gaps with the host op that was running when each began and ended, and
the host calls that waited on the GPU (synchronise, blocking copies), by the op that made them; per denoise phase,
its kernel time by class (GEMMs, attention, Inductor's fused kernels, copies and indexing, other: what a step is
made of beyond the floor's FLOPs); then the engine's ticks by kind (a forward ran / every branch reused the cache / a chunk decoded inside it) with their GPU idle.

  python -m bench.timeline --config configs/bench_edge.yaml [--set KEY=YAML] [--params JSON] [--trace OUT.json]
      [--analyze OUT.json] [--syncs] [--concurrency N]

Phases: `prefill`, then per chunk the engine hands out `denoise k` (until its latents are final) and `decode k`
(the latents to the host, as they cross the wire, then the decode stage's `start_chunk` to uint8 frames). A
single-shot request has one of each (the whole video decoded at once). An AR request (`--params '{"window_mode":
"chained", "num_frames": 45}'`) has one per window; the served path overlaps window k's decode with window k+1's
denoise, this one runs them in turn, so `prefill` + `denoise 0` + `decode 0` is the time to first chunk without the
wire and the queues. `--syncs` then runs the request once more under CUDA's sync debug mode and lists its host
syncs by source line. `--concurrency N` submits N requests together (seeds apart), their phases named `r0 …`
beside a `phase:all`; each chunk's decode runs inside the tick that finished it, so the others wait on it (the server
decodes on its own instance). `--analyze` reads a trace written earlier (no GPU needed). Needs CUDA otherwise.
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
WAITS = ("Synchronize", "cudaMemcpy", "cuMemcpy")  # host calls that can block on the GPU


def record(args) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from cosmos3_core.deployment import Deployment, parse_sets
    from cosmos3_core.generate import Generator

    from .inprocess import PROMPT

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    overrides = parse_sets(args.set)
    gen = Generator(Deployment.load(args.config, **overrides))
    params = json.loads(args.params)
    # --concurrency N: N requests, seeds apart, submitted together (packed as the engine packs them served)
    requests = [
        gen.prefill.validate(PROMPT, {**params, "seed": params.get("seed", 0) + i}, None)
        for i in range(args.concurrency)
    ]

    class PhaseSink:
        """The engine's sink for one request: each chunk's latents decoded as soon as they are final (in the tick
        that finished them: at concurrency > 1 the other requests wait, where the server decodes beside them)."""

        def __init__(self, name: str) -> None:
            self.name, self.k, self.failure = name, 0, None
            self.phase = record_function(f"phase:{self.name}denoise 0")
            self.phase.__enter__()

        def decode(self, latents, last: bool) -> None:
            sync()
            self.phase.__exit__(None, None, None)
            with record_function(f"phase:{self.name}decode {self.k}"):
                gen.decode.start_chunk("timeline", latents.float().cpu(), last)()
                sync()
            self.k += 1
            if not last:
                self.phase = record_function(f"phase:{self.name}denoise {self.k}")
                self.phase.__enter__()

        def progress(self, step: int, steps: int, window: int, windows: int) -> None:
            pass

        def chunk(self, latents, info) -> None:
            self.decode(latents, False)

        def done(self, latents, info, sound=None, actions=None) -> None:
            self.decode(latents, True)

        def error(self, message: str) -> None:
            self.failure = message
            self.phase.__exit__(None, None, None)

        def cancelled(self) -> bool:
            return False

    ticks: list[int] = []  # per engine tick: the rows its forward ran (0: every branch reused the cache)

    def request() -> None:
        names = [f"r{i} " if len(requests) > 1 else "" for i in range(len(requests))]
        with record_function("phase:all"):
            pres = []
            for name, p in zip(names, requests):
                with record_function(f"phase:{name}prefill"):
                    pres.append(gen.prefill.run(p, None))
                    sync()
            sinks = [PhaseSink(name) for name in names]
            for pre, sink in zip(pres, sinks):
                gen.engine.submit(pre, sink)
            ticks.clear()
            while gen.engine.has_work():
                with record_function(f"tick {len(ticks)}"):
                    ran = gen.engine.tick()
                ticks.append(gen.engine.scheduler.stats.rows_last_tick if ran else -1)
        failures = [s.failure for s in sinks if s.failure is not None]
        if failures:
            raise RuntimeError(failures[0])

    request()  # warm: the decoder's compiles, this prompt's layout
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]
        if torch.cuda.is_available()
        else [ProfilerActivity.CPU]
    ) as prof:
        request()
    prof.export_chrome_trace(args.trace)
    with open(args.trace + ".ticks.json", "w") as f:
        json.dump({"rows": ticks}, f)
    if args.syncs and torch.cuda.is_available():  # after the profile, on the same deployment (one compile for both)
        audit_syncs(request)
    return args.trace


def audit_syncs(request) -> None:
    """`--syncs`: after the profiled request, once more under CUDA's sync debug mode. Every call the mode flags (a stream synchronize,
    a blocking copy either way, `.item()`, `nonzero`) is counted by the Python lines that made it: the innermost
    frames of this repository, diffusers and flashinfer. A lower bound: `torch.cuda.Event.synchronize`, a device-wide
    synchronize and syncs inside extensions are not flagged. Each such wait drains the GPU's queue, and it idles
    while the host prepares what comes next."""
    import traceback
    import warnings
    from collections import Counter

    import torch

    ours = ("cosmos3_core", "diffusers", "flashinfer", "bench")
    counts: Counter = Counter()

    def hook(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if any(f"/{o}/" in f.filename for o in ours)]
        counts[" < ".join(f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            request()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    print(f"host syncs flagged in one request: {sum(counts.values())}, by where (innermost first):")
    for where, n in counts.most_common():
        print(f"  {n:5d}  {where}")


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


class HostOps:
    """Host ops per thread, to name the innermost one running at a time."""

    def __init__(self, events: list[dict]):
        self.by_tid: dict = defaultdict(list)
        for e in events:
            if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"):
                self.by_tid[e["tid"]].append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
        for ops in self.by_tid.values():
            ops.sort()
        self.starts = {tid: [o[0] for o in ops] for tid, ops in self.by_tid.items()}

    def stack_at(self, t: float, tid) -> list[str]:
        ops = self.by_tid.get(tid, [])
        i = bisect.bisect_right(self.starts.get(tid, []), t)
        covering = [o for o in ops[max(0, i - 4000) : i] if o[1] >= t]
        return [name for _, _, name in sorted(covering, key=lambda o: o[1] - o[0])]

    def main_tid(self, t0: float, t1: float):
        """The thread that launched the most work in [t0, t1]."""
        counts = {
            tid: sum(1 for a, _, n in ops if t0 <= a <= t1 and n.startswith("cuda")) for tid, ops in self.by_tid.items()
        }
        return max(counts, key=counts.get)


def analyze(path: str, top: int) -> None:
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    gpu = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") in GPU_CATS]
    host = HostOps(events)
    phases = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"][6:])
        for e in events
        if e.get("cat") == "user_annotation" and e["name"].startswith("phase:")
    )
    rows = []
    for t0, t1, name in phases:
        busy = merged([(max(a, t0), min(b, t1)) for a, b in gpu if b > t0 and a < t1])
        busy_us = sum(b - a for a, b in busy)
        edges = [t0] + [x for iv in busy for x in iv] + [t1]
        gaps = [(edges[i + 1] - edges[i], edges[i], edges[i + 1]) for i in range(0, len(edges), 2)]
        tid = host.main_tid(t0, t1)
        print(f"== {name}: wall {(t1 - t0) / 1e3:.1f} ms, GPU busy {busy_us / 1e3:.1f} ms, idle {(t1 - t0 - busy_us) / 1e3:.1f} ms "
              f"in {sum(g[0] > 20 for g in gaps)} gaps > 20 us")  # fmt: skip
        for length, a, b in sorted(gaps, reverse=True)[:top]:
            began = " < ".join(host.stack_at(a, tid)[:3])
            ended = " < ".join(host.stack_at(b, tid)[:3])
            print(f"  gap {length / 1e3:7.2f} ms at +{(a - t0) / 1e3:8.1f} ms  began in [{began}]  ended in [{ended}]")
        waits: dict[tuple[str, str], list[float]] = defaultdict(list)
        for e in events:
            if (
                e.get("cat") in ("cuda_runtime", "cuda_driver")
                and t0 <= e["ts"] <= t1
                and any(w in e["name"] for w in WAITS)
            ):
                stack = host.stack_at(e["ts"] + e.get("dur", 0) / 2, e["tid"])
                caller = next((s for s in stack if not s.startswith("cu")), "?")
                waits[(e["name"], caller)].append(e.get("dur", 0))
        for (call, caller), durs in sorted(waits.items(), key=lambda kv: -sum(kv[1]))[:top]:
            print(f"  host wait {sum(durs) / 1e3:7.2f} ms in {len(durs):4d} x {call} from {caller}")
        rows.append((name, (t1 - t0) / 1e3, busy_us / 1e3))
    print(f"{'phase':14s} {'wall ms':>9s} {'busy ms':>9s} {'idle ms':>9s}")
    for name, wall, busy in rows:
        print(f"{name:14s} {wall:9.1f} {busy:9.1f} {wall - busy:9.1f}")
    kernels_by_class(events, phases, top)
    ticks_by_kind(events, gpu, phases, path)


# a kernel's class by its name (lower-cased), first match wins: what a step's time is made of
KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "attention", "prefill", "sdpa")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "sm90_", "sm80_")),
    ("fused (inductor)", ("triton_",)),
    ("copy, index, cat", ("copy", "index", "gather", "scatter", "cat", "memcpy", "memset")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((cls for cls, keys in KERNEL_CLASSES if any(k in low for k in keys)), "other")


def kernels_by_class(events: list[dict], phases: list, top: int) -> None:
    """Per denoise phase, the GPU time of its kernels (and copies) by class, each class's largest kernels: how much
    of a step is the GEMMs and the attention (the floor's FLOPs) and how much the work between them."""
    for t0, t1, name in phases:
        if name.split()[-2:-1] != ["denoise"]:
            continue
        by: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for e in events:
            if e.get("cat") in GPU_CATS and t0 <= e["ts"] < t1:
                by[kernel_class(e["name"])][e["name"]] += e.get("dur", 0) / 1e3
        total = sum(sum(k.values()) for k in by.values()) or 1.0
        print(f"== {name}: kernels by class ({total:.1f} ms of kernel time)")
        for cls, kernels in sorted(by.items(), key=lambda kv: -sum(kv[1].values())):
            ms = sum(kernels.values())
            largest = ", ".join(f"{n[:60]} {t:.1f}" for n, t in sorted(kernels.items(), key=lambda kv: -kv[1])[:3])
            print(f"  {cls:18s} {ms:9.1f} ms {ms / total:6.1%}  largest: {largest}")


def ticks_by_kind(events: list[dict], gpu: list[tuple[float, float]], phases: list, path: str) -> None:
    """The engine's ticks by kind — a forward ran, every branch reused the cache (no forward: only small kernels),
    or a chunk was decoded inside it — with their GPU idle: which steps leave the GPU waiting on the host."""
    try:
        with open(path + ".ticks.json") as f:
            rows = json.load(f)["rows"]
    except FileNotFoundError:
        return
    decodes = [(a, b) for a, b, name in phases if name.split()[-2:-1] == ["decode"]]
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for e in events:
        if e.get("cat") != "user_annotation" or not e["name"].startswith("tick "):
            continue
        t0, t1 = e["ts"], e["ts"] + e["dur"]
        ran = rows[int(e["name"][5:])]
        kind = "with a decode" if any(a < t1 and b > t0 for a, b in decodes) else "reused" if ran == 0 else "forward"
        busy = sum(b - a for a, b in merged([(max(a, t0), min(b, t1)) for a, b in gpu if b > t0 and a < t1]))
        k = kinds[kind]
        k[0], k[1], k[2] = k[0] + 1, k[1] + (t1 - t0) / 1e3, k[2] + (t1 - t0 - busy) / 1e3
    print(f"{'ticks':14s} {'n':>4s} {'wall ms':>9s} {'idle ms':>9s} {'idle/tick':>9s}")
    for kind, (n, wall, idle) in sorted(kinds.items()):
        print(f"{kind:14s} {n:4d} {wall:9.1f} {idle:9.1f} {idle / n:9.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/bench_edge.yaml")
    ap.add_argument("--params", default="{}", help="JSON request parameters (default: the config's defaults)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=YAML", help="override a top-level config key")
    ap.add_argument("--trace", default="timeline.json")
    ap.add_argument("--analyze", default="", help="a trace written earlier: analyze it, run nothing")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--syncs", action="store_true", help="then the request once more, its host syncs by source line")
    ap.add_argument("--concurrency", type=int, default=1, help="requests submitted together (seeds apart)")
    args = ap.parse_args()
    trace = args.analyze or record(args)
    if trace:
        analyze(trace, args.top)


if __name__ == "__main__":
    main()
