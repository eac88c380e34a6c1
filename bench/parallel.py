"""Several GPUs for one request, side by side in one run: the same request through the in-process pipeline
(`Generator`: prefill → engine → decode) with each split of `parallel`, against one GPU.

  python -m bench.parallel --config configs/bench_edge.yaml --splits none cfg2 ulysses2 vae2 cfg2+vae2 \
      --repeat 3 --json out/bench_parallel_edge.json --md out/bench_rows.md
  python -m bench.parallel --config configs/bench_nano_t2v.yaml --splits none cfg2 ulysses2 cfg2+vae2 --repeat 2

A split is `none` or `+`-joined `cfg2`, `ulysses2|4|8`, `vae2..8` (the deployment's `parallel` for that run; rank r
on cuda:r, so a 2-GPU host runs up to 2 ranks). Each split loads its own Generator (and group), warms up with a
3-step request, times `--repeat` requests (prefill, denoise, decode, e2e after a synchronize), and is closed
before the next. Prints medians and the speed-up over `none`; on the CPU (gloo) it checks the plumbing only.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from cosmos3_core.deployment import Deployment
from cosmos3_core.generate import Generator

PROMPT = "A robot arm stacks red and blue cubes on a wooden table, soft daylight, static camera."


def parse_split(name: str) -> dict[str, int]:
    if name == "none":
        return {}
    out = {}
    for part in name.split("+"):
        key = part.rstrip("0123456789")
        if key not in ("cfg", "ulysses", "vae") or key == part:
            raise SystemExit(f"--splits: {part!r} is not cfg2, ulysses<N> or vae<N>")
        out[key] = int(part[len(key) :])
    return out


def now(cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


def run_split(config: str, split: dict[str, int], params: dict, repeat: int) -> dict:
    d = Deployment.load(config, parallel=split or None)
    cuda = d.torch_device.startswith("cuda")
    t0 = time.perf_counter()
    gen = Generator(d)
    load_s = time.perf_counter() - t0
    try:
        gen.frames(PROMPT, {**params, "steps": 3})  # warm-up: compile, autotune, graphs, the workers' too
        phases: dict[str, list[float]] = {"prefill": [], "denoise": [], "decode": [], "e2e": []}
        for _ in range(repeat):
            marks = [now(cuda)]
            pre = gen.prefill.run(gen.prefill.validate(PROMPT, params, None), None)
            marks.append(now(cuda))
            lat = gen.latents_from(pre)
            marks.append(now(cuda))
            gen.decode.run(lat)
            marks.append(now(cuda))
            for name, a, b in (("prefill", 0, 1), ("denoise", 1, 2), ("decode", 2, 3), ("e2e", 0, 3)):
                phases[name].append(marks[b] - marks[a])
        return {"load_s": load_s, "phases": phases, "resolved": pre.params.steps}
    finally:
        gen.close()
        del gen
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/bench_edge.yaml")
    ap.add_argument("--splits", nargs="+", default=["none", "cfg2", "ulysses2", "vae2", "cfg2+vae2"])
    ap.add_argument("--params", default="{}", help="request parameters (JSON) over the config's defaults")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default="")
    ap.add_argument("--md", default="", help="append a row (date, GPU, command, figures) to this file")
    args = ap.parse_args()
    params = json.loads(args.params)
    splits = {name: parse_split(name) for name in args.splits}
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"args": vars(args), "gpu": gpu, "splits": {}}
    for name, split in splits.items():
        result["splits"][name] = run_split(args.config, split, params, args.repeat)
    base = result["splits"].get("none")
    print(f"{args.config} {params} on {gpu}, {args.repeat} runs per split (medians, s)")
    print(
        f"{'split':16s} {'e2e':>8s} {'prefill':>8s} {'denoise':>8s} {'decode':>8s} {'e2e x':>6s} {'den x':>6s} {'dec x':>6s}"
    )
    figures: dict = {}
    for name, r in result["splits"].items():
        med = {k: statistics.median(v) for k, v in r["phases"].items()}
        r["median"] = med
        up = {k: statistics.median(base["phases"][k]) / med[k] if base else float("nan") for k in med}
        r["speedup"] = up
        print(f"{name:16s} {med['e2e']:8.2f} {med['prefill']:8.2f} {med['denoise']:8.2f} {med['decode']:8.2f} "
              f"{up['e2e']:6.2f} {up['denoise']:6.2f} {up['decode']:6.2f}")  # fmt: skip
        figures |= {f"{name} e2e s": med["e2e"], f"{name} denoise s": med["denoise"], f"{name} decode s": med["decode"]}
        if base and name != "none":
            figures |= {f"{name} e2e speed-up": up["e2e"], f"{name} denoise speed-up": up["denoise"]}
    if args.md:
        from .report import append_row

        print(append_row(args.md, gpu, figures))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
