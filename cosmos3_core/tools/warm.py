"""Build a deployment's kernels ahead of serving: `make warm [CONFIG=...]` = `python -m cosmos3_core.tools.warm`.

Loads the deployment in-process exactly as a server does (prefill, the denoise engine with its `warmup_requests`
through the real step, the decode stage with its compiled kernels), with the kernel caches of `caches.py` in use,
and prints what each part took. A server started afterwards with the same `$COSMOS3_CACHE` (or the `kernels/`
folder carried to another machine of the same GPU and software) finds FlashInfer's fa3 kernels and torch.compile's
graphs already built.
"""

from __future__ import annotations

import argparse
import time

from ..caches import use_kernel_caches


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="deployment YAML (default: the CLI's and server's default)")
    ap.add_argument("--checkpoint", default=None)
    args = ap.parse_args(argv)
    folders = use_kernel_caches()  # before anything imports flashinfer
    from ..deployment import DEFAULT_CONFIG, Deployment
    from ..generate import Generator

    d = Deployment.load(args.config or DEFAULT_CONFIG, checkpoint=args.checkpoint)
    t0 = time.perf_counter()
    ckpt = d.open_checkpoint()  # with its precision (fp8: quantized at load)
    t1 = time.perf_counter()
    Generator(d, ckpt)
    t2 = time.perf_counter()
    print(f"checkpoint {t1 - t0:.1f}s, load + compile + warmup {t2 - t1:.1f}s "
          f"({len(d.warmup_requests)} warmup shapes, compile {'on' if d.compile else 'off'}, {d.torch_device})")  # fmt: skip
    for var, folder in folders.items():
        print(f"  {var}={folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
