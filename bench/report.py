"""Benchmark rows for BENCHMARKS.md: `append_row(path, gpu, figures)` adds one line — date, GPU (None: this process's
CUDA device, or "CPU"), the command that produced it, each figure — to the "Runs appended by the benchmarks" table, the file's last section (made when
missing)."""

from __future__ import annotations

import datetime
import shlex
import sys
from pathlib import Path

SECTION = "## Runs appended by the benchmarks (`--md FILE`)"
HEADER = "| date | GPU | command | figures |\n|---|---|---|---|"


def append_row(path: str | Path, gpu: str | None, figures: dict[str, float | int | str]) -> str:
    if gpu is None:
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    command = "python -m " + " ".join(shlex.quote(a) for a in [_module(), *sys.argv[1:]])
    shown = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
    row = f"| {datetime.date.today().isoformat()} | {gpu} | `{command}` | {shown} |"
    path = Path(path)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if SECTION not in text:
        text = text.rstrip("\n") + f"\n\n{SECTION}\n\n{HEADER}\n"
    path.write_text(text.rstrip("\n") + "\n" + row + "\n")  # the section is the file's last: rows go at the end
    return row


def _module() -> str:
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    return spec.name if spec else Path(sys.argv[0]).stem


def skipped_fraction(
    cache_skipped: dict[str, list[int]] | list[dict[str, list[int]]] | None, steps: int, branches: int
) -> float:
    """The share of a request's branch-steps (steps × CFG branches, × windows for an AR stream, whose
    `cache_skipped` is a list: one per window) that reused a residual instead of running the block stack, from a
    `done` event's `cache_skipped` (None or absent: no cache, 0)."""
    windows = cache_skipped if isinstance(cache_skipped, list) else [cache_skipped or {}]
    return sum(len(v) for w in windows for v in w.values()) / (steps * branches * max(1, len(windows)))
