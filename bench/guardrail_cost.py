"""What NVIDIA's Cosmos guardrail (`safety_checker: cosmos`) costs per request on the GPU: `CosmosSafetyChecker()`
from cosmos_guardrail, on random weights at the real sizes (Qwen3Guard-Gen-0.6B's Qwen3 shape; RetinaFace's
ResNet-50), written by cosmos3_core/tools/guardrail_snapshot.py. Needs a torchvision that imports.

  python -m bench.guardrail_cost [--frames 121 --height 480 --width 832] [--edge-c1-s 4.0] [--json OUT.json]
  (on the H200, one call: bash bench/device_guardrail.sh)

Text: the blocklist alone; the package's whole text guardrail (blocklist + Qwen3Guard's `generate`) and the server's
(`safety.CosmosText`: Qwen3Guard's generation stopped once the label is out), both measured on a verdict of a real
one's shape: the snapshot's Qwen3Guard answers 10 tokens, the end token included, with the label out at token 3
(`guardrail_snapshot --verdict-tokens 9 --label-at 3`; the forwards each ran are counted and checked).

Video, per whole video and per 16-frame piece: the package's own `check_video_safety` (RetinaFace one frame a
forward, everything else per frame or per video on the host) against the decode stage's `safety.CosmosVideoBatched`
(the same objects; `FACE_BATCH` frames copied, preprocessed and run through RetinaFace in one forward replayed as a
CUDA graph, a shorter batch padded to it; the whole video also at each of `--batches` frames a forward). Detection
only (no face found: the common case) and every prior a face (the pixelation's worst case, a 16-frame piece). Then
the two compared with heads whose faces depend on the pixels and sit near the threshold
(`guardrail_snapshot.set_face_heads(content)`): the frames equal, the nets' largest confidence difference (batched
kernels: TF32 sums other than the package's one-frame ones on a GPU; equal frames on the CPU), and whether a frame's
scores depend on how many real frames share its padded batch. On CUDA, ours is also timed while the default stream
holds other work (the next piece's decode, in the server): on its own high-priority stream it need not wait.
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
VERDICT_TOKENS = 10  # "Safety: Safe\nCategories: None" and the end token: the package's forwards
LABEL_TOKENS = 3  # "Safety", ":", " Safe": where a real verdict's label is out (safety.CosmosText stops there)
PIECE = 16  # frames of a streamed piece (Edge's are 13-16)


def sync() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def timed(fn, reps: int) -> float:
    """The median of `reps` timed calls of `fn`, after one untimed (warm) call."""
    fn()
    out = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def video_of(frames: int, height: int, width: int) -> np.ndarray:
    """uint8 [T, H, W, 3]: smooth moving colour fields over a fixed noise (heads that read pixels see structure)."""
    axes = (np.arange(n, dtype=np.float32) for n in (frames, height, width))
    t, y, x = np.meshgrid(*axes, indexing="ij", sparse=True)
    rgb = [np.sin((x + 3 * t) / (17 + 9 * c)) + np.cos((y - 2 * t) / (23 + 5 * c)) for c in range(3)]
    noise = np.random.default_rng(0).standard_normal((height, width), dtype=np.float32) * 12 + 128
    return np.stack([np.clip(c * 60 + noise, 0, 255).astype(np.uint8) for c in rgb], axis=-1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.guardrail_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--frames", type=int, default=121)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--batches",
        type=int,
        nargs="+",
        default=[8, 16, 32],
        help="ours: frames a RetinaFace forward (each its own CUDA graph; the server runs FACE_BATCH)",
    )
    ap.add_argument("--edge-c1-s", type=float, default=4.0, help="Edge c=1 e2e, s (BENCHMARKS.md): the 5 %% target")
    ap.add_argument("--device", default="cuda", help="cpu: a check of this script at tiny shapes (--qwen tiny)")
    ap.add_argument("--qwen", choices=("real", "tiny"), default="real", help="Qwen3Guard's size in the snapshot")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if "HF_HUB_CACHE" not in os.environ:  # the hub reads its cache folder at import: re-run with it set
        cache = Path(tempfile.mkdtemp(prefix="guardrail-"))
        from cosmos3_core.tools.guardrail_snapshot import write_guardrail_cache

        t = time.perf_counter()
        # Qwen3Guard's answer: VERDICT_TOKENS - 1 tokens then the end token, the label the LABEL_TOKENS-th
        write_guardrail_cache(cache, qwen=args.qwen, verdict_tokens=VERDICT_TOKENS - 1, label_at=LABEL_TOKENS)
        print(f"snapshot written in {time.perf_counter() - t:.1f}s: {cache}", file=sys.stderr)
        env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(cache / "home")}
        os.execve(sys.executable, [sys.executable, "-m", "bench.guardrail_cost", *(argv or sys.argv[1:])], env)

    from cosmos3_core.safety import FACE_BATCH, TEXT, VIDEO, Guardrail, _on
    from cosmos3_core.tools.guardrail_snapshot import set_face_heads

    t = time.perf_counter()
    text = Guardrail.load("cosmos", args.device, TEXT)
    video = Guardrail.load("cosmos", args.device, VIDEO)
    load_s = time.perf_counter() - t
    blocklist, guard = text.checker.package.text_guardrail.safety_models  # safety.CosmosText wraps the package
    batched = video.checker  # safety.CosmosVideoBatched, what the decode stage calls
    package = batched.package  # the package's own CosmosSafetyChecker: RetinaFace one frame a forward
    face = package.video_guardrail.postprocessors[0]
    whole = video_of(args.frames, args.height, args.width)
    piece = whole[:PIECE]
    r: dict = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "torch": torch.__version__,
        "frames": [args.frames, args.height, args.width],
        "load_s (both stages' checkers)": load_s,
        "qwen3guard_params": sum(p.numel() for p in guard.model.parameters()),
        "qwen3guard_dtype": str(next(guard.model.parameters()).dtype),
        "retinaface_params": sum(p.numel() for p in face.net.parameters()),
        "package_retinaface_batch_size": face.batch_size,
    }

    def ours(frames: np.ndarray, batch: int = FACE_BATCH) -> np.ndarray:
        batched.batch = batch
        return video.check_frames(frames.copy())

    def theirs(frames: np.ndarray) -> np.ndarray:
        return package.check_video_safety(frames.copy())

    # text
    r["blocklist_s"] = timed(lambda: blocklist.is_safe(PROMPT), args.reps)
    # the package's call generates the whole verdict, ours (`safety.CosmosText`, the server's) stops at the label;
    # Qwen3Guard's forwards are counted, so a cache of another shape (HF_HUB_CACHE set by hand) is not mislabelled
    forwards: list[int] = []
    guard.model.register_forward_hook(lambda *_: forwards.append(1))
    texts = {
        "package": lambda: text.checker.package.check_text_safety(PROMPT),
        "ours": lambda: text.check_prompt(PROMPT),
    }
    for who, fn in texts.items():
        forwards.clear()
        fn()
        r[f"text_guardrail_{who}_forwards"] = len(forwards)
    if (r["text_guardrail_package_forwards"], r["text_guardrail_ours_forwards"]) != (VERDICT_TOKENS, LABEL_TOKENS):
        raise RuntimeError(f"Qwen3Guard ran {r['text_guardrail_package_forwards']} forwards (the package) and "
                           f"{r['text_guardrail_ours_forwards']} (ours), not {VERDICT_TOKENS} and {LABEL_TOKENS}: "
                           "a snapshot of another verdict (unset HF_HUB_CACHE to write one)")  # fmt: skip
    r[f"text_guardrail_{VERDICT_TOKENS}_tokens_s"] = timed(texts["package"], args.reps)
    r[f"text_guardrail_ours_label_at_{LABEL_TOKENS}_s"] = timed(texts["ours"], args.reps)
    r["text_guardrail_per_token_s"] = (
        r[f"text_guardrail_{VERDICT_TOKENS}_tokens_s"] - r[f"text_guardrail_ours_label_at_{LABEL_TOKENS}_s"]
    ) / (VERDICT_TOKENS - LABEL_TOKENS)

    # video, every prior a face (the snapshot's heads): the pixelation's worst case, one piece, once each.
    # ours: the server's (FACE_BATCH frames a forward, graphed on CUDA)
    n, batches = args.frames, sorted({*args.batches, FACE_BATCH})
    r[f"all_faces_piece_{PIECE}_package_s"] = timed(lambda: theirs(piece), 1)
    r[f"all_faces_piece_{PIECE}_ours_s"] = timed(lambda: ours(piece), 1)

    # video, detection only (no face): the common case
    set_face_heads(face.net, "none")
    r[f"piece_{PIECE}_package_s"] = timed(lambda: theirs(piece), args.reps)
    r[f"piece_{PIECE}_ours_s"] = timed(lambda: ours(piece), args.reps)
    r[f"whole_{n}_package_s"] = timed(lambda: theirs(whole), max(1, args.reps - 1))
    for batch in batches:
        r[f"whole_{n}_ours_batch_{batch}_s"] = timed(lambda b=batch: ours(whole, b), args.reps)
    best = min(batches, key=lambda b: r[f"whole_{n}_ours_batch_{b}_s"])
    r["ours_graphed"] = any(g is not None for g in batched._graphs.values())
    if args.device.startswith("cuda"):
        r["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        # behind other work on the default stream (the next piece's decode in the server)
        a = torch.randn(8192, 8192, device=args.device)
        sync()
        t = time.perf_counter()
        for _ in range(40):
            a = a @ a / 8192**0.5
        sync()
        r["default_stream_work_s"] = time.perf_counter() - t
        for _ in range(40):
            a = a @ a / 8192**0.5
        t = time.perf_counter()
        ours(whole)
        r[f"whole_{n}_ours_behind_that_work_s"] = time.perf_counter() - t
        sync()
        del a

    # the same frames out, with heads whose faces depend on the pixels (and sit near the 0.7 threshold)
    set_face_heads(face.net, "content")
    sample = whole[:: max(1, n // 8)][:8]  # many boxes a frame pass 0.7: the package's NMS is slow
    expected = theirs(sample)
    r["content_heads_frames_compared"] = len(sample)
    r["content_heads_pixels_pixelated"] = int((expected != sample).any(-1).sum())
    got = ours(sample)  # the server's: these frames padded to FACE_BATCH, one forward
    r["content_heads_frames_equal_ours"] = int(sum(np.array_equal(e, g) for e, g in zip(expected, got)))
    batched.batch = FACE_BATCH
    # the net's raw scores: the package's eager batch 1 against ours (the server's forward: its graph, on its stream)
    with torch.no_grad(), _on(batched._streams.get(next(face.net.parameters()).device)):
        x = face.preprocess_frames(sample)  # the package's own preprocessing
        one = torch.cat([face.net(x[i : i + 1])[1] for i in range(len(x))])
        mine = batched._scores(face, x)[1]
        fewer = batched._scores(face, x[:3])[1]  # the same frames with fewer real rows beside them: more padding
        r["content_heads_max_abs_conf_diff_package_vs_ours"] = float((one - mine).abs().max())
        cut = face.confidence_threshold  # priors that one of the two puts above it and the other not
        r["content_heads_priors_across_threshold_package_vs_ours"] = int(
            ((one[..., 1] > cut) != (mine[..., 1] > cut)).sum()
        )
        r["content_heads_ours_rows_independent_of_padding"] = bool(torch.equal(mine[:3], fewer))

    whole_s = r[f"whole_{n}_ours_batch_{FACE_BATCH}_s"]  # what the server runs
    r["whole_ours_fastest_batch"] = best
    r["summary"] = (
        f"video check per {n}-frame {args.height}x{args.width} video, detection only: package "
        f"{r[f'whole_{n}_package_s']:.3f} s, ours ({FACE_BATCH} frames a forward) {whole_s:.3f} s = "
        f"{100 * whole_s / args.edge_c1_s:.1f} % of Edge c=1 ({args.edge_c1_s} s); text "
        f"{r[f'text_guardrail_ours_label_at_{LABEL_TOKENS}_s']:.3f} s (ours, stopped at the label, token "
        f"{LABEL_TOKENS}), the package {r[f'text_guardrail_{VERDICT_TOKENS}_tokens_s']:.3f} s ({VERDICT_TOKENS}-token verdict)"
    )
    print(json.dumps(r, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
