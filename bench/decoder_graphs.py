"""How many graphs the compiled decoder kernels make, and what the stage's compile warmup costs in a fresh process
(the cold start's critical path: BENCHMARKS.md, 17th-18th sessions). CPU or GPU:

    python -m bench.decoder_graphs [--checkpoint PATH] [--device cpu|cuda] [--dtype float32|bfloat16]

The warmup decode is `stages.warm_decoder`'s (1 + 4 + 1 latent frames at 5×7, 4 frames a call); then a second
stream of other sizes (1 + 3 + 2 frames at 4×6) must compile nothing more. Run it twice: the first run on an empty
inductor cache compiles, the second loads (what a server started after `make warm` pays). Default checkpoint: the
tiny Nano one (`make_tiny`, written to /tmp/cosmos3_tiny_vae once), whose decoder has Wan2.2's structure at small
widths: the graph count is the real VAE's.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch._dynamo.utils

from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.model.wan_decoder import DecoderKernels, WanDecoder
from cosmos3_core.tools.make_tiny import make_tiny


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", default="")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    path = Path(args.checkpoint or "/tmp/cosmos3_tiny_vae")
    if not args.checkpoint and not path.exists():
        make_tiny(path, variant="nano", seed=0)
    vae = Checkpoint.open(path).load_vae(args.device, getattr(torch, args.dtype))
    decoder = WanDecoder(vae, DecoderKernels.compiled(), frames_per_call=4)
    z = vae.config.z_dim

    def decode(pieces: list[int], h: int, w: int) -> None:
        stream = decoder.stream()
        for t in pieces:
            stream(torch.randn(1, z, t, h, w, device=args.device, dtype=getattr(torch, args.dtype)))
        if args.device == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    decode([6], 5, 7)  # the warmup's one call: the stream splits it into 1 + 4 + 1
    warm_s = time.perf_counter() - t0
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    decode([1, 3, 2], 4, 6)
    out = {"torch": torch.__version__, "device": args.device, "warmup_decode_s": round(warm_s, 2),
           "graphs": graphs, "graphs_after_other_sizes": torch._dynamo.utils.counters["stats"]["unique_graphs"]}  # fmt: skip
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
