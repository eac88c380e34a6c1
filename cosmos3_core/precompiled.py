"""Compiled functions kept on disk per input signature: a restarted process loads them instead of tracing them.

Contract: `Precompiled(fn, mark, store, traced)(*args)` returns `fn(*args)` computed by a compiled artifact of `fn`
for the arguments' signature (`signature`: each tensor's dtype, rank, static last axis and which of its other axes
are 1; each other argument's value; the device; grad and inference mode). The artifact is
`torch.compile(fn, dynamic=False, fullgraph=True).aot_compile` over the first such arguments as `mark` marks them
(the axes it leaves unmarked are static), saved under `store` (`caches.precompiled_dir()`) keyed by that signature,
`fn`'s module source, torch's version and the GPU, and loaded from there by every later process: no Dynamo
tracing, which otherwise costs every process each graph again even when Inductor's caches are warm (the
decoder's 17 graphs took 5.3 s of a reloaded vae_decode on the H100).

`traced` is the plain `torch.compile` path. It runs instead, for good, when this torch cannot compile ahead (no
`aot_compile`, or it refuses `fn`); an artifact whose guards refuse arguments of its signature is compiled again.
Tensor arguments are passed as contiguous plain tensors: the artifact's guards hold its example's strides and types.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx.experimental._config

GUARD_REFUSED = "GuardManager check failed"  # what a loaded artifact raises for arguments outside its guards


def signature(args: tuple) -> tuple:
    """What an artifact is specialised on (see the module docstring); its other axes are dynamic."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    parts: list[Any] = [str(device), torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    if device.type == "cuda":
        parts.append(_capability(str(device)))
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append((str(a.dtype), a.dim(), a.shape[-1], tuple(n == 1 for n in a.shape[:-1])))
        else:
            parts.append(repr(a))
    return tuple(parts)


@functools.cache
def _capability(device: str) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


class Precompiled:
    """`fn` through artifacts compiled ahead, loaded per signature (see the module docstring)."""

    def __init__(self, fn: Callable, mark: Callable[[list], list], store: Path, traced: Callable):
        self.fn, self.mark, self.store, self.traced = fn, mark, store, traced
        self.source = hashlib.sha256(Path(inspect.getfile(fn)).read_bytes()).hexdigest()
        self.loaded: dict[tuple, Callable] = {}
        self.unsupported = False
        self.lock = threading.Lock()

    def __call__(self, *args):
        if self.unsupported:
            return self.traced(*args)
        # as the example was compiled: contiguous, and plain tensors (the guards check a Parameter's type too)
        args = tuple(a.contiguous().view(a.shape) if isinstance(a, torch.Tensor) else a for a in args)
        key = signature(args)
        compiled = self.loaded.get(key)
        if compiled is None:
            with self.lock:
                compiled = self.loaded.get(key) or self._load(key, args)
        if compiled is None:
            return self.traced(*args)
        for again in (False, True):
            try:
                return compiled(*args)
            except RuntimeError as e:
                if GUARD_REFUSED not in str(e) or again:
                    raise
            with self.lock:  # a guard beyond the signature (a relation between sizes): compiled again, for these
                compiled = self._compile(key, args)
            if compiled is None:
                break
        return self.traced(*args)

    def path(self, key: tuple) -> Path:
        digest = hashlib.sha256(repr((self.fn.__qualname__, self.source, torch.__version__, key)).encode())
        return self.store / f"{self.fn.__name__}-{digest.hexdigest()[:20]}.bin"

    def _load(self, key: tuple, args: tuple) -> Callable | None:
        path = self.path(key)
        try:
            with open(path, "rb") as fh:
                compiled = torch.compiler.load_compiled_function(fh)
        except FileNotFoundError:
            return self._compile(key, args)
        except Exception as e:  # noqa: BLE001 - an artifact of another build, or torch without the loader
            print(f"cosmos3: {path.name} did not load ({type(e).__name__}: {str(e)[:200]}); compiling it again",
                  file=sys.stderr)  # fmt: skip
            return self._compile(key, args)
        self.loaded[key] = compiled
        return compiled

    def _compile(self, key: tuple, args: tuple) -> Callable | None:
        """Compile ahead for `args`, save, keep → the artifact; None: this torch cannot (`traced` from now on)."""
        try:
            # sizes equal by chance in the example (h == w) stay separate symbols, so no guard ties them
            with torch.fx.experimental._config.patch(use_duck_shape=False):
                front = torch.compile(self.fn, dynamic=False, fullgraph=True)
                compiled = front.aot_compile((tuple(self.mark(list(args))), {}))
        except Exception as e:  # noqa: BLE001 - no aot_compile in this torch, or it refuses fn
            self.unsupported = True
            print(f"cosmos3: {self.fn.__name__} is traced at every start here ({type(e).__name__}: "
                  f"{str(e).splitlines()[0][:200] if str(e) else ''})", file=sys.stderr)  # fmt: skip
            return None
        self.loaded[key] = compiled
        path = self.path(key)
        partial = path.with_suffix(f".{os.getpid()}-{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            compiled.save_compiled_function(str(partial))
            partial.replace(path)
        except Exception as e:  # noqa: BLE001 - unwritable, or not serialisable: it is compiled at each start
            partial.unlink(missing_ok=True)
            print(f"cosmos3: {path.name} not saved ({type(e).__name__}: {str(e)[:200]})", file=sys.stderr)
        return compiled
