"""Where generated files persist between processes: one root, `$COSMOS3_CACHE` (default `~/.cache/cosmos3`).

  <root>/tiny-nano, random-<preset>       generated checkpoints (model/provision.py)
  <root>/memo/<name>-<key hash>.json      facts that cost an import of diffusers' model classes to learn (a VAE
                                          config's parameter counts, the sound tokenizer's defaults): `memo_json`
  <root>/kernels/inductor                 torch.compile's FX-graph / AOT caches (TORCHINDUCTOR_CACHE_DIR)
  <root>/kernels/triton                   Triton's compiled kernels (TRITON_CACHE_DIR)
  <root>/kernels/precompiled              functions compiled ahead per input signature (precompiled.py: the
                                          decoder's kernels), loaded by a restart instead of traced again
  <root>/kernels/flashinfer               FlashInfer's JIT-built kernels (FLASHINFER_WORKSPACE_BASE)
  <root>/kernels/flashinfer/aot/sm<arch>  FlashInfer's modules built ahead for one GPU arch (sm90a: H100/H200),
                                          without a GPU (`tools/warm.py`): <uri>/<uri>.so, loaded as they are

`use_kernel_caches()` points the three compilers at these folders unless the environment already names a
folder for one of them. It only sets environment variables, so it must run before flashinfer is imported (it
reads its variable at import); every tritonserver launch gets them in its environment (`launcher.server_env`), which
its Python stubs inherit, and the offline CLI and `make warm` call it first thing. A cache built by `make warm` (or carried to
a fresh machine) then spares a server the ~90 s fa3 JIT and the compile of the GEN layer stack.

FlashInfer's JIT cache is only reused where the flashinfer package, Python and CUDA toolkit sit at the same paths
(its ninja files name them, and newer source mtimes rebuild), so kernels meant to travel (a Docker image, a folder
carried to another machine) go to `aot/` instead: `use_flashinfer_aot()` points FlashInfer's prebuilt-module
lookup there once flashinfer is imported, and a module found there is loaded directly. Only what flashinfer itself
builds goes there; torch.compile's inductor/triton caches need the GPU and stay with `make warm`.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

KERNEL_CACHE_VARS = {
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",
}


def cache_root(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    return Path(env.get("COSMOS3_CACHE") or Path.home() / ".cache" / "cosmos3")


def memo_json(name: str, key: str, compute: Callable[[], Any]) -> Any:
    """`compute()`'s JSON value, kept under the cache root per (`name`, `key`, the installed diffusers' version): a
    fact a part would otherwise import diffusers' model packages for (seconds of each part's start and reload).
    Written whole, then renamed; an unreadable or unwritable memo only means computing again."""
    try:
        version = metadata.version("diffusers")
    except metadata.PackageNotFoundError:
        version = "-"
    digest = hashlib.sha256(f"{key}\0{version}".encode()).hexdigest()[:16]
    try:
        path = cache_root() / "memo" / f"{name}-{digest}.json"
    except RuntimeError:  # no home folder to default to
        return compute()
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    value = compute()
    partial = path.with_suffix(f".{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(value))
        partial.replace(path)
    except OSError:
        partial.unlink(missing_ok=True)
    return value


def use_kernel_caches(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Fill in the kernel-cache variables missing from `environ` (default: this process's) → the folders in use."""
    env = os.environ if environ is None else environ
    kernels = cache_root(env) / "kernels"
    for var, sub in KERNEL_CACHE_VARS.items():
        if not env.get(var):
            env[var] = str(kernels / sub)
    return {var: env[var] for var in KERNEL_CACHE_VARS}


def precompiled_dir(environ: dict[str, str] | None = None) -> Path:
    """Where `precompiled.Precompiled` keeps its artifacts."""
    return cache_root(os.environ if environ is None else environ) / "kernels" / "precompiled"


def flashinfer_aot_dir(arch: str, environ: dict[str, str] | None = None) -> Path:
    """Where FlashInfer modules built ahead for GPUs of `arch` ("9.0a", "8.0", as in FLASHINFER_CUDA_ARCH_LIST)
    live: `aot/sm90a` etc. in FlashInfer's workspace folder."""
    env = os.environ if environ is None else environ
    base = env.get("FLASHINFER_WORKSPACE_BASE") or cache_root(env) / "kernels" / "flashinfer"
    return Path(base) / "aot" / ("sm" + arch.replace(".", ""))


def cuda_arch(major: int, minor: int) -> str:
    """A compute capability as FLASHINFER_CUDA_ARCH_LIST writes it, as flashinfer targets it: 9.0 → "9.0a"."""
    return f"{major}.{minor}{'a' if major >= 9 else ''}"


_FLASHINFER_OWN_AOT: list[Path] = []  # flashinfer's own prebuilt-module folder, before use_flashinfer_aot


def use_flashinfer_aot(arch: str | None) -> Path | None:
    """Point FlashInfer's prebuilt-module lookup (`jit.env.FLASHINFER_AOT_DIR`, where a module's `<uri>/<uri>.so`
    is loaded without building) at `flashinfer_aot_dir(arch)` when that folder exists and no flashinfer-jit-cache
    package is installed (that one has every module) → the folder in use, or None (`arch` None: flashinfer's own
    lookup again). A module not found there is JIT-built as before. Call after importing flashinfer, before its
    first kernel loads."""
    from flashinfer.jit import env as jit_env

    if not _FLASHINFER_OWN_AOT:
        _FLASHINFER_OWN_AOT.append(jit_env.FLASHINFER_AOT_DIR)
    folder = flashinfer_aot_dir(arch) if arch else None
    if folder is None or jit_env.has_flashinfer_jit_cache() or not folder.is_dir():
        jit_env.FLASHINFER_AOT_DIR = _FLASHINFER_OWN_AOT[0]
        return None
    jit_env.FLASHINFER_AOT_DIR = folder
    return folder
