"""Checkpoint provisioning: a deployment's `checkpoint` string → a checkpoint directory on disk, writing the
generated ones on first use, atomically:

- `""`: the tiny default (`tiny.make_tiny`, Nano-style, seed 0) with the sound tokenizer and the action heads, so
  the embedded default (`make serve`, the offline CLI) serves every mode. It lives in `caches.cache_root()/tiny-nano`
  (`$COSMOS3_TINY_CHECKPOINT` moves it) with a stamp, `TINY_STAMP`, naming its recipe's version: one written by an
  older version (no stamp, or another number) is rebuilt and replaced, not reused.
- `random:<preset>`: real shapes, random weights (`random_checkpoint.write_skeleton`), `<cache root>/random-<preset>`.
- anything else: a path, as is.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..caches import cache_root
from .random_checkpoint import write_skeleton
from .tiny import make_tiny

# Bump when the tiny default's recipe changes (its parts, what make_tiny draws): a cached one is then rebuilt.
# 1 (unstamped): video only. 2: with the sound tokenizer and the action heads.
TINY_DEFAULT_VERSION = 2
TINY_STAMP = "cosmos3_tiny_default.json"


def tiny_default_dir() -> Path:
    """Where the tiny default is (or will be) written."""
    return Path(os.environ.get("COSMOS3_TINY_CHECKPOINT") or cache_root() / "tiny-nano")


def make_tiny_default(out: Path) -> Path:
    """The tiny default's recipe (Nano-style, seed 0, with sound and the action heads), stamped with its version."""
    make_tiny(out, variant="nano", seed=0, sound=True, action=True)
    (out / TINY_STAMP).write_text(json.dumps({"version": TINY_DEFAULT_VERSION}) + "\n")
    return out


def is_current_tiny_default(path: Path) -> bool:
    """`path` holds the tiny default of this version (a stamp of another, or none: an older one)."""
    try:
        return json.loads((path / TINY_STAMP).read_text()).get("version") == TINY_DEFAULT_VERSION
    except (OSError, ValueError, AttributeError):
        return False


def resolve_checkpoint(path: str | Path) -> Path:
    """An explicit path as is; empty: the tiny default; `random:<preset>`: real shapes, random weights. Generated
    ones are written on first use, atomically (a concurrent writer's identical copy wins the race)."""
    if path and not str(path).startswith("random:"):
        return Path(path)
    if path:
        preset = str(path).split(":", 1)[1]
        target = cache_root() / f"random-{preset}"
        if not (target / "model_index.json").is_file():
            _write(target, lambda d: write_skeleton(d, preset), lambda d: (d / "model_index.json").is_file())
        return target
    target = tiny_default_dir()
    if not is_current_tiny_default(target):
        _write(target, make_tiny_default, is_current_tiny_default)
    return target


def _write(target: Path, make: Callable[[Path], Path], done: Callable[[Path], bool]) -> None:
    """Write `target` with `make` in a sibling temporary directory, then move it in (an older one at `target`
    is moved aside first and deleted)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        make(tmp / "new")
        if target.exists() and not done(target):
            target.rename(tmp / "old")
        (tmp / "new").rename(target)
    except OSError:  # another process won the race; theirs is identical
        if not done(target):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
