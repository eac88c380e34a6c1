"""Real-shape numerics, kept as a harness: our served path and diffusers' pipeline in low precision, each against
diffusers in fp32 on the same weights. Rerun after every numeric change.

  python -m bench.parity --preset edge|nano [--cases GLOB ...] [--compile] [--json F] [--md BENCHMARKS.md]
  python -m bench.parity --preset tiny                # the whole harness on CPU (fp32 against fp32)
  python -m bench.parity --preset edge --precision fp8 [--fp8-policy '{"first_steps": 3}'] --bar 100
                                                      # ours in FP8 (quantized at load), beside diffusers' bf16
  python -m bench.parity --report F.json --md BENCHMARKS.md   # render a saved run

The checkpoint is a real diffusers one with LLM-like random weights at the preset's shapes
(`random_checkpoint.write_skeleton(..., weights=True)`, stored in bf16, so every run holds the same weights). A
case is task (t2v, i2v) × frames (9, 33; tiny: 5, 9) × steps (4, 8) × schedule (`native`: Edge's linspaced
sigmas, `flow`: Nano's shifted flow sigmas; `use_native_flow_schedule` is overridden per case), at 832×480,
guidance 6, shift 5, seed 0; noise is drawn on the CPU, so every run starts from the same latents. The runs go one
after another, each freed before the next: diffusers fp32 (TF32 off) → diffusers in `--dtype` → ours
(`Generator`: prefill → engine → decode, the path the server's stages run; a fresh one per attention backend and
schedule, CUDA graphs on). Per case and run: rel-L2 of the final latents against fp32 diffusers', its ratio to
diffusers' own low-precision distance, and the PSNR of the decoded uint8 frames against fp32 diffusers' frames. A
case passes when each of ours is within `--bar` (1.05) × diffusers' distance, or below FLOOR (both fp32).
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import gc
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

PROMPT = "A robot arm stacks red and blue cubes on a wooden table, soft daylight, static camera."
BAR = 1.05
FLOOR = 1e-4  # fp32 against fp32 agrees to this (tests/test_oracle.py); below it no ratio means anything
SIZES = {"tiny": (32, 64), "edge": (480, 832), "nano": (480, 832)}
HEADING = "## Real-shape parity: ours and diffusers in bf16 against diffusers in fp32 — `python -m bench.parity`"


@dataclass(frozen=True)
class Case:
    task: str  # t2v | i2v
    frames: int
    steps: int
    schedule: str  # native | flow

    @property
    def name(self) -> str:
        return f"{self.task}-{self.frames}f-{self.steps}s-{self.schedule}"


def cases_for(preset: str) -> list[Case]:
    frames = (5, 9) if preset == "tiny" else (9, 33)  # the tiny VAE is most of a CPU run's time
    return [Case(t, f, s, sch) for sch in ("native", "flow") for t in ("t2v", "i2v") for f in frames for s in (4, 8)]


def select(preset: str, patterns: list[str] | None) -> list[Case]:
    cases = cases_for(preset)
    chosen = [c for c in cases if not patterns or any(fnmatch.fnmatch(c.name, p) for p in patterns)]
    if not chosen:
        raise SystemExit(f"no case matches {patterns}; cases: {', '.join(c.name for c in cases)}")
    return chosen


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """uint8 frames against uint8 frames, dB over all pixels (inf when equal)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def passes(ours: float, reference: float, bar: float = BAR, floor: float = FLOOR) -> bool:
    return ours <= max(bar * reference, floor)


def cond_image(height: int, width: int) -> np.ndarray:
    """A smooth, structured RGB image at the output size (no resize), the i2v condition of every case."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float64)
    r = 127.5 + 127.5 * np.sin(xx / width * 6.0 + yy / height * 2.0)
    g = 255.0 * yy / max(height - 1, 1)
    b = 127.5 + 127.5 * np.cos(np.hypot(xx - width / 2, yy - height / 2) / 12.0)
    return np.clip(np.stack([r, g, b], axis=-1), 0, 255).astype(np.uint8)


def checkpoint(preset: str, seed: int, device: str) -> Path:
    """The preset's checkpoint with LLM-like random weights, written once under $COSMOS3_CACHE."""
    from cosmos3_core.tools.make_tiny import make_tiny
    from cosmos3_core.tools.random_checkpoint import write_skeleton, write_weights

    cache = Path(os.environ.get("COSMOS3_CACHE", Path.home() / ".cache" / "cosmos3"))
    target = cache / f"parity-{preset}-s{seed}"
    if (target / "model_index.json").is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".tmp-parity-"))
    try:
        if preset == "tiny":
            write_weights(make_tiny(tmp / "ckpt", variant="edge", seed=seed), seed, device)
        else:
            write_skeleton(tmp / "ckpt", preset, weights=True, seed=seed, device=device)
        (tmp / "ckpt").rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def params_of(case: Case, preset: str, seed: int) -> dict[str, Any]:
    h, w = SIZES[preset]
    return {"height": h, "width": w, "num_frames": case.frames, "fps": 24.0, "steps": case.steps,
            "guidance_scale": 6.0, "shift": 5.0, "seed": seed}  # fmt: skip


# ---- diffusers ----
def load_diffusers(root: Path, device: str, dtype: torch.dtype):
    from diffusers import Cosmos3OmniPipeline

    device_map = device if device.startswith("cuda") else None
    pipe = Cosmos3OmniPipeline.from_pretrained(root, dtype=dtype, device_map=device_map)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_diffusers(pipe, case: Case, p: dict, image: np.ndarray | None) -> tuple[torch.Tensor, np.ndarray]:
    from diffusers import UniPCMultistepScheduler

    pipe.register_to_config(use_native_flow_schedule=case.schedule == "native")
    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=p["shift"])
    latents = pipe(prompt=PROMPT, image=image, num_frames=p["num_frames"], height=p["height"], width=p["width"],
                   fps=p["fps"], num_inference_steps=p["steps"], guidance_scale=p["guidance_scale"],
                   generator=torch.Generator().manual_seed(p["seed"]), output_type="latent",
                   enable_safety_check=False).video  # fmt: skip
    with torch.inference_mode():  # the pipeline's own decode, as `output_type="np"` runs it
        vae, shape = pipe.vae, (1, -1, 1, 1, 1)
        mean = pipe._vae_latents_mean.to(device=latents.device, dtype=vae.dtype).view(shape)
        inv_std = pipe._vae_latents_inv_std.to(device=latents.device, dtype=vae.dtype).view(shape)
        decoded = vae.decode(latents.to(vae.dtype) / inv_std + mean).sample.to(latents.dtype)
        video = pipe.video_processor.postprocess_video(decoded, output_type="np")[0]
    return latents.float().cpu(), np.round(video * 255).astype(np.uint8)


# ---- ours ----
def with_schedule(root: Path, schedule: str) -> Path:
    """The checkpoint as is, or a copy (its components linked) whose model_index.json has the other schedule."""
    index = json.loads((root / "model_index.json").read_text())
    native = schedule == "native"
    if bool(index.get("use_native_flow_schedule", False)) == native:
        return root
    other = root.with_name(f"{root.name}-{schedule}")
    other.mkdir(exist_ok=True)
    for sub in root.iterdir():
        if sub.is_dir() and not (other / sub.name).exists():
            (other / sub.name).symlink_to(sub.resolve())
    (other / "model_index.json").write_text(json.dumps({**index, "use_native_flow_schedule": native}, indent=1))
    return other


def load_ours(
    root: Path, device: str, dtype: torch.dtype, compile: bool, attention: str, precision: str = "checkpoint",
    fp8_policy: dict | None = None,
):  # fmt: skip
    """`Generator` (prefill → engine → decode, what the server's three stages run) with the served settings;
    `precision`/`fp8_policy` as a deployment's (fp8: layer linears quantized at load, model/fp8.py)."""
    from cosmos3_core.deployment import Deployment
    from cosmos3_core.generate import Generator

    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    d = Deployment(checkpoint=str(root), device=device, dtype=name, pool_pages=512, compile=compile,
                   attention=attention, cuda_graphs=True, precision=precision,
                   fp8_policy=fp8_policy or {})  # fmt: skip
    return Generator(d)


def run_ours(gen, p: dict, image: np.ndarray | None) -> tuple[torch.Tensor, np.ndarray, str]:
    latents = gen.latents(PROMPT, p, image)
    frames = gen.decode.run(latents)
    try:  # the backend this request's last step ran (an SDPA fallback shows)
        backend = next(reversed(gen.engine.step.layouts))[1]
    except (AttributeError, StopIteration, TypeError):
        backend = "?"
    return latents.float().cpu(), frames, backend


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means the backend is not there
        return False
    return True


def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.device.startswith("cuda")
    lowp = {"auto": torch.bfloat16 if cuda else torch.float32, "bfloat16": torch.bfloat16,
            "float32": torch.float32}[args.dtype]  # fmt: skip
    variants = args.variants or (["sdpa", "flashinfer"] if cuda else ["sdpa"])
    skipped = [v for v in variants if v == "flashinfer" and not (cuda and flashinfer_available())]
    variants = [v for v in variants if v not in skipped]
    torch.backends.cuda.matmul.allow_tf32 = False  # the oracle is fp32 (cuDNN's convs default to TF32)
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    cases = select(args.preset, args.cases)
    h, w = SIZES[args.preset]
    image = cond_image(h, w)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    root = checkpoint(args.preset, args.seed, args.device)
    timings["checkpoint_s"] = time.perf_counter() - t0
    print(f"checkpoint {root} ({timings['checkpoint_s']:.0f} s)", flush=True)

    ref: dict[str, tuple[torch.Tensor, np.ndarray]] = {}
    rows: dict[str, dict[str, Any]] = {c.name: {"case": asdict(c), "runs": {}} for c in cases}

    def record(case: Case, run_name: str, latents: torch.Tensor, frames: np.ndarray, **extra: Any) -> None:
        r_lat, r_frames = ref[case.name]
        d = {"rel_l2": rel_l2(latents, r_lat), "psnr_db": psnr(frames, r_frames), **extra}
        rows[case.name]["runs"][run_name] = d
        print(f"  {case.name:22s} {run_name:12s} rel-L2 {d['rel_l2']:.3e}  PSNR {d['psnr_db']:.2f} dB", flush=True)

    for phase, dtype in (("diffusers_fp32", torch.float32), ("diffusers", lowp)):
        t0 = time.perf_counter()
        pipe = load_diffusers(root, args.device, dtype)
        for c in cases:
            p = params_of(c, args.preset, args.seed)
            lat, frames = run_diffusers(pipe, c, p, image if c.task == "i2v" else None)
            if phase == "diffusers_fp32":
                ref[c.name] = (lat, frames)
                print(f"  {c.name:22s} fp32 reference |latents| {lat.norm():.1f}", flush=True)
            else:
                record(c, phase, lat, frames)
        del pipe
        free()
        timings[f"{phase}_s"] = time.perf_counter() - t0
        print(f"{phase}: {timings[f'{phase}_s']:.0f} s", flush=True)

    for variant in variants:  # a fresh Generator per backend and schedule, each freed before the next
        t0 = time.perf_counter()
        for schedule in dict.fromkeys(c.schedule for c in cases):
            gen = load_ours(with_schedule(root, schedule), args.device, lowp, args.compile, variant, args.precision,
                            json.loads(args.fp8_policy))  # fmt: skip
            for c in (c for c in cases if c.schedule == schedule):
                p = params_of(c, args.preset, args.seed)
                lat, frames, backend = run_ours(gen, p, image if c.task == "i2v" else None)
                record(c, variant, lat, frames, backend=backend)
            del gen
            free()
        timings[f"ours_{variant}_s"] = time.perf_counter() - t0
        print(f"ours {variant}: {timings[f'ours_{variant}_s']:.0f} s", flush=True)

    for row in rows.values():
        runs = row["runs"]
        d = runs["diffusers"]["rel_l2"]
        for v in variants:
            runs[v]["ratio"] = runs[v]["rel_l2"] / d if d > 0 else math.nan
        row["pass"] = all(passes(runs[v]["rel_l2"], d, args.bar) for v in variants)
    gpu = torch.cuda.get_device_name() if cuda else "CPU"
    return {"preset": args.preset, "gpu": gpu, "date": datetime.date.today().isoformat(),
            "command": "python -m bench.parity " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "dtype": str(lowp).removeprefix("torch."), "compile": args.compile, "bar": args.bar, "seed": args.seed,
            "precision": args.precision, "fp8_policy": json.loads(args.fp8_policy),
            "size": [h, w], "variants": variants, "skipped": skipped, "timings": timings, "cases": rows}  # fmt: skip


# ---- report ----
LABELS = {"sdpa": "SDPA + graphs", "flashinfer": "FlashInfer + graphs"}


def table(result: dict[str, Any]) -> str:
    variants = result["variants"]
    head = ["case", f"diffusers {result['dtype']}"]
    for v in variants:
        head += [f"ours {LABELS.get(v, v)}", "ratio"]
    head += ["PSNR dB: " + " / ".join(["diffusers", *variants]), f"≤ {result['bar']}×"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in result["cases"].items():
        runs = row["runs"]
        cells = [name, f"{100 * runs['diffusers']['rel_l2']:.3f} %"]
        for v in variants:
            cells += [f"{100 * runs[v]['rel_l2']:.3f} %", f"{runs[v]['ratio']:.3f}"]
        cells.append(" / ".join(f"{runs[k]['psnr_db']:.1f}" for k in ["diffusers", *variants]))
        cells.append("pass" if row["pass"] else "**FAIL**")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(result: dict[str, Any]) -> str:
    rows = result["cases"].values()
    ratios = [r["runs"][v]["ratio"] for r in rows for v in result["variants"]]
    ok = sum(r["pass"] for r in rows)
    worst = max((x for x in ratios if not math.isnan(x)), default=math.nan)
    t = ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in result["timings"].items())
    fp8 = f", ours FP8 {result.get('fp8_policy') or 'policy 3+3'}" if result.get("precision") == "fp8" else ""
    return (f"{result['preset']} at {result['size'][1]}×{result['size'][0]}, {result['dtype']}{fp8}, compile "
            f"{'on' if result['compile'] else 'off'}, on {result['gpu']}, {result['date']}: {ok}/{len(rows)} cases "
            f"pass, worst ratio {worst:.3f}" + (f"; not run: {', '.join(result['skipped'])}" if result["skipped"] else "")
            + f". Wall: {t}.")  # fmt: skip


def append_md(path: str | Path, result: dict[str, Any]) -> None:
    """The run's table at the end of the parity section (made when missing, before the appended-rows section)."""
    from .report import SECTION

    block = f"### {result['preset']} — `{result['command']}`\n\n{summary(result)}\n\n{table(result)}\n"
    path = Path(path)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if HEADING not in text:
        at = text.find(SECTION)
        at = len(text) if at < 0 else at
        text = text[:at].rstrip("\n") + f"\n\n{HEADING}\n\n" + text[at:]
    start = text.index(HEADING) + len(HEADING)
    end = text.find("\n## ", start)
    end = len(text) if end < 0 else end + 1
    text = text[:end].rstrip("\n") + "\n\n" + block + ("\n" + text[end:] if end < len(text) else "")
    path.write_text(text)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m bench.parity", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--cases", nargs="+", help="glob(s) over case names, e.g. 't2v-*-native'")
    ap.add_argument("--variants", nargs="+", choices=["sdpa", "flashinfer"], help="default: both on CUDA, sdpa on CPU")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto", help="auto: bf16 on CUDA")
    ap.add_argument("--compile", action="store_true", help="as the served configs do (GEN stack, decoder kernels)")
    ap.add_argument(
        "--precision",
        choices=["checkpoint", "fp8"],
        default="checkpoint",
        help="fp8: ours with the layer linears quantized at load (a deployment's precision: fp8)",
    )
    ap.add_argument("--fp8-policy", default="{}", help="JSON: a deployment's fp8_policy (first_steps, last_steps, ...)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bar", type=float, default=BAR)
    ap.add_argument("--json", default="")
    ap.add_argument("--md", default="", help="add the table to this BENCHMARKS.md")
    ap.add_argument("--report", default="", help="render a saved --json run instead of running")
    args = ap.parse_args(argv)
    result = json.loads(Path(args.report).read_text()) if args.report else run(args)
    print(summary(result))
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.md:
        append_md(args.md, result)
    return result


if __name__ == "__main__":
    main()
