"""What NVIDIA's Cosmos guardrail (`safety_checker: cosmos`) costs per request on the GPU: `CosmosSafetyChecker()`
from cosmos_guardrail, on random weights at the real sizes (Qwen3Guard-Gen-0.6B's Qwen3 shape; RetinaFace's
ResNet-50), written by cosmos3_core/tools/guardrail_snapshot.py. Needs a torchvision that imports.

  python -m bench.guardrail_cost [--frames 121 --height 480 --width 832] [--json OUT.json]

Text: the blocklist alone, and the whole text guardrail (blocklist + Qwen3Guard's `generate`, 128 new tokens: the
random weights never emit EOS, so this is the upper bound; a real verdict is ~10 tokens, reported as an estimate
from the per-token time). Video: `check_video_safety` on a whole video and on one 16-frame piece (RetinaFace runs
frame by frame, batch 1, as the package does; the random net's detections get pixelated like real ones).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

PROMPT = (
    "A robotic arm in a bright warehouse picks up a red cube from a conveyor belt and places it on a wooden pallet, "
    "while a second arm stacks blue boxes in the background; soft daylight, slow camera pan from left to right."
)
VERDICT_TOKENS = 10  # "Safety: Safe\nCategories: None" and the end token


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.guardrail_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=121)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if "HF_HUB_CACHE" not in os.environ:  # the hub reads its cache folder at import: re-run with it set
        cache = Path(tempfile.mkdtemp(prefix="guardrail-"))
        from cosmos3_core.tools.guardrail_snapshot import write_guardrail_cache

        t = time.perf_counter()
        write_guardrail_cache(cache, qwen="real")
        print(f"snapshot written in {time.perf_counter() - t:.1f}s: {cache}", file=sys.stderr)
        env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
        os.execve(sys.executable, [sys.executable, "-m", "bench.guardrail_cost", *(argv or sys.argv[1:])], env)

    from cosmos3_core.safety import TEXT, VIDEO, Guardrail

    t = time.perf_counter()
    text = Guardrail.load("cosmos", "cuda", TEXT)
    video = Guardrail.load("cosmos", "cuda", VIDEO)
    load_s = time.perf_counter() - t
    blocklist, guard = text.checker.text_guardrail.safety_models
    face = video.checker.video_guardrail.postprocessors[0]
    rng = np.random.default_rng(0)
    whole = rng.integers(0, 256, (args.frames, args.height, args.width, 3), dtype=np.uint8)
    piece = whole[:16].copy()
    text.check_prompt(PROMPT)  # warm: kernels, the generate loop
    video.check_frames(piece.copy())
    results = {
        "gpu": torch.cuda.get_device_name(),
        "load_s (both stages' checkers)": load_s,
        "qwen3guard_params": sum(p.numel() for p in guard.model.parameters()),
        "qwen3guard_dtype": str(next(guard.model.parameters()).dtype),
        "retinaface_params": sum(p.numel() for p in face.net.parameters()),
        "blocklist_s": statistics.median(timed(lambda: blocklist.is_safe(PROMPT), args.reps)),
        "text_guardrail_128_tokens_s": statistics.median(timed(lambda: text.check_prompt(PROMPT), args.reps)),
        "video_piece_16_all_faces_s": statistics.median(timed(lambda: video.check_frames(piece.copy()), args.reps)),
        f"video_whole_{args.frames}_all_faces_s": statistics.median(
            timed(lambda: video.check_frames(whole.copy()), args.reps)
        ),
        "frame_size": [args.height, args.width],
        "gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    with torch.no_grad():  # the snapshot's class heads answer "face" everywhere; now "no face": detection alone
        for head in face.net.ClassHead:
            head.conv1x1.bias.copy_(torch.tensor([4.0, 0.0]).repeat(head.num_anchors))
    results["video_piece_16_no_faces_s"] = statistics.median(timed(lambda: video.check_frames(piece.copy()), args.reps))
    results[f"video_whole_{args.frames}_no_faces_s"] = statistics.median(
        timed(lambda: video.check_frames(whole.copy()), args.reps)
    )
    per_token = (results["text_guardrail_128_tokens_s"] - results["blocklist_s"]) / 128
    results[f"text_guardrail_estimate_{VERDICT_TOKENS}_tokens_s"] = results["blocklist_s"] + per_token * VERDICT_TOKENS
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
