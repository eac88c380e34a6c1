"""diffusers' names, imported under one process-wide lock: `from_diffusers("AutoencoderKLWan")`.

diffusers' package imports lazily, and two threads importing it at once can see it half made ("cannot import name
'AutoencoderKLWan' from 'diffusers'", seen when the denoise stub's import of its sampler on a thread of its own met
the memory plan's count on the stub's main thread). Every import of diffusers that a served part makes goes through
here, so none runs beside another; the offline tools (random checkpoints, the tiny model, make_fp8) import it
plainly. tests/test_imports.py holds that.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

_LOCK = threading.Lock()


def from_diffusers(name: str, module: str = "diffusers") -> Any:
    """`module`'s attribute `name` (a class or function of diffusers), imported under the lock."""
    with _LOCK:
        return getattr(importlib.import_module(module), name)
