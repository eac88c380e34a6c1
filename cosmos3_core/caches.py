"""Where generated files persist between processes: one root, `$COSMOS3_CACHE` (default `~/.cache/cosmos3`).

  <root>/tiny-nano, random-<preset>   generated checkpoints (tools/checkpoints.py)
  <root>/kernels/inductor             torch.compile's FX-graph / AOT caches (TORCHINDUCTOR_CACHE_DIR)
  <root>/kernels/triton               Triton's compiled kernels (TRITON_CACHE_DIR)
  <root>/kernels/flashinfer           FlashInfer's JIT-built fa3 kernels (FLASHINFER_WORKSPACE_BASE)

`use_kernel_caches()` points the three compilers at these folders unless the environment already names a
folder for one of them. It only sets environment variables, so it must run before flashinfer is imported (it
reads its variable at import); the server calls it before starting tritonserver, whose Python stubs inherit the
environment, and the offline CLI and `make warm` call it first thing. A cache built by `make warm` (or carried to
a fresh machine) then spares a server the ~90 s fa3 JIT and the compile of the GEN layer stack.
"""

from __future__ import annotations

import os
from pathlib import Path

KERNEL_CACHE_VARS = {
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
}


def cache_root() -> Path:
    return Path(os.environ.get("COSMOS3_CACHE") or Path.home() / ".cache" / "cosmos3")


def use_kernel_caches(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Fill in the kernel-cache variables missing from `environ` (default: this process's) → the folders in use."""
    env = os.environ if environ is None else environ
    kernels = cache_root() / "kernels"
    for var, sub in KERNEL_CACHE_VARS.items():
        if not env.get(var):
            env[var] = str(kernels / sub)
    return {var: env[var] for var in KERNEL_CACHE_VARS}
