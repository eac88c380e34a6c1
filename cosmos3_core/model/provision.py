"""Checkpoint provisioning: a deployment's `checkpoint` string → a checkpoint directory on disk, writing the
generated ones on first use, atomically, under `caches.cache_root()`:

- `""`: the tiny default (`tiny.make_tiny`, Nano-style, seed 0) with the sound tokenizer and the action heads, so
  the embedded default (`make serve`, the offline CLI) serves every mode. Its directory is `tiny-nano-v<N>`
  (`TINY_DEFAULT_VERSION`): one cached by an older version of its recipe is not reused, a new one is written.
- `random:<preset>`: real shapes, random weights (`random_checkpoint.write_skeleton`), `random-<preset>`.
- anything else: a path, as is.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..caches import cache_root
from .random_checkpoint import write_skeleton
from .tiny import make_tiny

# Bump when the tiny default's recipe changes (its parts, make_tiny's drawing): the cache key of its directory.
# 1 (tiny-nano): video only. 2: with the sound tokenizer and the action heads.
TINY_DEFAULT_VERSION = 2


def tiny_default_dir(cache: Path | None = None) -> Path:
    """Where the tiny default is (or will be) cached."""
    return (cache_root() if cache is None else cache) / f"tiny-nano-v{TINY_DEFAULT_VERSION}"


def make_tiny_default(out: Path) -> Path:
    """The tiny default's recipe: Nano-style, seed 0, with sound and the action heads."""
    return make_tiny(out, variant="nano", seed=0, sound=True, action=True)


def resolve_checkpoint(path: str | Path) -> Path:
    """An explicit path as is; empty: the tiny default; `random:<preset>`: real shapes, random weights. Generated
    ones are written on first use, atomically (a concurrent writer's identical copy wins the race)."""
    if path and not str(path).startswith("random:"):
        return Path(path)
    make: Callable[[Path], Path]
    if path:
        preset = str(path).split(":", 1)[1]
        target, make = cache_root() / f"random-{preset}", lambda d: write_skeleton(d, preset)
    else:
        target, make = tiny_default_dir(), make_tiny_default
    if not (target / "model_index.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
        try:
            make(tmp / "ckpt")
            (tmp / "ckpt").rename(target)
        except OSError:  # another process won the race; theirs is identical
            if not (target / "model_index.json").is_file():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
