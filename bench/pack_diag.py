"""The matrix's pack check in one process, without a server: where a packed request stops equalling its solo run.

  python -m bench.pack_diag --model nano --attention auto --warmup config [--precision fp8] [--buckets none]

The engine of `bench.matrix`'s deployment (its warmups: `config`, or `one` 2-step request of the checked size), the
prefill stage beside it in this process. Runs t2v (seed 1), i2v (2), t2v (3) alone, then the three submitted
together (packed in shared ticks), then a SeaCache t2v alone and in that pack, and prints for each its final latents
(finite? NaN count, abs max, std), the packed run's rel-L2 to its solo run, SeaCache's reused steps, and the step's
layouts (exact or bucket, captured or not); the first step output that is not finite is printed as it happens, with
its layout with `--watch` (`NanWatch`: a host sync per step, so first run without it). On the H200 at d1ed90b (as out/diag), SDPA with one warmup: packed = solo bit for
bit, SeaCache reused steps 1-2 (BENCHMARKS.md, 14th session); the served matrix (FlashInfer, every Nano config's
warmup) was not.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from cosmos3_core.engine import DenoiseEngine
from cosmos3_core.generate import _CollectSink
from cosmos3_core.requests import warmup_inputs
from cosmos3_core.stages import DecodeStage, PrefillStage

from .matrix import FRAMES, SEA, SEA_STEPS, STEPS, deployment_of
from .served import PROMPT, variant_request


def stats(x: torch.Tensor, decoder: DecodeStage | None = None) -> str:
    x = x.float()
    finite = x.nan_to_num()
    video = ""
    if decoder is not None:  # the served matrix judges videos: one value (0) is what NaN latents decode to
        frames = decoder.run(x, safety_check=False)
        video = f"; video {'BLACK (one value)' if frames.max() == frames.min() else 'ok'}"
    return (f"finite {bool(x.isfinite().all())} nan {int(x.isnan().sum())} absmax {finite.abs().max().item():.3g} "
            f"std {finite.std().item():.3g}{video}")  # fmt: skip


class NanWatch:
    """The engine's step, each output checked: the first non-finite velocity is printed with its layout's key and
    the pack's row sizes (then every later one too, briefly). Attributes are the step's."""

    def __init__(self, step) -> None:
        self.step, self.seen = step, 0

    def __getattr__(self, name: str):
        return getattr(self.step, name)

    def __call__(self, rows):
        outputs = self.step(rows)
        bad = [i for i, o in enumerate(outputs) if not all(bool(v.isfinite().all()) for v in o.velocity)]
        if bad:
            self.seen += 1
            key = next(reversed(self.step.layouts)) if self.step.layouts else None
            sizes = [(r.tokens.shape[0], len(r.branches), sum(x is None for x in r.reuse), r.a16) for r in rows]
            print(f"  non-finite velocity in rows {bad} of a pack {sizes}; layout {key if self.seen == 1 else key[0]}",
                  flush=True)  # fmt: skip
        return outputs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="nano")
    ap.add_argument("--precision", choices=["bf16", "fp8"], default="bf16")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--warmup", choices=["config", "one"], default="config")
    ap.add_argument("--buckets", choices=["derived", "none"], default="derived", help="none: graph_buckets []")
    ap.add_argument("--watch", action="store_true", help="NanWatch: a host sync per step (it may hide a race)")
    ap.add_argument("--decode", action="store_true", help="decode each result (the VAE stage) and say if it is black")
    args = ap.parse_args()
    t0 = time.perf_counter()
    d = dataclasses.replace(deployment_of(args.model, args.precision), attention=args.attention)
    size = (d.defaults.height, d.defaults.width)
    if args.warmup == "one":
        d = dataclasses.replace(d, warmup_requests=[{"num_frames": FRAMES, "steps": STEPS}])
    if args.buckets == "none":
        d = dataclasses.replace(d, graph_buckets=[])
    ckpt = d.open_checkpoint()
    prefill = PrefillStage.from_deployment(ckpt, d, d.torch_device)
    engine = DenoiseEngine.from_deployment(ckpt, d)
    decoder = DecodeStage.from_deployment(ckpt, d, d.torch_device) if args.decode else None
    engine.warmup([prefill.validate("warmup", r, *warmup_inputs(r, d.defaults)) for r in d.warmup_requests])
    step = engine.step
    if args.watch:
        engine.step = NanWatch(step)  # after the warmup (it asks for a DenoiseStep)
    print(f"ready in {time.perf_counter() - t0:.0f}s; buckets {step.buckets}, pad limit {step.pad_limit}", flush=True)

    def run(requests: list[tuple[str, int, dict]]) -> list[_CollectSink]:
        sinks = []
        for kind, seed, extra in requests:
            params, image, clip, raw = variant_request(kind, {"steps": STEPS, "num_frames": FRAMES, **extra}, *size)
            p = prefill.validate(PROMPT, {**params, "seed": seed}, image, clip, raw)
            sinks.append(_CollectSink(p.steps, False))
            engine.submit(prefill.run(p, image, clip, raw), sinks[-1])
        engine.run_until_idle()
        return sinks

    requests = [("t2v", 1, {}), ("i2v", 2, {}), ("t2v", 3, {})]
    solo = [run([r])[0] for r in requests]
    for (kind, seed, _), s in zip(requests, solo):
        print(f"solo   {kind} {seed}: {s.failure or stats(s.latents, decoder)}", flush=True)
    for (kind, seed, _), s, alone in zip(requests, run(requests), solo):
        rel = (s.latents.float() - alone.latents.float()).norm() / alone.latents.float().norm()
        print(
            f"packed {kind} {seed}: {s.failure or stats(s.latents, decoder)}; rel-L2 to solo {rel.item():.3g}",
            flush=True,
        )
    sea = ("t2v", 1, {"cache": SEA["cache"], "steps": SEA_STEPS})
    for name, group in (("sea solo  ", [sea]), ("sea packed", [sea, *requests[1:]])):
        s = run(group)[0]
        print(
            f"{name} t2v 1: {s.failure or stats(s.latents, decoder)}; reused {s.info.get('cache_skipped')}", flush=True
        )
    for key, layout in step.layouts.items():
        kind = "bucket" if key[0][0] == "bucket" else "exact"
        print(f"layout {kind} {layout.packed.tokens.shape[0]} rows, {layout.runs} runs, graph "
              f"{'yes' if layout.graph is not None else 'no'}{' (capture failed)' if layout.capture_failed else ''}")  # fmt: skip
    print(f"done in {time.perf_counter() - t0:.0f}s; {step.captures} captures")


if __name__ == "__main__":
    main()
