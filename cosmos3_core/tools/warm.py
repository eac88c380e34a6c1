"""Build a deployment's kernels ahead of serving: `make warm [CONFIG=...]` = `python -m cosmos3_core.tools.warm`.

Two parts, both into the kernel caches of `caches.py`:

- FlashInfer's modules (`--kernels-only`: only these; `make warm-kernels`). The modules the deployment's FlashInfer
  attention loads (`attention.flashinfer_module_specs`: the batch prefill module, fa3 on Hopper at head_dim
  64/128/256 else fa2, at the checkpoint's head_dim and the deployment's dtype; with `fp8_attention` on fa3 the
  FP8 (E4M3 q/kv) one instead) are compiled with nvcc for each GPU arch of `--cuda-arch`
  (default: $FLASHINFER_CUDA_ARCH_LIST, else this machine's GPUs) into `caches.flashinfer_aot_dir(arch)`, where a
  server's FlashInfer loads them without a JIT. No GPU or driver is needed, only the CUDA toolkit (nvcc, its
  headers and libcuda stub): docker/Dockerfile runs it at build time.
  Only the checkpoint's configs are read; at build time, when the deployment's checkpoint is not there yet, name
  one of the same architecture (`--checkpoint random:edge`: Edge's real shapes, configs only).
- The rest (a GPU): loads the deployment in-process exactly as a server does (prefill, the denoise engine with its
  `warmup_requests` through the real step, the decode stage with its compiled kernels) and prints what each part
  took: torch.compile's graphs (inductor and Triton caches; the decoder's kernels also compiled ahead,
  `caches.precompiled_dir()`) and anything FlashInfer still JIT-builds. These need
  the GPU they will run on; a server started afterwards with the same `$COSMOS3_CACHE` (or the `kernels/` folder
  carried to another machine of the same GPU and software) finds them built.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..attention import flashinfer_backend, flashinfer_module_specs
from ..caches import cuda_arch, flashinfer_aot_dir, use_kernel_caches
from ..deployment import DEFAULT_CONFIG, DTYPES, Deployment, parse_sets


def flashinfer_kernels(d: Deployment, head_dim: int, arch: str) -> list[tuple[str, torch.dtype, int, bool]]:
    """(backend, dtype, head_dim, fp8) of each FlashInfer prefill module set the deployment loads on a GPU of `arch`
    ("9.0a"), fp8 its `fp8_attention` (with fa3, the FP8 module instead of the 16-bit one); none when it never runs FlashInfer
    (attention sdpa, a CPU device, float32: FlashInfer's prefill is 16-bit only, `attention: auto` falls back to
    SDPA). `device: auto` and `dtype: auto` are taken as a GPU's (bfloat16)."""
    dtype = torch.bfloat16 if d.dtype == "auto" else DTYPES[d.dtype]
    if d.attention == "sdpa" or d.device.startswith("cpu") or dtype == torch.float32:
        return []
    return [(flashinfer_backend(int(arch.split(".")[0]), head_dim), dtype, head_dim, d.fp8_attention)]


def gpu_archs() -> list[str]:
    """The archs to build for: $FLASHINFER_CUDA_ARCH_LIST (space-separated, "9.0a 8.0"), else this machine's GPUs."""
    given = os.environ.get("FLASHINFER_CUDA_ARCH_LIST", "").split()
    if given:
        return given
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return sorted({cuda_arch(*torch.cuda.get_device_capability(i)) for i in range(n)})


def build_flashinfer(d: Deployment, head_dim: int, archs: list[str], verbose: bool = False) -> list[Path]:
    """Build the deployment's FlashInfer modules for each arch into `flashinfer_aot_dir(arch)` (those already there
    are kept) → the module files. Compiles in a scratch folder beside them, removed after."""
    from flashinfer.jit import env as jit_env

    saved = jit_env.FLASHINFER_JIT_DIR, jit_env.FLASHINFER_GEN_SRC_DIR, jit_env.FLASHINFER_AOT_DIR
    saved_archs = os.environ.get("FLASHINFER_CUDA_ARCH_LIST")
    try:
        return [p for arch in archs for p in _build_arch(d, head_dim, arch, verbose)]
    finally:  # as they were: a load in this process (make warm) JIT-builds what is missing into the cache
        jit_env.FLASHINFER_JIT_DIR, jit_env.FLASHINFER_GEN_SRC_DIR, jit_env.FLASHINFER_AOT_DIR = saved
        if saved_archs is None:
            os.environ.pop("FLASHINFER_CUDA_ARCH_LIST", None)
        else:
            os.environ["FLASHINFER_CUDA_ARCH_LIST"] = saved_archs


def _build_arch(d: Deployment, head_dim: int, arch: str, verbose: bool) -> list[Path]:
    from flashinfer.jit import build_jit_specs
    from flashinfer.jit import env as jit_env

    kernels = flashinfer_kernels(d, head_dim, arch)
    if not kernels:
        return []
    out = flashinfer_aot_dir(arch)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=out.parent))
    # flashinfer reads the arch list whenever it writes a module's nvcc flags; its folders are module globals
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = arch
    jit_env.FLASHINFER_JIT_DIR = scratch / "cached_ops"
    jit_env.FLASHINFER_GEN_SRC_DIR = scratch / "generated"
    jit_env.FLASHINFER_AOT_DIR = out
    try:
        specs = list({s.name: s for k in kernels for s in flashinfer_module_specs(*k)}.values())
        todo = [s for s in specs if not s.is_aot]
        t0 = time.perf_counter()
        build_jit_specs(todo, verbose=verbose, skip_prebuilt=False)
        for s in todo:
            s.aot_path.parent.mkdir(exist_ok=True)
            tmp = s.aot_path.with_suffix(".so.tmp")
            shutil.copy2(s.jit_library_path, tmp)
            tmp.replace(s.aot_path)  # whole or absent: a server never loads a half-copied module
        print(
            f"flashinfer {arch}: built {len(todo)} of {len(specs)} modules in {time.perf_counter() - t0:.0f}s → {out}"
        )
        return [s.aot_path for s in specs]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None, help="deployment YAML (default: the CLI's and server's default)")
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=YAML",
                    help="override a top-level config key, as the server takes it (warm what it will serve)")  # fmt: skip
    ap.add_argument("--kernels-only", action="store_true", help="only FlashInfer's modules: no GPU needed (nvcc)")
    ap.add_argument("--cuda-arch", default=None, help='GPU archs to build FlashInfer for, e.g. "9.0a" (H100/H200); '
                    "default $FLASHINFER_CUDA_ARCH_LIST, else this machine's GPUs")  # fmt: skip
    ap.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    args = ap.parse_args(argv)
    try:
        overrides = {**parse_sets(args.set), **({"checkpoint": args.checkpoint} if args.checkpoint else {})}
    except ValueError as e:
        ap.error(str(e))
    folders = use_kernel_caches()  # before anything imports flashinfer
    if args.cuda_arch:
        os.environ["FLASHINFER_CUDA_ARCH_LIST"] = args.cuda_arch  # flashinfer reads it at import too
    from ..generate import Generator

    d = Deployment.load(args.config or DEFAULT_CONFIG, **overrides)
    t0 = time.perf_counter()
    ckpt = d.open_checkpoint()  # with its precision (fp8: quantized at load); configs only, weights at load
    archs = gpu_archs()
    uses_flashinfer = any(flashinfer_kernels(d, ckpt.config.head_dim, a) for a in archs)
    if args.kernels_only and not archs:
        print("warm: no GPU here: name the GPU arch to build for (--cuda-arch 9.0a)", file=sys.stderr)
        return 2
    if uses_flashinfer and importlib.util.find_spec("flashinfer") is None:
        print("warm: flashinfer is not installed (pip install -e '.[gpu]'): its modules are not built",
              file=sys.stderr)  # fmt: skip
        if args.kernels_only or d.attention == "flashinfer":
            return 2
    elif uses_flashinfer and (args.kernels_only or d.torch_device.startswith("cuda")):
        try:
            build_flashinfer(d, ckpt.config.head_dim, archs, args.verbose)
        except Exception as e:  # a server would JIT or (attention: auto) fall back to SDPA, as the load below does
            if args.kernels_only or d.attention == "flashinfer":
                raise
            print(f"warm: flashinfer modules not built ahead: {str(e)[:300]}", file=sys.stderr)
    elif args.kernels_only:
        print(f"warm: {args.config or DEFAULT_CONFIG} does not run FlashInfer (attention {d.attention}, device "
              f"{d.device}, dtype {d.dtype}): nothing to build")  # fmt: skip
    if args.kernels_only:
        print(f"  FLASHINFER_WORKSPACE_BASE={folders['FLASHINFER_WORKSPACE_BASE']}")
        return 0
    t1 = time.perf_counter()
    Generator(d, ckpt)
    t2 = time.perf_counter()
    print(f"checkpoint + flashinfer modules {t1 - t0:.1f}s, load + compile + warmup {t2 - t1:.1f}s "
          f"({len(d.warmup_requests)} warmup shapes, compile {'on' if d.compile else 'off'}, {d.torch_device})")  # fmt: skip
    for var, folder in folders.items():
        print(f"  {var}={folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
