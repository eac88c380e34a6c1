"""``python -m cosmos3_core.tools.plan --config C [--checkpoint X] [--set KEY=YAML ...] [--gpu-memory GIB]``: the
deployment's GPU memory plan (cosmos3_core/memory.py) as a table, without a GPU. Exits 0 when it fits the card
(`--gpu-memory`, else this machine's GPU; with neither, it only sizes), 1 when it does not, saying what to change:
the same verdict and text the server refuses to load with. ``make plan CONFIG=... [GPU_MEMORY=80]``.

The checkpoint: `--checkpoint`, else the config's. A real one that is not on this machine (e.g. `/models/Cosmos3-Nano`
before the download) is planned at its preset's shapes (`random:nano`, `random:edge`: the same configs, no weights),
said on the first line.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from ..deployment import Deployment, parse_sets
from ..memory import GIB, card_bytes, plan
from ..model.checkpoint import Checkpoint
from ..model.provision import resolve_checkpoint
from ..model.random_checkpoint import PRESETS


def checkpoint_root(name: str) -> tuple[Path, str]:
    """The checkpoint to read configs from → (its directory, a note when a preset stands in for it)."""
    if name and not name.startswith("random:") and not Path(name).is_dir():
        preset = next((p for p in sorted(PRESETS) if p in Path(name).name.lower()), None)
        if preset is None:
            raise SystemExit(f"plan: checkpoint {name} not found, and its name says no preset ({', '.join(PRESETS)})")
        return resolve_checkpoint(
            f"random:{preset}"
        ), f"checkpoint {name} not here: planned at random:{preset}'s shapes"
    return resolve_checkpoint(name), ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print a deployment's GPU memory plan; exit 1 when it does not fit.")
    parser.add_argument("--config", required=True, help="deployment config (configs/*.yaml)")
    parser.add_argument(
        "--checkpoint", default=None, help="override the config's checkpoint (a path or random:<preset>)"
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=YAML",
                        help="override a top-level config key, e.g. precision=fp8, pool_pages=2048")  # fmt: skip
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                        help="the card's memory (default: this machine's GPU, if any)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        overrides = parse_sets(args.set)
    except ValueError as e:
        parser.error(str(e))
    d = Deployment.load(args.config, **{**overrides, **({"checkpoint": args.checkpoint} if args.checkpoint else {})})
    if d.device == "auto":  # the plan is of the GPU the config serves on, whatever this machine has
        d = replace(d, device="cuda")
    root, note = checkpoint_root(d.checkpoint)
    ckpt = Checkpoint.open(root, d.precision, d.fp8_policy)
    card = int(args.gpu_memory * GIB) if args.gpu_memory else card_bytes()
    p = plan(d, ckpt.root, ckpt.config, card)
    if note:
        print(note)
    print(p.table())
    print(p.verdict())
    return 0 if p.fits else 1


if __name__ == "__main__":
    sys.exit(main())
