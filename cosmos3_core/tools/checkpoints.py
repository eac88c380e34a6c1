"""Checkpoint provisioning: a deployment's `checkpoint` string → a checkpoint directory on disk, writing the
generated ones (the tiny checkpoint, `random:<preset>` real-shape skeletons) on first use."""

from __future__ import annotations

from pathlib import Path


def resolve_checkpoint(path: str | Path) -> Path:
    """An explicit path as is; empty: the tiny checkpoint; `random:<preset>`: real shapes, random weights
    (see tools/random_checkpoint.py). Generated ones are written on first use, atomically."""
    import os
    import shutil
    import tempfile

    from ..caches import cache_root
    from .make_tiny import make_tiny
    from .random_checkpoint import write_skeleton

    cache = cache_root()
    if path and not str(path).startswith("random:"):
        return Path(path)
    if path:
        preset = str(path).split(":", 1)[1]
        target, make = cache / f"random-{preset}", lambda d: write_skeleton(d, preset)
    else:
        target = Path(os.environ.get("COSMOS3_TINY_CHECKPOINT", cache / "tiny-nano"))
        make = lambda d: make_tiny(d, variant="nano", seed=0)  # noqa: E731
    if not (target / "model_index.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
        make(tmp / "ckpt")
        try:
            (tmp / "ckpt").rename(target)
        except OSError:  # another process won the race; theirs is identical
            pass
        shutil.rmtree(tmp, ignore_errors=True)
    return target
