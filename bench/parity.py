"""Real-shape numerics, kept as a harness: our served path and diffusers' pipeline in low precision, each against
diffusers in fp32 on the same weights. Rerun after every numeric change.

  python -m bench.parity --preset edge|nano [--cases GLOB ...] [--compile] [--json F] [--md out/parity.md]
  python -m bench.parity --preset tiny                # the whole harness on CPU (fp32 against fp32)
  python -m bench.parity --preset nano --cases '*+sound-9f-4s-flow' 'v2v-*-9f-4s-flow'   # sound and v2v
  python -m bench.parity --preset nano --cases 'policy-480-*' 'fd-480-*' 'id-256-*'      # robot actions
  python -m bench.parity --preset edge --precision fp8 [--fp8-policy '{"first_steps": 3}'] --bar 100
                                                      # ours in FP8 (quantized at load), beside diffusers' bf16
  python -m bench.parity --preset edge --precision fp8 --fp8-reference diffusers --cases 't2v-*'
                                                      # ours and diffusers' own FP8 on the same FP8 checkpoint
  python -m bench.parity --preset edge --cases 't2v-*' --cache '{"policy": "sea"}'   # SeaCache on both sides
  python -m bench.parity --preset nano --cases 'policy-480-*' 'id-256-*' --seeds 4     # actions over 4 noise seeds
  python -m bench.parity --report F.json --md out/parity.md   # render a saved run

The checkpoint is a real diffusers one with LLM-like random weights at the preset's shapes
(`random_checkpoint.write_skeleton(..., weights=True)`, stored in bf16, so every run holds the same weights). A
case is task (t2v, i2v) × frames (9, 33; tiny: 5, 9) × steps (4, 8) × schedule (`native`: Edge's linspaced
sigmas, `flow`: Nano's shifted flow sigmas; `use_native_flow_schedule` is overridden per case), at 832×480,
guidance 6, shift 5, noise seed 0 (`--seed`; `--seeds N`: N of them, below); noise is drawn on the CPU, so every
run starts from the same latents. The runs go one after another, each freed before the next: diffusers fp32 (TF32
off) → diffusers in `--dtype` → ours (`Generator`: prefill → engine → decode, the path the server's stages run; a
fresh one per attention backend and schedule, CUDA graphs on). The fp32 references are kept under the checkpoint
(`reference_path`): a later run on the same machine that needs the same ones skips the fp32 phase. Per case and run: rel-L2 of the final latents
against fp32 diffusers', its ratio to diffusers' own low-precision distance, and the PSNR of the decoded uint8
frames against fp32 diffusers' frames. A case passes when each of ours is within `--bar` (1.05) × diffusers'
distance, or below FLOOR (both fp32).

v2v and sound (`--cases` globs pick them; without `--cases` the run is the 16 t2v/i2v cases above): tasks
`v2v-first` / `v2v-last` (a 12-frame synthetic clip at the output size, `condition_frame_indexes` [0, 1], that end
of the clip kept) and `t2v+sound`, `i2v+sound`, `v2v+sound` (first) for presets with sound (nano, tiny). The
checkpoint then also carries a sound tokenizer and the transformer's sound heads, added in place to the same
checkpoint (`random_checkpoint.add_sound`; the other weights stay as they were, ~1 GB more for Nano). A sound case
is also judged on the waveform (`out.sound`, clamped stereo [2, S], decoded by each side's own tokenizer run):
its rel-L2 against fp32 diffusers' waveform, with the same ratio rule; the sound latents' rel-L2 is recorded too.

Robot actions (`--cases` globs; presets with action heads: nano, tiny): `policy-<tier>-<chunk>c-4s-flow`,
`fd-<tier>-...` (forward dynamics) and `id-<tier>-...` (inverse dynamics) at tiers 256 and 480, chunks 8 and 16,
guidance 6, Nano's flow schedule; through `Cosmos3OmniPipeline(action=CosmosActionCondition(...))` and through our
`Generator` with `parameters.action`. Policy and forward dynamics are conditioned on the condition image at the
output size (Nano's 832×480: tier 480's canvas exactly; tier 256 downscales it to 320×185 in a 320×192 canvas),
inverse dynamics on the clip of chunk + 1 frames; domains `droid_lerobot` (policy), `bridge_orig_lerobot`
(forward dynamics, seeded raw actions [chunk, 10]) and `av` (inverse dynamics, width 9). The checkpoint gains the
transformer's action heads in place (`random_checkpoint.add_action`: `action_dim` 64, 32 domains; tiny: 16, 32). A
case is judged on the final vision latents and, for policy and inverse dynamics, on the actions (`out.action[0]`,
[chunk, raw width]): their rel-L2 against fp32 diffusers', with the same ratio rule.

SeaCache (`--cache JSON`, a request's `parameters.cache`, e.g. '{"policy": "sea", "threshold": 0.4}'): our runs
carry it in their requests, diffusers' low-precision run the same config as
`pipe.transformer.enable_cache(SeaCacheConfig(**fields))` (bench/inprocess.py's mapping, as tests/test_cache.py),
enabled for one call and disabled after it, so no cache state carries over between cases or seeds. The fp32
reference stays uncached: the table is SeaCache's distance to exact fp32 — diffusers cached and ours cached — and
their ratio, judged as above. Per run it also gives the fraction of branch-steps (steps × CFG branches) that
reused: ours from the `done` info's `cache_skipped`, diffusers' from `StackCalls` (its block stack did not run).

FP8 (`--precision fp8`): `--fp8-reference bf16` (the default) runs ours with the 16-bit checkpoint's layer linears
quantized at load (a deployment's `precision: fp8`) beside diffusers' bf16 as the low-precision column.
`--fp8-reference diffusers` runs diffusers' own FP8 as that column: `tools/make_fp8` writes the official ModelOpt
layout from the bf16 checkpoint (`<checkpoint>-fp8`, once; policy 3 + 3 stamped; input scales calibrated by
diffusers fp32 on `--device`; needs nvidia-modelopt), diffusers loads it as tests/test_fp8.py does (ModelOpt restores
`modelopt_state.pth`; the FP8 linears' W8A8 is ModelOpt's `fp8_per_tensor_gemm` — `torch._scaled_mm` — with dynamo
off, its W8A16 diffusers' `_w8a16_linear`; the linears classified by tower, as the step policy defines them:
diffusers 0.42.1 swaps the two towers' attention projections) and runs its step policy; ours serves the same
checkpoint (`precision: checkpoint`: an FP8 checkpoint loads as `Fp8Linear`s, the checkpoint's policy). A
`--fp8-policy` goes to ours as the deployment's `fp8_policy` and to diffusers as `mixed_precision_*` (first_steps,
last_steps, reasoner; the pipeline takes no overlap). The reference is diffusers fp32 on the bf16 weights.

Noise seeds (`--seeds N`): every case runs with noise seeds seed, seed + 1, …, seed + N - 1 over the same weights
(drawn with `--seed`; the checkpoint is keyed on it alone), in every run (fp32, low precision, ours), each seed
against the fp32 run of that seed. Per case and run the rel-L2s aggregate as the root-mean-square over the seeds
(shown with the per-seed [min–max]); the ratio and the judgement use those aggregates, ours' RMS against
diffusers': ours passes when RMS(ours) ≤ max(`--bar` × RMS(diffusers), FLOOR). PSNR is the lowest over the seeds,
the fraction skipped the mean. The per-seed numbers stay in the JSON (`runs.<run>.seeds`). Robot actions are
80–160 numbers per case, whose bf16 distance moves by tens of per cent from seed to seed: judge them over seeds.
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


SOUND_PRESETS = ("tiny", "nano")  # Edge has no sound
V2V_INDEXES = [0, 1]  # the pipeline's default condition_frame_indexes
CLIP_FRAMES = 12  # longer than the max(idx)·4 + 1 = 5 frames kept, so `first` and `last` keep different frames
ACTION_PRESETS = ("tiny", "nano")  # Edge has no action heads
ACTION_MODES = {"policy": "policy", "fd": "forward_dynamics", "id": "inverse_dynamics"}  # case task → mode
ACTION_DOMAINS = {"policy": "droid_lerobot", "fd": "bridge_orig_lerobot", "id": "av"}  # widths 10, 10, 9


@dataclass(frozen=True)
class Case:
    task: str  # t2v | i2v | v2v-first | v2v-last | t2v+sound | i2v+sound | v2v+sound | policy | fd | id
    frames: int  # pixel frames (an action case: chunk + 1)
    steps: int
    schedule: str  # native | flow
    tier: int = 0  # an action case's resolution tier

    @property
    def name(self) -> str:
        if self.action:
            return f"{self.task}-{self.tier}-{self.chunk}c-{self.steps}s-{self.schedule}"
        return f"{self.task}-{self.frames}f-{self.steps}s-{self.schedule}"

    @property
    def action(self) -> bool:
        return self.task in ACTION_MODES

    @property
    def chunk(self) -> int:
        return self.frames - 1

    @property
    def mode(self) -> str:
        return ACTION_MODES[self.task]

    @property
    def domain(self) -> str:
        return ACTION_DOMAINS[self.task]

    @property
    def sound(self) -> bool:
        return self.task.endswith("+sound")

    @property
    def kind(self) -> str:  # t2v | i2v | v2v | action
        return "action" if self.action else self.task[:3]

    @property
    def keep(self) -> str:  # v2v: which end of the clip
        return "last" if self.task == "v2v-last" else "first"


def _frames(preset: str) -> tuple[int, int]:
    return (5, 9) if preset == "tiny" else (9, 33)  # the tiny VAE is most of a CPU run's time


def cases_for(preset: str) -> list[Case]:
    """The default run: t2v and i2v."""
    return [Case(t, f, s, sch) for sch in ("native", "flow") for t in ("t2v", "i2v") for f in _frames(preset)
            for s in (4, 8)]  # fmt: skip


def omni_cases(preset: str) -> list[Case]:
    """v2v (every preset) and sound (presets with sound), picked by `--cases` globs."""
    tasks = ["v2v-first", "v2v-last"] + (["t2v+sound", "i2v+sound", "v2v+sound"] if preset in SOUND_PRESETS else [])
    return [Case(t, f, s, sch) for sch in ("native", "flow") for t in tasks for f in _frames(preset) for s in (4, 8)]


def action_cases(preset: str) -> list[Case]:
    """Policy, forward and inverse dynamics (presets with action heads), picked by `--cases` globs."""
    if preset not in ACTION_PRESETS:
        return []
    return [Case(t, chunk + 1, 4, "flow", tier) for t in ACTION_MODES for tier in (256, 480) for chunk in (8, 16)]


def select(preset: str, patterns: list[str] | None) -> list[Case]:
    cases = cases_for(preset) + (omni_cases(preset) + action_cases(preset) if patterns else [])
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


def cond_clip(height: int, width: int, frames: int = CLIP_FRAMES) -> np.ndarray:
    """uint8 [T, H, W, 3] at the output size: the condition image drifting and brightening frame by frame, the v2v
    clip of every case."""
    base = cond_image(height, width).astype(np.int16)
    return np.stack([np.clip(np.roll(base, 3 * i, axis=1) + 8 * i, 0, 255).astype(np.uint8) for i in range(frames)])


def action_raw(chunk: int, domain: str, seed: int = 0) -> np.ndarray:
    """Forward dynamics' raw actions: float32 [chunk, the domain's raw width], seeded N(0, 0.5²)."""
    from cosmos3_core.model.embodiments import RAW_ACTION_DIMS

    rng = np.random.default_rng(seed)
    return (0.5 * rng.standard_normal((chunk, RAW_ACTION_DIMS[domain]))).astype(np.float32)


def inputs_of(case: Case, height: int, width: int) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """(image, clip, raw actions) of a case at the output size."""
    if case.kind == "i2v":
        return cond_image(height, width), None, None
    if case.kind == "v2v":
        return None, cond_clip(height, width), None
    if not case.action:
        return None, None, None
    if case.mode == "inverse_dynamics":
        return None, cond_clip(height, width, case.chunk + 1), None
    raw = action_raw(case.chunk, case.domain) if case.mode == "forward_dynamics" else None
    return cond_image(height, width), None, raw


def checkpoint(preset: str, seed: int, device: str, sound: bool = False, action: bool = False) -> Path:
    """The preset's checkpoint with LLM-like random weights, written once under $COSMOS3_CACHE. `sound`, `action`:
    with those parts, added in place when missing (the rest of the checkpoint unchanged)."""
    from cosmos3_core.model.random_checkpoint import (
        add_action,
        add_sound,
        has_action,
        has_sound,
        write_skeleton,
        write_weights,
    )
    from cosmos3_core.tools.make_tiny import make_tiny

    cache = Path(os.environ.get("COSMOS3_CACHE", Path.home() / ".cache" / "cosmos3"))
    target = cache / f"parity-{preset}-s{seed}"
    if (target / "model_index.json").is_file():
        if sound and not has_sound(target):
            add_sound(target, preset, seed, device)
        if action and not has_action(target):
            add_action(target, preset, seed, device)
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".tmp-parity-"))
    try:
        if preset == "tiny":
            write_weights(make_tiny(tmp / "ckpt", variant="edge", seed=seed), seed, device)
        else:
            write_skeleton(tmp / "ckpt", preset, weights=True, seed=seed, device=device)
        if sound:
            add_sound(tmp / "ckpt", preset, seed, device)
        if action:
            add_action(tmp / "ckpt", preset, seed, device)
        (tmp / "ckpt").rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def params_of(case: Case, preset: str, seed: int) -> dict[str, Any]:
    if case.action:  # the chunk sets the frames, the tier the size
        action = {"mode": case.mode, "chunk_size": case.chunk, "domain": case.domain, "resolution_tier": case.tier}
        return {"action": action, "fps": 24.0, "steps": case.steps, "guidance_scale": 6.0, "shift": 5.0, "seed": seed}
    h, w = SIZES[preset]
    p = {"height": h, "width": w, "num_frames": case.frames, "fps": 24.0, "steps": case.steps,
         "guidance_scale": 6.0, "shift": 5.0, "seed": seed}  # fmt: skip
    if case.kind == "v2v":
        p |= {"condition_frame_indexes": list(V2V_INDEXES), "condition_video_keep": case.keep}
    if case.sound:
        p["enable_sound"] = True
    return p


@dataclass
class Output:
    """One run of one case: final vision latents, decoded uint8 frames, with sound the sound latents and the
    waveform float32 [2, S], with actions (policy, inverse dynamics) the actions [chunk, raw width]."""

    latents: torch.Tensor
    frames: np.ndarray
    sound: torch.Tensor | None = None
    wave: torch.Tensor | None = None
    actions: torch.Tensor | None = None
    skipped: dict[str, list[int]] | None = None  # with a cache: per CFG branch the 0-based steps that reused


def reference_path(root: Path, case: Case, p: dict, device: str) -> Path:
    """Where the fp32 reference of `case` with parameters `p` on checkpoint `root` and `device` is kept: under the
    checkpoint, keyed on its configs (parts added in place change them), the case, its parameters and the device,
    so a second run on the same machine (another `--cache`, `--precision` or `--variants`) skips the fp32 phase it
    would repeat."""
    import hashlib

    parts = [(root / f).read_bytes() for f in ("model_index.json", "transformer/config.json")]
    key = hashlib.sha256(b"".join(parts) + json.dumps([case.name, p, device], sort_keys=True, default=str).encode())
    return root / "fp32_reference" / f"{case.name}-{key.hexdigest()[:16]}.pt"


def branches(p: dict) -> int:
    return 1 if p["guidance_scale"] == 1.0 else 2


def skip_fraction(skipped: dict[str, list[int]], p: dict) -> float:
    """The fraction of the run's branch-steps (steps × CFG branches) that reused instead of running the stack."""
    return sum(len(s) for s in skipped.values()) / (p["steps"] * branches(p))


# ---- diffusers ----
def load_diffusers(root: Path, device: str, dtype: torch.dtype):
    from diffusers import Cosmos3OmniPipeline

    device_map = device if device.startswith("cuda") else None
    pipe = Cosmos3OmniPipeline.from_pretrained(root, dtype=dtype, device_map=device_map)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _by_tower(name: str) -> str | None:
    """The step policy's classification of a layer linear (GEN tower: generation, UND: reasoner); diffusers 0.42.1
    swaps the two towers' attention projections (tests/test_fp8.py)."""
    if ".mlp_moe_gen." in name or name.endswith(GEN_PROJ):
        return "generation"
    if ".mlp." in name or name.endswith(UND_PROJ):
        return "reasoner"
    return None


GEN_PROJ = (".self_attn.add_q_proj", ".self_attn.add_k_proj", ".self_attn.add_v_proj", ".self_attn.to_add_out")
UND_PROJ = (".self_attn.to_q", ".self_attn.to_k", ".self_attn.to_v", ".self_attn.to_out")


def load_diffusers_fp8(root: Path, device: str, dtype: torch.dtype):
    """diffusers on an FP8 checkpoint as tests/test_fp8.py loads it: ModelOpt restores `modelopt_state.pth` around
    the transformer's load (on the CPU, then moved), each FP8 linear's W8A8 forward is ModelOpt's own
    `fp8_per_tensor_gemm` (`torch._scaled_mm`; what ModelOpt dispatches to on CUDA ≥ sm89, here on the CPU too),
    its W8A16 diffusers' `_w8a16_linear`; the caller classifies the linears by tower and runs dynamo off."""
    from diffusers import Cosmos3OmniPipeline, Cosmos3OmniTransformer
    from modelopt.torch.opt.plugins.huggingface import _patch_model_init_for_modelopt
    from modelopt.torch.quantization.backends.fp8_per_tensor_gemm import fp8_per_tensor_gemm

    with _patch_model_init_for_modelopt(Cosmos3OmniTransformer, str(root / "transformer")):
        transformer = Cosmos3OmniTransformer.from_pretrained(root / "transformer", torch_dtype=dtype)
    transformer.to(device)  # a device only: a quantized diffusers model refuses a dtype
    fp8 = [m for m in transformer.modules()
           if hasattr(m, "_should_run_real_quant_gemm") and m.weight.dtype == torch.float8_e4m3fn]  # fmt: skip
    for m in fp8:
        m.forward = lambda x, m=m: fp8_per_tensor_gemm(m, x, m.bias)  # this instance's only
    per_layer = 12 if transformer.config.hidden_act == "relu2" else 14  # 8 projections + 2 MLPs of 2 or 3
    if len(fp8) != per_layer * transformer.config.num_hidden_layers:
        raise RuntimeError(f"{root}: {len(fp8)} ModelOpt FP8 linears, expected {per_layer} per layer")
    pipe = Cosmos3OmniPipeline.from_pretrained(root, transformer=transformer, dtype=dtype)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def mixed_kwargs(fp8_policy: dict) -> dict[str, Any]:
    """`--fp8-policy` as the pipeline's `mixed_precision_*` arguments (none: the checkpoint's policy, 3 + 3)."""
    if not fp8_policy:
        return {}
    if "overlap" in fp8_policy:
        raise SystemExit("--fp8-policy overlap: the pipeline takes no overlap argument (the checkpoint's: a16)")
    reasoner = {"a16": "high_precision", "native": "base_precision"}
    out: dict[str, Any] = {"mixed_precision_format": "fp8"}
    for key in ("first_steps", "last_steps"):
        if key in fp8_policy:
            out[f"mixed_precision_{key}"] = fp8_policy[key]
    if "reasoner" in fp8_policy:
        out["mixed_precision_reasoner_policy"] = reasoner[fp8_policy["reasoner"]]
    return out


def run_diffusers(
    pipe, case: Case, p: dict, image: np.ndarray | None, clip: np.ndarray | None = None,
    raw: np.ndarray | None = None, cache: dict | None = None, mixed: dict | None = None,
) -> Output:  # fmt: skip
    """One case and seed. `cache`: a request's `parameters.cache`, run as `transformer.enable_cache(SeaCacheConfig)`
    for this call only (disabled after: no state carries over), the skipped steps read by `StackCalls`. `mixed`: the
    pipeline's `mixed_precision_*` arguments (FP8)."""
    from diffusers import UniPCMultistepScheduler

    from .inprocess import StackCalls, sea_cache_config

    pipe.register_to_config(use_native_flow_schedule=case.schedule == "native")
    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=p["shift"])
    calls = None
    if cache is not None:
        pipe.transformer.enable_cache(sea_cache_config({"cache": cache}))
        calls = StackCalls(pipe.transformer)
    try:
        run_one = _run_diffusers_action if case.action else _run_diffusers_video
        out = run_one(pipe, case, p, image, clip, raw, mixed or {})
    finally:
        if calls is not None:
            calls.remove()
            pipe.transformer.disable_cache()
    if calls is not None:
        out.skipped = calls.skipped(branches(p))
    return out


def _run_diffusers_video(pipe, case: Case, p: dict, image, clip, raw, mixed: dict) -> Output:
    from PIL import Image

    extra: dict[str, Any] = dict(mixed)
    if case.kind == "i2v":
        extra["image"] = image
    if case.kind == "v2v":
        extra |= {"video": [Image.fromarray(f) for f in clip], "condition_video_keep": case.keep,
                  "condition_frame_indexes_vision": list(p["condition_frame_indexes"])}  # fmt: skip
    captured: dict[str, torch.Tensor] = {}
    decode_sound = pipe.decode_sound  # the sound latents, as they reach the tokenizer
    pipe.decode_sound = lambda lat: decode_sound(captured.setdefault("sound", lat.detach().clone()))
    try:
        out = pipe(prompt=PROMPT, num_frames=p["num_frames"], height=p["height"], width=p["width"],
                   fps=p["fps"], num_inference_steps=p["steps"], guidance_scale=p["guidance_scale"],
                   generator=torch.Generator().manual_seed(p["seed"]), output_type="latent",
                   enable_sound=case.sound, enable_safety_check=False, **extra)  # fmt: skip
    finally:
        del pipe.decode_sound
    latents = out.video
    frames = _decode_diffusers(pipe, latents)
    if not case.sound:
        return Output(latents.float().cpu(), frames)
    return Output(latents.float().cpu(), frames, captured["sound"].float().cpu(), out.sound.float().cpu())


def _run_diffusers_action(pipe, case: Case, p: dict, image, clip, raw, mixed: dict) -> Output:
    """`pipe(action=CosmosActionCondition(...))`: the final vision latents, their decode, `out.action[0]`."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition
    from PIL import Image

    condition = CosmosActionCondition(
        mode=case.mode, chunk_size=case.chunk, domain_name=case.domain, resolution_tier=case.tier,
        raw_actions=None if raw is None else torch.from_numpy(raw),
        image=None if image is None else Image.fromarray(image),
        video=None if clip is None else [Image.fromarray(f) for f in clip],
    )  # fmt: skip
    out = pipe(prompt=PROMPT, action=condition, fps=p["fps"], num_inference_steps=p["steps"],
               guidance_scale=p["guidance_scale"], generator=torch.Generator().manual_seed(p["seed"]),
               output_type="latent", enable_safety_check=False, **mixed)  # fmt: skip
    actions = None if out.action is None else out.action[0].float().cpu()
    return Output(out.video.float().cpu(), _decode_diffusers(pipe, out.video), actions=actions)


def _decode_diffusers(pipe, latents: torch.Tensor) -> np.ndarray:
    """uint8 [T, H, W, 3]: the pipeline's own decode, as `output_type="np"` runs it."""
    with torch.inference_mode():
        vae, shape = pipe.vae, (1, -1, 1, 1, 1)
        mean = pipe._vae_latents_mean.to(device=latents.device, dtype=vae.dtype).view(shape)
        inv_std = pipe._vae_latents_inv_std.to(device=latents.device, dtype=vae.dtype).view(shape)
        decoded = vae.decode(latents.to(vae.dtype) / inv_std + mean).sample.to(latents.dtype)
        video = pipe.video_processor.postprocess_video(decoded, output_type="np")[0]
    return np.round(video * 255).astype(np.uint8)


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


def run_ours(
    gen, p: dict, image: np.ndarray | None, clip: np.ndarray | None = None, raw: np.ndarray | None = None
) -> tuple[Output, str]:
    out = gen.generate(PROMPT, p, image, video=clip, raw_actions=raw)
    latents, sound = out.latents, out.sound
    frames = gen.decode.run(latents)
    try:  # the backend this request's last step ran (`attention: auto` falling back to SDPA shows)
        backend = next(reversed(gen.engine.step.layouts))[1]
    except (AttributeError, StopIteration, TypeError):
        backend = "?"
    actions = None if out.actions is None else out.actions.float().cpu()
    skipped = out.info.get("cache_skipped")  # what the `done` event carries
    if sound is None:
        return Output(latents.float().cpu(), frames, actions=actions, skipped=skipped), backend
    wave = torch.from_numpy(gen.decode.audio(sound))  # what the server returns as `audio`
    return Output(latents.float().cpu(), frames, sound.float().cpu(), wave.float(), actions, skipped), backend


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


def fp8_checkpoint(root: Path, device: str) -> Path:
    """The FP8 checkpoint of `root` (`tools/make_fp8`: the official ModelOpt layout, policy 3 + 3, calibrated by
    diffusers fp32 on `device`), written once beside it; rewritten when `root` has gained sound or action parts."""
    from cosmos3_core.model.random_checkpoint import has_action, has_sound
    from cosmos3_core.tools.make_fp8 import make_fp8, policy_json

    try:
        import modelopt.torch.quantization  # noqa: F401 - diffusers loads the checkpoint through ModelOpt
    except ImportError as e:
        raise SystemExit(f"--fp8-reference diffusers needs nvidia-modelopt (0.47.0): {e}") from e
    target = root.with_name(f"{root.name}-fp8")

    def parts(ckpt: Path) -> tuple[bool, bool]:
        return has_sound(ckpt), has_action(ckpt)

    if (target / "model_index.json").is_file() and parts(target) == parts(root):
        return target
    tmp = root.with_name(f".tmp-{target.name}")
    make_fp8(root, tmp, policy_json(), device=device)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def rms(xs: list[float]) -> float:
    return math.sqrt(sum(x * x for x in xs) / len(xs))


def aggregate(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's per-seed records → rel-L2s: their root-mean-square over the seeds (and `<key>_range` [min, max]);
    PSNR: the lowest; the fraction skipped: the mean; the rest: the last seed's. The per-seed records stay under
    `seeds`."""
    out: dict[str, Any] = {}
    for key in per_seed[0]:
        values = [d[key] for d in per_seed]
        if key.endswith("rel_l2"):
            out |= {key: rms(values), f"{key}_range": [min(values), max(values)]}
        elif key == "psnr_db":
            out[key] = min(values)
        elif key == "skip_frac":
            out[key] = sum(values) / len(values)
        else:
            out[key] = values[-1]
    return out | {"seeds": per_seed}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import diffusers.pipelines.cosmos.mixed_precision as mixed_precision

    if args.seeds < 1:
        raise SystemExit(f"--seeds: at least 1, got {args.seeds}")
    cuda = args.device.startswith("cuda")
    lowp = {"auto": torch.bfloat16 if cuda else torch.float32, "bfloat16": torch.bfloat16,
            "float32": torch.float32}[args.dtype]  # fmt: skip
    variants = args.variants or (["sdpa", "flashinfer"] if cuda else ["sdpa"])
    skipped = [v for v in variants if v == "flashinfer" and not (cuda and flashinfer_available())]
    variants = [v for v in variants if v not in skipped]
    cache = json.loads(args.cache) if args.cache else None
    if cache is not None:
        from cosmos3_core.requests import parse_cache

        parse_cache(cache)  # a bad field fails here, naming it, not after the fp32 run
    fp8_policy = json.loads(args.fp8_policy)
    fp8_diffusers = args.fp8_reference == "diffusers"
    if fp8_diffusers and args.precision != "fp8":
        raise SystemExit("--fp8-reference diffusers: with --precision fp8")
    mixed = mixed_kwargs(fp8_policy) if fp8_diffusers else {}
    seeds = [args.seed + k for k in range(args.seeds)]  # noise seeds; the weights are drawn with args.seed
    torch.backends.cuda.matmul.allow_tf32 = False  # the oracle is fp32 (cuDNN's convs default to TF32)
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    cases = select(args.preset, args.cases)
    h, w = SIZES[args.preset]
    inputs = {c.name: inputs_of(c, h, w) for c in cases}
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    sound, action = any(c.sound for c in cases), any(c.action for c in cases)
    root = checkpoint(args.preset, args.seed, args.device, sound=sound, action=action)
    timings["checkpoint_s"] = time.perf_counter() - t0
    print(f"checkpoint {root} ({timings['checkpoint_s']:.0f} s)", flush=True)
    lowp_root = root
    if fp8_diffusers:
        t0 = time.perf_counter()
        lowp_root = fp8_checkpoint(root, args.device)
        timings["fp8_checkpoint_s"] = time.perf_counter() - t0
        print(f"FP8 checkpoint {lowp_root} ({timings['fp8_checkpoint_s']:.0f} s)", flush=True)

    ref: dict[tuple[str, int], Output] = {}
    per_seed: dict[str, dict[str, list[dict[str, Any]]]] = {c.name: {} for c in cases}

    def record(case: Case, run_name: str, seed: int, out: Output, p: dict, **extra: Any) -> None:
        r = ref[case.name, seed]
        d = {"rel_l2": rel_l2(out.latents, r.latents), "psnr_db": psnr(out.frames, r.frames), **extra}
        line = f"rel-L2 {d['rel_l2']:.3e}  PSNR {d['psnr_db']:.2f} dB"
        if case.sound:
            d |= {"wave_rel_l2": rel_l2(out.wave, r.wave), "sound_rel_l2": rel_l2(out.sound, r.sound)}
            line += f"  waveform rel-L2 {d['wave_rel_l2']:.3e}  sound latents {d['sound_rel_l2']:.3e}"
        if r.actions is not None:
            if out.actions is None or out.actions.shape != r.actions.shape:
                raise RuntimeError(f"{case.name} {run_name}: actions {getattr(out.actions, 'shape', None)}, "
                                   f"expected {tuple(r.actions.shape)}")  # fmt: skip
            d["action_rel_l2"] = rel_l2(out.actions, r.actions)
            line += f"  actions rel-L2 {d['action_rel_l2']:.3e}"
        if cache is not None:
            if out.skipped is None:
                raise RuntimeError(f"{case.name} {run_name}: no cache_skipped with a cache")
            d |= {"skipped": out.skipped, "skip_frac": skip_fraction(out.skipped, p)}
            line += f"  skipped {d['skip_frac']:.0%}"
        per_seed[case.name].setdefault(run_name, []).append(d)
        print(f"  {case.name:26s} s{seed:<3d} {run_name:12s} {line}", flush=True)

    kept = {(c.name, seed): reference_path(root, c, params_of(c, args.preset, seed), args.device)
            for c in cases for seed in seeds}  # fmt: skip
    for (name, seed), path in kept.items():
        if path.exists():
            ref[name, seed] = Output(**torch.load(path, weights_only=False))
    if ref:
        print(f"fp32 reference: {len(ref)} of {len(kept)} kept from an earlier run ({root / 'fp32_reference'})")
    for phase, dtype in (("diffusers_fp32", torch.float32), ("diffusers", lowp)):
        t0 = time.perf_counter()
        fp8 = fp8_diffusers and phase == "diffusers"
        if phase == "diffusers_fp32" and len(ref) == len(kept):
            timings[f"{phase}_s"] = 0.0
            continue
        classify = mixed_precision._classify_cosmos3_linear
        try:  # dynamo off: ModelOpt's GEMM helpers are torch.compile'd; run eagerly (the same ops)
            with torch._dynamo.config.patch(disable=fp8):
                if fp8:  # the linears classified by tower, as the step policy defines them (ours)
                    mixed_precision._classify_cosmos3_linear = _by_tower
                    pipe = load_diffusers_fp8(lowp_root, args.device, dtype)
                else:
                    pipe = load_diffusers(root, args.device, dtype)
                for c in cases:
                    for seed in seeds:
                        p = params_of(c, args.preset, seed)
                        if phase == "diffusers_fp32":  # the reference: uncached, 16-bit weights, fp32
                            if (c.name, seed) in ref:
                                continue
                            out = ref[c.name, seed] = run_diffusers(pipe, c, p, *inputs[c.name])
                            kept[c.name, seed].parent.mkdir(exist_ok=True)
                            torch.save(asdict(out), kept[c.name, seed])
                            extra = "" if out.wave is None else (
                                f"  waveform {tuple(out.wave.shape)} std {out.wave.std():.3f}, "
                                f"{(out.wave.abs() >= 1).float().mean():.1%} clamped")  # fmt: skip
                            if out.actions is not None:
                                extra += f"  actions {tuple(out.actions.shape)} std {out.actions.std():.3f}"
                            print(f"  {c.name:26s} s{seed:<3d} fp32 reference |latents| {out.latents.norm():.1f}"
                                  f"{extra}", flush=True)  # fmt: skip
                        else:
                            out = run_diffusers(pipe, c, p, *inputs[c.name], cache=cache, mixed=mixed)
                            trace = getattr(pipe, "_mixed_precision_trace", None) if fp8 else None
                            record(c, phase, seed, out, p, **({"fp8_trace": list(trace)} if trace else {}))
        finally:
            mixed_precision._classify_cosmos3_linear = classify
        del pipe
        free()
        timings[f"{phase}_s"] = time.perf_counter() - t0
        print(f"{phase}: {timings[f'{phase}_s']:.0f} s", flush=True)

    # ours: the FP8 checkpoint as served (precision checkpoint) or the 16-bit one (quantized at load with fp8)
    precision = "checkpoint" if fp8_diffusers else args.precision
    for variant in variants:  # a fresh Generator per backend and schedule, each freed before the next
        t0 = time.perf_counter()
        for schedule in dict.fromkeys(c.schedule for c in cases):
            gen = load_ours(with_schedule(lowp_root, schedule), args.device, lowp, args.compile, variant, precision,
                            fp8_policy)  # fmt: skip
            for c in (c for c in cases if c.schedule == schedule):
                for seed in seeds:
                    p = params_of(c, args.preset, seed) | ({"cache": cache} if cache is not None else {})
                    out, backend = run_ours(gen, p, *inputs[c.name])
                    record(c, variant, seed, out, p, backend=backend)
            del gen
            free()
        timings[f"ours_{variant}_s"] = time.perf_counter() - t0
        print(f"ours {variant}: {timings[f'ours_{variant}_s']:.0f} s", flush=True)

    rows: dict[str, dict[str, Any]] = {}
    for c in cases:  # over the seeds: the RMS of the per-seed rel-L2s, ours against diffusers' (module docstring)
        runs = {k: aggregate(v) for k, v in per_seed[c.name].items()}
        keys = ["rel_l2"] + [k for k in ("wave_rel_l2", "action_rel_l2") if k in runs["diffusers"]]
        for key in keys:  # vision latents, and with sound the waveform, with actions the actions: each within the bar
            d = runs["diffusers"][key]
            for v in variants:
                runs[v][key.replace("rel_l2", "ratio")] = runs[v][key] / d if d > 0 else math.nan
        ok = all(passes(runs[v][k], runs["diffusers"][k], args.bar) for v in variants for k in keys)
        rows[c.name] = {"case": asdict(c), "runs": runs, "pass": ok}
    gpu = torch.cuda.get_device_name() if cuda else "CPU"
    return {"preset": args.preset, "gpu": gpu, "date": datetime.date.today().isoformat(),
            "command": "python -m bench.parity " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "dtype": str(lowp).removeprefix("torch."), "compile": args.compile, "bar": args.bar, "seed": args.seed,
            "seeds": seeds, "precision": args.precision, "fp8_policy": fp8_policy,
            "fp8_reference": args.fp8_reference if args.precision == "fp8" else None, "cache": cache,
            "size": [h, w], "variants": variants, "skipped": skipped, "timings": timings, "cases": rows}  # fmt: skip


# ---- report ----
LABELS = {"sdpa": "SDPA + graphs", "flashinfer": "FlashInfer + graphs"}


def _pct(run: dict[str, Any], key: str) -> str:
    """A rel-L2 in %, with the per-seed [min–max] after it when the run had several seeds."""
    cell = f"{100 * run[key]:.3f} %"
    if len(run.get("seeds", ())) > 1:
        lo, hi = run[f"{key}_range"]
        cell += f" [{100 * lo:.2f}–{100 * hi:.2f}]"
    return cell


def lowp_label(result: dict[str, Any]) -> str:
    """The low-precision diffusers run: its dtype, FP8 when it ran diffusers' own, + SeaCache with a cache."""
    label = f"diffusers {result['dtype']}"
    if result.get("fp8_reference") == "diffusers":
        label += " FP8"
    return label + (" + SeaCache" if result.get("cache") else "")


def table(result: dict[str, Any]) -> str:
    variants = result["variants"]
    sound = any("wave_rel_l2" in r["runs"]["diffusers"] for r in result["cases"].values())
    action = any("action_rel_l2" in r["runs"]["diffusers"] for r in result["cases"].values())
    cache = any("skip_frac" in r["runs"]["diffusers"] for r in result["cases"].values())
    head = ["case", lowp_label(result)]
    for v in variants:
        head += [f"ours {LABELS.get(v, v)}", "ratio"]
    head += ["PSNR dB: " + " / ".join(["diffusers", *variants])]
    if sound:
        head += ["waveform rel-L2: " + " / ".join(["diffusers", *variants]) + " (ratios)"]
    if action:
        head += ["actions rel-L2: " + " / ".join(["diffusers", *variants]) + " (ratios)"]
    if cache:
        head += ["branch-steps skipped: " + " / ".join(["diffusers", *variants])]
    head += [f"≤ {result['bar']}×"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in result["cases"].items():
        runs = row["runs"]
        cells = [name, _pct(runs["diffusers"], "rel_l2")]
        for v in variants:
            cells += [_pct(runs[v], "rel_l2"), f"{runs[v]['ratio']:.3f}"]
        cells.append(" / ".join(f"{runs[k]['psnr_db']:.1f}" for k in ["diffusers", *variants]))
        for shown, what in ((sound, "wave"), (action, "action")):  # waveform, actions: "—" where a case has none
            if shown:
                cells.append(_distances(runs, variants, what) if f"{what}_rel_l2" in runs["diffusers"] else "—")
        if cache:
            cells.append(" / ".join(f"{runs[k]['skip_frac']:.0%}" for k in ["diffusers", *variants]))
        cells.append("pass" if row["pass"] else "**FAIL**")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _distances(runs: dict, variants: list[str], what: str) -> str:
    """A table cell: diffusers' and each variant's `{what}_rel_l2` (their ratios)."""
    distances = " / ".join(_pct(runs[k], f"{what}_rel_l2") for k in ["diffusers", *variants])
    ratios = " / ".join(f"{runs[v][what + '_ratio']:.3f}" for v in variants)
    return f"{distances} ({ratios})"


def summary(result: dict[str, Any]) -> str:
    rows = result["cases"].values()
    ratios = [r["runs"][v][k] for r in rows for v in result["variants"] for k in ("ratio", "wave_ratio", "action_ratio")
              if k in r["runs"][v]]  # fmt: skip
    ok = sum(r["pass"] for r in rows)
    worst = max((x for x in ratios if not math.isnan(x)), default=math.nan)
    t = ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in result["timings"].items())
    fp8 = ""
    if result.get("precision") == "fp8":
        policy = result.get("fp8_policy") or "policy 3+3"
        fp8 = (f", FP8 {policy}: ours and diffusers (ModelOpt, linears by tower) on the FP8 checkpoint make_fp8 "
               f"wrote from the bf16 one" if result.get("fp8_reference") == "diffusers" else
               f", ours FP8 {policy} (quantized at load) beside diffusers' {result['dtype']}")  # fmt: skip
    cache = f", SeaCache {json.dumps(result['cache'])} (the fp32 reference uncached)" if result.get("cache") else ""
    seeds = result.get("seeds") or [result.get("seed", 0)]
    noise = (f", noise seeds {seeds[0]}–{seeds[-1]} (rel-L2: RMS over seeds [min–max])" if len(seeds) > 1
             else "")  # fmt: skip
    return (f"{result['preset']} at {result['size'][1]}×{result['size'][0]}, {result['dtype']}{fp8}{cache}{noise}, "
            f"compile {'on' if result['compile'] else 'off'}, on {result['gpu']}, {result['date']}: {ok}/{len(rows)} "
            f"cases pass, worst ratio {worst:.3f}"
            + (f"; not run: {', '.join(result['skipped'])}" if result["skipped"] else "") + f". Wall: {t}.")  # fmt: skip


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
    ap.add_argument(
        "--fp8-reference",
        choices=["bf16", "diffusers"],
        default="bf16",
        help="with --precision fp8: the low-precision diffusers run; bf16: diffusers' bf16 beside ours quantized at "
        "load; diffusers: diffusers' own FP8 (ModelOpt) on an FP8 checkpoint written by tools/make_fp8, which ours "
        "serves too",
    )
    ap.add_argument("--cache", default="", help='JSON: parameters.cache for ours and diffusers\' low-precision run, '
                    'e.g. \'{"policy": "sea"}\' (the fp32 reference runs uncached)')  # fmt: skip
    ap.add_argument("--seed", type=int, default=0, help="the weights' seed, and the first noise seed")
    ap.add_argument("--seeds", type=int, default=1, help="noise seeds per case: seed, seed + 1, ...")
    ap.add_argument("--bar", type=float, default=BAR)
    ap.add_argument("--json", default="")
    ap.add_argument("--md", default="", help="add the table to this markdown file")
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
