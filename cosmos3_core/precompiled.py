"""Compiled functions kept on disk per input signature: a restarted process loads them instead of tracing them.

Contract: `Precompiled(fn, marks, store, traced)(*args)` returns `fn(*args)` computed by a compiled artifact of `fn`
for the arguments' signature (`signature`: each tensor's dtype, rank, static last axis and which of its other axes
are 0 or 1; each module's structure (`module_key`: its repr and its parameters' and buffers' names, dtypes and
shapes; the weights are the artifact's inputs, so one artifact serves every layer built alike); each other
argument's repr, so only plain values such as ints; the device; grad, inference and autocast modes). The artifact
is `torch.compile(fn, dynamic=False, fullgraph=True).aot_compile` over the first such arguments as the first of
`marks` that compiles marks them (axes left unmarked are static), saved under `store` (`caches.precompiled_dir()`)
keyed by that signature, the source of `fn`'s module, of `sources` (the modules `fn` calls into) and of this one,
and the system (Python, torch, CUDA toolkit, Triton, GPU), and loaded from there by every later process: no Dynamo
tracing, which otherwise costs every process each graph again even when Inductor's caches are warm. Artifacts of an
older source stay on disk unused.

`traced` is the plain `torch.compile` path. It answers, for good, when this torch cannot compile ahead (no
`aot_compile` or guard API, or every mark refused), for arguments whose artifact's guards refuse them (a guard
beyond the signature), and for a signature whose artifact failed its first run (a kernel that does not load here;
an error of the run itself raises again from there); each is said on stderr. Tensor arguments are passed as contiguous plain tensors: an
artifact's guards hold its example's strides and types.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import os
import platform
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import torch.fx.experimental._config


def signature(args: tuple) -> tuple:
    """What an artifact is specialised on (see the module docstring); its other axes are dynamic."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    parts: list[Any] = [
        str(device), torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled(device.type) and str(torch.get_autocast_dtype(device.type)),
    ]  # fmt: skip
    for a in args:
        if isinstance(a, torch.Tensor):
            last = a.shape[-1] if a.dim() else None
            parts.append((str(a.dtype), a.dim(), last, tuple(min(n, 2) for n in a.shape[:-1])))
        elif isinstance(a, torch.nn.Module):
            parts.append(module_key(a))
        else:
            parts.append(repr(a))
    return tuple(parts)


_MODULE_KEYS: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()


def module_key(m: torch.nn.Module) -> str:
    """A module argument's part of the signature: its structure (the repr names each submodule's class and sizes),
    each submodule's plain attributes (a norm's eps, an MLP's activation name: not all in the repr) and its tensors'
    names, dtypes and shapes, so a 16-bit layer and an FP8 one never share an artifact. Kept per module object:
    modules are built before they serve, and their weights' values are the artifact's inputs."""
    key = _MODULE_KEYS.get(m)
    if key is None:
        plain = [(n, sorted((k, v) for k, v in vars(s).items() if isinstance(v, (bool, int, float, str))))
                 for n, s in m.named_modules()]  # fmt: skip
        tensors = [(n, str(t.dtype), tuple(t.shape)) for n, t in (*m.named_parameters(), *m.named_buffers())]
        key = hashlib.sha256(repr((repr(m), plain, tensors)).encode()).hexdigest()[:20]
        _MODULE_KEYS[m] = key
    return key


@functools.cache
def system(device: str) -> tuple:
    """What an artifact was built for besides its signature: another Python, torch, toolkit, Triton or GPU loads none."""
    try:
        triton = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = None
    gpu = None
    if device.startswith("cuda"):
        gpu = (torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device), torch.version.cuda)
    return platform.python_version(), torch.__version__, triton, gpu


def aot_enabled() -> contextlib.AbstractContextManager:
    """Dynamo's switch for `torch.compile(...).aot_compile`, on for the compile it wraps: torch 2.13 has it on by
    default, 2.11 (the GPU image's) off, so the compiled function lacks `aot_compile` there. Absent: nothing to set."""
    if hasattr(torch._dynamo.config, "enable_aot_compile"):
        return torch._dynamo.config.patch(enable_aot_compile=True)
    return contextlib.nullcontext()


class Precompiled:
    """`fn` through artifacts compiled ahead, loaded per signature (see the module docstring)."""

    def __init__(
        self, fn: Callable, marks: Sequence[Callable[[list], list]], store: Path, traced: Callable,
        sources: Iterable[Path] = (),
    ):  # fmt: skip
        self.fn, self.marks, self.store, self.traced = fn, tuple(marks), store, traced
        files = (Path(inspect.getfile(fn)), *sorted(set(sources)), Path(__file__))
        self.source = hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()
        self.loaded: dict[tuple, Any] = {}
        self.unsupported = False
        self.refusal_said = False
        self.proven: set[tuple] = set()  # signatures whose artifact has run once
        self.dropped: set[tuple] = set()  # signatures whose artifact failed its first run: traced
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
        if key in self.dropped:
            return self.traced(*args)
        if not compiled.guard_check(*args):
            if not self.refusal_said:
                self.refusal_said = True
                print(f"cosmos3: {self.fn.__name__}: an artifact's guards refuse arguments of its signature; those "
                      "are traced", file=sys.stderr)  # fmt: skip
            return self.traced(*args)
        if key in self.proven:
            return compiled(*args)
        try:  # an artifact's first run: one that cannot run here (a kernel that does not load) is dropped
            out = compiled(*args)
        except Exception as e:  # noqa: BLE001 - a real error raises again from the traced path
            self.dropped.add(key)
            print(f"cosmos3: {self.fn.__name__}: an artifact failed its first run ({type(e).__name__}: "
                  f"{str(e)[:200]}); that signature is traced", file=sys.stderr)  # fmt: skip
            return self.traced(*args)
        self.proven.add(key)
        return out

    def path(self, key: tuple) -> Path:
        system_of = system(key[0])
        digest = hashlib.sha256(repr((self.fn.__qualname__, self.source, system_of, key)).encode()).hexdigest()
        return self.store / f"{self.fn.__name__}-{digest[:20]}.bin"

    def _load(self, key: tuple, args: tuple) -> Any:
        path = self.path(key)
        try:
            with open(path, "rb") as fh:
                compiled = torch.compiler.load_compiled_function(fh)
            compiled.disable_guard_check()  # checked by __call__ (guard_check), which falls back instead of raising
        except FileNotFoundError:
            return self._compile(key, args)
        except Exception as e:  # noqa: BLE001 - unreadable, or torch without the loader: compiled again (or traced)
            print(f"cosmos3: {path.name} did not load ({type(e).__name__}: {str(e)[:200]}); compiling it again",
                  file=sys.stderr)  # fmt: skip
            return self._compile(key, args)
        self.loaded[key] = compiled
        return compiled

    def _compile(self, key: tuple, args: tuple) -> Any:
        """Compile ahead for `args` under each of `marks` in turn, save, keep → the artifact; None: none compiled
        (`traced` from now on in this process)."""
        errors = []
        for mark in self.marks:
            try:
                # sizes equal by chance in the example (h == w) stay separate symbols, so no guard ties them
                with torch.fx.experimental._config.patch(use_duck_shape=False), aot_enabled():
                    front = torch.compile(self.fn, dynamic=False, fullgraph=True)
                    compiled = front.aot_compile((tuple(mark(list(args))), {}))
                compiled.disable_guard_check()
                break
            except Exception as e:  # noqa: BLE001 - no aot_compile or guard API in this torch, or it refuses fn
                errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        else:
            self.unsupported = True
            print(f"cosmos3: {self.fn.__name__} is traced in this process ({'; '.join(errors)})", file=sys.stderr)
            return None
        self.loaded[key] = compiled
        path = self.path(key)
        partial = path.with_suffix(f".{os.getpid()}-{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            compiled.save_compiled_function(str(partial))
            partial.replace(path)
        except Exception as e:  # noqa: BLE001 - unwritable, or not serialisable: compiled again by the next process
            partial.unlink(missing_ok=True)
            print(f"cosmos3: {path.name} not saved ({type(e).__name__}: {str(e)[:200]})", file=sys.stderr)
        return compiled
