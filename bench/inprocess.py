"""In-process speed, side by side in one run: our engine vs diffusers' Cosmos3OmniPipeline on the same random
weights at the real shapes, and the compute floor.

  python -m bench.inprocess --preset edge --compile --variants sdpa flashinfer flashinfer+graphs

Each variant (attention backend, `+graphs` for CUDA-graph replay) runs the same requests on one loaded engine
(its step is swapped); then diffusers on the same weights. Prints a table and writes JSON to --json. Needs CUDA.
A request with `cache` (bench.served --params) runs diffusers with its own SeaCache on the same fields, and both
report the share of branch-steps that skipped the block stack.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from cosmos3_core.deployment import Deployment
from cosmos3_core.generate import Generator
from cosmos3_core.step import DenoiseStep

from .floor import card_flops, denoise_flops, tokens_for
from .report import skipped_fraction


class StackCalls:
    """Which of a diffusers transformer's calls ran its block stack: a forward pre-hook on the model opens a call,
    one on its first decoder layer marks it as run (SeaCache skips the whole stack). The pipeline calls cond, then
    uncond, at each step."""

    def __init__(self, transformer):
        self.ran: list[bool] = []
        self.handles = [
            transformer.register_forward_pre_hook(lambda m, a: self.ran.append(False)),
            transformer.layers[0].register_forward_pre_hook(lambda m, a: self.ran.__setitem__(-1, True)),
        ]

    def skipped(self, branches: int) -> dict[str, list[int]]:
        """Per branch the 0-based steps whose call skipped the stack, as our `done` event's `cache_skipped`."""
        names = ("cond", "uncond")
        return {
            name: [k // branches for k, ran in enumerate(self.ran) if k % branches == b and not ran]
            for b, name in enumerate(names[:branches])
        } | {name: [] for name in names[branches:]}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def sea_cache_config(params: dict):
    """diffusers' `SeaCacheConfig` with a request's `cache` fields (policy "sea"), or None without one."""
    from diffusers import SeaCacheConfig

    cache = params.get("cache")
    return None if cache is None else SeaCacheConfig(**{k: v for k, v in cache.items() if k != "policy"})


def sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def ours(args, params) -> dict:
    d = Deployment(
        checkpoint=f"random:{args.preset}", device="cuda", dtype="bfloat16", pool_pages=4096, compile=args.compile,
        precision=args.precision, fp8_policy=args.fp8_policy,
    )  # fmt: skip
    gen = Generator(d)
    out = {}
    for variant in args.variants:
        attention, *extra = variant.split("+")
        eng = gen.engine
        eng.step = DenoiseStep(eng.model, eng.pool, eng.step.kernels, attention, cuda_graphs="graphs" in extra,
                               fp8_attention=getattr(args, "fp8_attention", False))  # fmt: skip
        out[variant] = run_variant(gen, params, args.repeat)
    return out


def run_variant(gen: Generator, params: dict, repeat: int) -> dict:
    t0 = time.perf_counter()
    # warm-up: allocator, cuBLAS/flash heuristics, compile, capture; with a cache, all steps (its reuse layouts)
    gen.frames(PROMPT, params if "cache" in params else {**params, "steps": 3})
    if gen.engine.fp8_policy is not None:  # FP8: 3 steps are all W8A16; a 1-step request runs (compiles) W8A8
        gen.frames(PROMPT, {**params, "steps": 1})
    warmup_s = time.perf_counter() - t0
    phases = {"prefill": [], "denoise": [], "decode": [], "e2e": []}
    skipped = []
    for _ in range(repeat):
        marks = [sync_time()]
        pre = gen.prefill.run(gen.prefill.validate(PROMPT, params, None), None)
        marks.append(sync_time())
        result = gen.run(pre)
        marks.append(sync_time())
        skipped.append(skipped_fraction(result.info.get("cache_skipped"), pre.params.steps, pre.params.cfg_branches))
        gen.decode.run(result.latents)
        marks.append(sync_time())
        for name, a, b in (("prefill", 0, 1), ("denoise", 1, 2), ("decode", 2, 3), ("e2e", 0, 3)):
            phases[name].append(marks[b] - marks[a])
    captures = gen.engine.step.captures
    return {"phases": phases, "text_tokens": pre.text_k[0].shape[1], "warmup_s": warmup_s, "captures": captures,
            "skipped_fraction": statistics.mean(skipped)}  # fmt: skip


def reference(args, params) -> dict:
    from diffusers import Cosmos3OmniPipeline, Cosmos3OmniTransformer, UniPCMultistepScheduler

    from cosmos3_core.model.checkpoint import Checkpoint
    from cosmos3_core.model.config import read_json
    from cosmos3_core.model.provision import resolve_checkpoint

    root = resolve_checkpoint(f"random:{args.preset}")
    ckpt = Checkpoint.open(root)
    tcfg = {k: v for k, v in read_json(root / "transformer" / "config.json").items() if not k.startswith("_")}
    torch.manual_seed(0)
    with torch.device("cuda"):
        transformer = Cosmos3OmniTransformer(**tcfg).to(torch.bfloat16)
    transformer.time_embedder.float()
    vae = ckpt.load_vae("cuda", torch.bfloat16)
    sched = UniPCMultistepScheduler.from_config(ckpt.scheduler_config, flow_shift=params["shift"])
    pipe = Cosmos3OmniPipeline(transformer, ckpt.load_tokenizer(), vae, sched, enable_safety_checker=False,
                               use_native_flow_schedule=ckpt.use_native_flow_schedule)  # fmt: skip
    pipe.set_progress_bar_config(disable=True)

    def run(steps: int):
        return pipe(prompt=PROMPT, num_frames=params["num_frames"], height=params["height"], width=params["width"],
                    fps=24.0, num_inference_steps=steps, guidance_scale=params["guidance_scale"],
                    generator=torch.Generator().manual_seed(0), output_type="np", enable_safety_check=False)  # fmt: skip

    run(2)
    config = sea_cache_config(params)
    if config is not None:  # diffusers' own SeaCache, on the same fields as ours
        pipe.transformer.enable_cache(config)
    e2e, skipped = [], []
    for _ in range(args.repeat):
        calls = StackCalls(pipe.transformer)
        t0 = sync_time()
        run(params["steps"])
        e2e.append(sync_time() - t0)
        calls.remove()
        branches = 1 if params["guidance_scale"] == 1.0 else 2
        skipped.append(skipped_fraction(calls.skipped(branches), params["steps"], branches))
    return {"e2e": e2e, "skipped_fraction": statistics.mean(skipped)}


PROMPT = "A robot arm stacks red and blue cubes on a wooden table, soft daylight, static camera."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="edge")
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--frames", type=int, default=121)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--guidance", type=float, default=6.0)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--no-diffusers", action="store_true")
    ap.add_argument("--compile", action="store_true", help="torch.compile the GEN layer stack")
    ap.add_argument("--precision", choices=["checkpoint", "fp8"], default="checkpoint", help="a deployment's precision")
    ap.add_argument("--fp8-policy", type=json.loads, default={}, help="JSON: a deployment's fp8_policy")
    ap.add_argument("--fp8-attention", action="store_true", help="a deployment's fp8_attention (FA3 FP8, Hopper)")
    ap.add_argument("--variants", nargs="+", default=["sdpa", "flashinfer+graphs"], help="attention[+graphs] ...")
    ap.add_argument("--json", default="")
    ap.add_argument("--md", default="", help="append a row (date, GPU, command, figures) to this file")
    args = ap.parse_args()
    params = {"height": args.height, "width": args.width, "num_frames": args.frames, "steps": args.steps,
              "guidance_scale": args.guidance, "shift": 5.0, "seed": 0}  # fmt: skip
    torch.backends.cuda.matmul.allow_tf32 = True
    result = {"args": vars(args), "gpu": torch.cuda.get_device_name()}
    result["ours"] = ours(args, params)
    result["ours_peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    if not args.no_diffusers:
        result["diffusers"] = reference(args, params)
    result["diffusers_peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9

    from cosmos3_core.model.checkpoint import Checkpoint
    from cosmos3_core.model.provision import resolve_checkpoint

    cfg = Checkpoint.open(resolve_checkpoint(f"random:{args.preset}")).config
    tokens = tokens_for(cfg, args.height, args.width, args.frames)
    first = result["ours"][args.variants[0]]
    flops = denoise_flops(cfg, tokens, first["text_tokens"], args.steps, 2 if args.guidance != 1 else 1)
    result["floor_card"], flops_per_s = card_flops()
    result["floor_s"] = flops / flops_per_s
    result["tokens_per_branch"] = tokens
    diff = statistics.median(result["diffusers"]["e2e"]) if "diffusers" in result else float("nan")
    print(f"{args.preset} {args.width}x{args.height}x{args.frames} steps {args.steps} guidance {args.guidance} "
          f"tokens/branch {tokens} compile {args.compile} precision {args.precision} fp8_attention {args.fp8_attention} on {result['gpu']}; {result['floor_card']} compute floor {result['floor_s']:.2f} s, "
          f"diffusers e2e {diff:.2f} s, peak mem ours {result['ours_peak_mem_gb']:.1f} GB / diffusers "
          f"{result['diffusers_peak_mem_gb']:.1f} GB")  # fmt: skip
    print(
        f"{'variant':22s} {'e2e':>7s} {'prefill':>8s} {'denoise':>8s} {'decode':>7s} {'den/floor':>9s} {'diff/ours':>9s}"
    )
    for variant, r in result["ours"].items():
        med = {k: statistics.median(v) for k, v in r["phases"].items()}
        print(f"{variant:22s} {med['e2e']:7.2f} {med['prefill']:8.2f} {med['denoise']:8.2f} {med['decode']:7.2f} "
              f"{med['denoise'] / result['floor_s']:9.2f} {diff / med['e2e']:9.2f}")  # fmt: skip
    if args.md:
        from .report import append_row

        figures: dict = {
            "floor s": result["floor_s"],
            "diffusers e2e s": diff,
            "peak mem GB": result["ours_peak_mem_gb"],
        }
        for variant, r in result["ours"].items():
            med = {k: statistics.median(v) for k, v in r["phases"].items()}
            figures |= {f"{variant} e2e s": med["e2e"], f"{variant} denoise s": med["denoise"],
                        f"{variant} decode s": med["decode"], f"{variant} denoise/floor": med["denoise"] / result["floor_s"],
                        f"{variant} diffusers/ours": diff / med["e2e"]}  # fmt: skip
        print(append_row(args.md, result["gpu"], figures))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
