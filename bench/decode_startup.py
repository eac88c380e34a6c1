"""What the vae_decode stage's load spends, and what cuDNN's benchmark buys (GPU). The stage is the cold start's
critical path (BENCHMARKS.md, 10th session: ready at 64-73 s of a server's 79-86 s, with or without make warm's
caches). Each variant runs in a fresh process, as a server's stage does (cuDNN's benchmark results and
torch.compile's in-memory state do not carry over; the inductor / Triton caches on disk do: `$COSMOS3_CACHE`'s, as a
server's):

    python -m bench.decode_startup --config configs/bench_edge.yaml [--variants benchmark heuristics eager]

- heuristics: as served — cuDNN's heuristics, the decoder's kernels compiled
- benchmark: compiled, `torch.backends.cudnn.benchmark = True` (what the stage did until the 11th session)
- eager: heuristics, nothing compiled

The first variant on an empty cache also pays torch.compile's compile (the later ones load it from the cache).

Per variant, the stage's own load steps (`stages.DecodeStage`) timed one by one: the VAE (a `random:` checkpoint's
drawn on the device), the decoder's preparation, the compile warmup (the stage's 1 + 4 + 1-frame decode at 5×7
latents); then the first whole video at the deployment's default size (where cuDNN benchmarks the real shapes: a
server's first request pays it) and the mean of the next three (the steady decode).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

VARIANTS = ("heuristics", "benchmark", "eager")


def child(config: str, variant: str) -> dict[str, float]:
    """One variant in this process → seconds per part ("steady video": the mean of three). Sets this process's
    `torch.backends.cudnn.benchmark` (run it in a process of its own, as `main` does)."""
    from cosmos3_core.deployment import Deployment
    from cosmos3_core.model.conditioning import VaeCodec
    from cosmos3_core.stages import warm_decoder

    d = Deployment.load(config)
    ckpt = d.open_checkpoint()
    torch.backends.cudnn.benchmark = variant == "benchmark"
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a smoke run of the tool itself
    parts, t = {}, time.perf_counter()

    def lap(part: str) -> None:
        nonlocal t
        if device == "cuda":
            torch.cuda.synchronize()
        parts[part] = time.perf_counter() - t
        t = time.perf_counter()

    codec = VaeCodec(ckpt.load_vae(device, d.torch_dtype), d.compile and device == "cuda" and variant != "eager")
    lap("vae")
    _ = codec.decoder
    lap("decoder")
    cfg = ckpt.config
    if codec.compile:
        with torch.backends.cudnn.flags(enabled=True, benchmark=False):  # as the stage did before: not these shapes
            warm_decoder(codec, cfg.latent_channel)
        lap("compile warmup")
    frames = (d.defaults.num_frames - 1) // cfg.vae_scale_temporal + 1
    z = torch.randn(1, cfg.latent_channel, frames, *cfg.latent_hw(d.defaults.height, d.defaults.width))
    codec.decode(z)
    lap("first video")
    for _ in range(3):
        codec.decode(z)
    lap("3 videos")
    parts["steady video"] = parts.pop("3 videos") / 3
    return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/bench_edge.yaml")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.config, args.child)))
        return
    from cosmos3_core.caches import use_kernel_caches

    use_kernel_caches()  # the children compile into (and load from) the kernel caches a server uses
    results = {}
    for v in args.variants:
        t0 = time.perf_counter()
        run = subprocess.run([sys.executable, "-m", "bench.decode_startup", "--config", args.config, "--child", v],
                             capture_output=True, text=True)  # fmt: skip
        if run.returncode:
            print(f"{v}: failed\n{run.stderr[-2000:]}", flush=True)
            continue
        results[v] = {**json.loads(run.stdout.strip().splitlines()[-1]), "process": time.perf_counter() - t0}
        print(f"{v:10s} " + "  ".join(f"{k} {s:.2f}s" for k, s in results[v].items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
            json.dump({"config": args.config, "gpu": gpu, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
