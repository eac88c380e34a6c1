"""Write a random LoRA adapter for a checkpoint, in the format diffusers' `transformer.save_lora_adapter` writes.

``python -m cosmos3_core.tools.make_lora --checkpoint DIR --out ADAPTER_DIR [--rank 8] [--alpha A]
[--targets gen,und | add_q_proj,mlp_moe_gen.down_proj,...] [--seed 0] [--std 0.05]`` (or :func:`make_lora`) writes
``ADAPTER_DIR/pytorch_lora_weights.safetensors``: per targeted linear ``<module>.lora_A.weight`` [r, in] and
``<module>.lora_B.weight`` [out, r] in fp32, and in the file's metadata ``lora_adapter_metadata``, the PEFT
``LoraConfig`` (``r``, ``lora_alpha``, ``target_modules``: the full module names) — what
``Cosmos3OmniTransformer.load_lora_adapter(ADAPTER_DIR, prefix=None)`` loads, and a server's ``lora_dir`` holds.

Targets: a tower (``gen``: the generation tower's attention and MLP linears, ``und``: the understanding tower's),
or the end of a module path (``add_q_proj``, ``mlp_moe_gen.down_proj``), in every layer. Weights: A ~ N(0, 1/in),
B ~ N(0, std² / r) — unlike PEFT's zero-initialised B, so that the adapter changes the output (tests, benchmarks).
Deterministic in (checkpoint config, arguments).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..lora_store import METADATA_KEY, WEIGHTS
from ..model.checkpoint import Checkpoint
from ..model.lora import adaptable_shapes


def make_lora(
    checkpoint: str | Path,
    out: str | Path,
    rank: int = 8,
    targets: tuple[str, ...] = ("gen",),
    alpha: float | None = None,
    seed: int = 0,
    std: float = 0.05,
) -> Path:
    """→ `out`, the adapter's folder. `alpha` None: lora_alpha = rank (scale 1)."""
    shapes = adaptable_shapes(Checkpoint.open(checkpoint).config)
    chosen = [
        m for m, (tower, _, _) in shapes.items() if any(t == tower or m == t or m.endswith("." + t) for t in targets)
    ]
    if not chosen:
        raise ValueError(f"targets {list(targets)} match no adaptable linear of {checkpoint}")
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for m in chosen:
        _, fan_in, fan_out = shapes[m]
        tensors[f"{m}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
        tensors[f"{m}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * (std / rank**0.5)
    config = {"r": rank, "lora_alpha": rank if alpha is None else alpha, "target_modules": chosen,
              "rank_pattern": {}, "alpha_pattern": {}, "use_rslora": False, "use_dora": False, "lora_bias": False,
              "lora_dropout": 0.0, "bias": "none"}  # fmt: skip
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / WEIGHTS, metadata={"format": "pt", METADATA_KEY: json.dumps(config, sort_keys=True)})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m cosmos3_core.tools.make_lora", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", required=True, help="the checkpoint folder (diffusers layout)")
    ap.add_argument("--out", required=True, help="the adapter's folder (a subfolder of a server's lora_dir)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, help="lora_alpha (default: the rank, i.e. scale 1)")
    ap.add_argument("--targets", default="gen", help="comma-separated: gen, und, or module path ends (add_q_proj)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.05, help="B's scale")
    args = ap.parse_args(argv)
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    path = make_lora(args.checkpoint, args.out, args.rank, targets, args.alpha, args.seed, args.std)
    print(f"wrote {path / WEIGHTS}")


if __name__ == "__main__":
    main()
