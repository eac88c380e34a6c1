"""diffusers' names, imported under one process-wide lock: `from_diffusers("AutoencoderKLWan")`.

diffusers' package imports lazily, and two threads importing it at once can see it half made ("cannot import name
'AutoencoderKLWan' from 'diffusers'", seen when the denoise stub's import of its sampler on a thread of its own met
the memory plan's count on the stub's main thread). Every import of diffusers that a served part starts goes through
here, so none runs beside another:
- a diffusers call that imports more of diffusers at its first use runs once under `diffusers_imports()` (a
  scheduler's `from_config` imports its compatible schedulers' modules);
- the offline writers (random checkpoints, the tiny model, make_fp8) import it plainly: a served part reaches random
  checkpoints and the tiny model only through `Deployment.open_checkpoint`, before it starts any thread of its own;
- never used at a module's top: a thread waiting here while it holds a module's import lock could wait forever.
tests/test_imports.py holds the lock's rule, with the writers left out, and the last.

Not covered: transformers, which diffusers' modules import, is as lazy. The prefill stub's encoder thread imports
diffusers (and so transformers) beside its tokenizer's load on a reload; a transformers import of its own would go
through here too if that ever met the same error.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Iterator
from typing import Any

_LOCK = threading.RLock()  # so that `from_diffusers` may be called inside `diffusers_imports()`


@contextlib.contextmanager
def diffusers_imports() -> Iterator[None]:
    """Held while diffusers imports more of itself lazily."""
    with _LOCK:
        yield


def from_diffusers(name: str, module: str = "diffusers") -> Any:
    """`module`'s attribute `name` (a class or function of diffusers), imported under the lock."""
    with diffusers_imports():
        return getattr(importlib.import_module(module), name)
