"""``python -m cosmos3_core.tools.make_tiny --out DIR [--variant {nano,edge}] [--seed N] [--shard-size BYTES]
[--sound] [--action]``: write a tiny, random-weight Cosmos3 checkpoint (`cosmos3_core.model.tiny.make_tiny`, which
documents the layout) and print its directory. ``make serve``'s default is ``--sound --action``, seed 0
(`cosmos3_core.model.provision`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..model.tiny import VARIANTS, make_tiny

__all__ = ["main", "make_tiny"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny, random-weight Cosmos3 checkpoint (diffusers layout).")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="nano")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-size", type=int, default=None, help="max transformer shard size in bytes")
    parser.add_argument("--sound", action="store_true", help="add a sound tokenizer and the sound weights")
    parser.add_argument("--action", action="store_true", help="add the action weights")
    args = parser.parse_args(argv)
    path = make_tiny(
        args.out, variant=args.variant, seed=args.seed, shard_size=args.shard_size, sound=args.sound, action=args.action
    )
    print(path)


if __name__ == "__main__":
    main()
