"""Served speed: start the real tritonserver on a deployment and drive it with concurrent gRPC streams.

  python -m bench.served --config configs/bench_edge.yaml --c1 3 --c4 8 --json out.json
  python -m bench.served --config configs/bench_nano_ar.yaml --c1 0 --c4 0 --ar 1 --ar-params '{...}'
  python -m bench.served --config configs/bench_nano_sound.yaml --c1 1 --c4 0 --variants t2v t2v+sound v2v \
      --diffusers 1 --diffusers-variants t2v+sound v2v
  python -m bench.served --config configs/bench_nano_action.yaml --c1 3 --c4 0 --variants policy fd --c8 16 \
      --c8-variants policy --diffusers 2 --diffusers-variants policy

Reports c=1 end-to-end p50, c=4 videos/min and e2e p50 (single-shot t2v), and for `--ar N` Nano-style AR
streams (chained windows): TTFC, chunk gap and aggregate frames/s at c=1 and c=4. `--inprocess N --diffusers N`
then run the same single-shot request, in the same run, through our in-process engine and through diffusers'
`Cosmos3OmniPipeline` on the same random weights (CUDA, `random:` checkpoints). Step caching:
`--params '{"cache": {"policy": "sea"}}'` (diffusers then runs its own SeaCache with the same fields); each time
is reported with the share of branch-steps that skipped the block stack (`skipped`). The variant `t2v+sea` is t2v
with SeaCache at diffusers' defaults, so one server (and diffusers, toggling its cache per variant) runs both:

  python -m bench.served --config configs/bench_edge.yaml --variants t2v t2v+sea --c1 3 --c4 8 \
      --c4-variants t2v+sea --diffusers 2

`--c4-variants` runs `--c4` requests of those kinds at concurrency 4 after their c=1 requests. A cached kind's
first request runs all its steps (its skips build new layouts), other kinds' a 2-step one.

`--variants` (instead of the single t2v request): each request kind named (t2v, t2v+sound, i2v, i2v+sound, v2v,
v2v+sound; v2v: a 12-frame synthetic clip at the output size, `condition_frame_indexes` [0, 1]) at c=1, `--c1`
requests each after one 2-step request of that kind, on the same server; sound's cost over video-only is printed
when both t2v and t2v+sound ran. `--diffusers N` then runs `--diffusers-variants` (default: every variant) through
diffusers' pipeline, each with the parameters our server resolved for it (same size, steps, guidance, shift, and
its SeaCache with `cache`), after one 2-step run. On a `random:` skeleton diffusers gets its own random init at the
same shapes (the sound tokenizer's stored weights); on any other checkpoint (e.g. `random:tiny_sound`, CPU) the
checkpoint's weights.

Robot actions: variants `policy`, `fd` (forward dynamics) and `id` (inverse dynamics) send `parameters.action` =
`--action` (default chunk 16, `droid_lerobot`, tier 480) with that mode, conditioned on bench.parity's condition
image at the deployment's default size (inverse dynamics: its clip, chunk + 1 frames; forward dynamics: seeded raw
actions [chunk, the domain's width]); a policy or inverse-dynamics response must carry actions [chunk, width].
`--c8 N` then runs N requests at concurrency 8 of each `--c8-variants` kind, after one untimed burst of 8 2-step
ones; its throughput is reported in actions/s = chunk × requests / wall (and videos/min). Diffusers runs them as
`pipe(action=CosmosActionCondition(...))`. Every kind's compute floor (`bench/floor.py`: vision + action tokens,
each CFG branch with its own text, all steps, at the dense bf16 rate of the card it runs on: `floor.card_flops`) is printed beside its figures: c=1 e2e and
server denoise over it, and at c=8 the floor-bound actions/s (one request's chunk per floor, serial).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from client.stream import generate
from cosmos3_core.deployment import Deployment, parse_sets
from cosmos3_core.triton.launcher import stop_server, wait_until_ready
from cosmos3_core.triton.serve import start

from .floor import request_floor, text_lengths
from .pool import run_pool
from .report import skipped_fraction

PROMPT = "A robot arm stacks red and blue cubes on a wooden table, soft daylight, static camera."
V2V = {"condition_frame_indexes": [0, 1]}
ACTION = {"chunk_size": 16, "domain": "droid_lerobot", "resolution_tier": 480}  # `--action`'s default
ACTION_MODES = {"policy": "policy", "fd": "forward_dynamics", "id": "inverse_dynamics"}
VARIANTS: dict[str, tuple[dict, str | None]] = {  # request kind → (parameters, conditioning input)
    "t2v": ({}, None),
    "t2v+sea": ({"cache": {"policy": "sea"}}, None),  # diffusers' SeaCacheConfig defaults (step caching)
    "t2v+sound": ({"enable_sound": True}, None),
    "i2v": ({}, "image"),
    "i2v+sound": ({"enable_sound": True}, "image"),
    "v2v": (V2V, "video"),
    "v2v+sound": ({**V2V, "enable_sound": True}, "video"),
    "policy": ({}, "image"),
    "fd": ({}, "image"),  # and raw actions
    "id": ({}, "video"),
}
SIZE_KEYS = ("height", "width", "num_frames")  # set by an action request's chunk and tier, not sent with it


def variant_request(
    name: str, params: dict, height: int, width: int, action: dict | None = None
) -> tuple[dict, object, object, object]:
    """(parameters, image, clip, raw actions) of a request kind at the output size (bench.parity's condition image
    and clip). An action kind: `parameters.action` = `action` (default ACTION) with the kind's mode, without the
    size keys; inverse dynamics' clip has chunk + 1 frames, forward dynamics' raw actions are bench.parity's."""
    from .parity import action_raw, cond_clip, cond_image

    extra, cond = VARIANTS[name]
    if name not in ACTION_MODES:
        image = cond_image(height, width) if cond == "image" else None
        clip = cond_clip(height, width) if cond == "video" else None
        return {**params, **extra}, image, clip, None
    spec = {**ACTION, **(action or {}), "mode": ACTION_MODES[name]}
    chunk = spec["chunk_size"]
    image = cond_image(height, width) if cond == "image" else None
    clip = cond_clip(height, width, chunk + 1) if cond == "video" else None
    raw = action_raw(chunk, spec["domain"]) if name == "fd" else None
    return {**{k: v for k, v in params.items() if k not in SIZE_KEYS}, "action": spec}, image, clip, raw


def expected_actions(params: dict) -> tuple[int, int] | None:
    """The actions [chunk, raw width] a request must return (policy, inverse dynamics), else None."""
    from cosmos3_core.model.embodiments import FORWARD, RAW_ACTION_DIMS

    spec = params.get("action")
    if not spec or spec["mode"] == FORWARD:
        return None
    return spec["chunk_size"], RAW_ACTION_DIMS[spec["domain"]]


def drive(url: str, params: dict, count: int, concurrency: int, image=None, video=None, raw=None) -> dict:
    """`count` requests, `concurrency` at a time. → e2e list, wall time, frames, TTFCs and chunk gaps (and the
    waveform's [channels, samples] when the request has sound; actions/s when it returns actions)."""
    want = expected_actions(params)

    def one(i: int) -> dict:
        r = generate(url, PROMPT, {**params, "seed": i}, image, video=video, raw_actions=raw)
        gaps = [b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])]
        done = next(e for e in r.events if e["type"] == "done")
        p = done["params"]
        skipped = skipped_fraction(done.get("cache_skipped"), p["steps"], 1 if p["guidance_scale"] == 1.0 else 2)
        if params.get("enable_sound") and (r.audio is None or r.audio.ndim != 2 or r.audio.shape[0] != 2):
            raise RuntimeError(f"a sound request came back without stereo audio: {getattr(r.audio, 'shape', None)}")
        got = None if r.actions is None else tuple(r.actions.shape)
        if got != want:
            raise RuntimeError(f"an action request came back with actions {got}, expected {want}")
        audio = None if r.audio is None else list(r.audio.shape)
        return {"e2e": r.e2e_s, "ttfc": r.ttfc_s, "gaps": gaps, "frames": int(r.video.shape[0]),
                "server": done["timings"], "skipped": skipped, "audio": audio,
                "actions": 0 if got is None else got[0]}  # fmt: skip

    t0 = time.perf_counter()
    results = run_pool(range(count), concurrency, one)
    wall = time.perf_counter() - t0
    e2e = [r["e2e"] for r in results]
    out = {"count": count, "concurrency": concurrency, "wall_s": wall, "e2e_p50": statistics.median(e2e), "e2e": e2e,
           "videos_per_min": 60 * count / wall, "frames_per_s": sum(r["frames"] for r in results) / wall,
           "ttfc_p50": statistics.median(r["ttfc"] for r in results),
           "skipped_fraction": statistics.mean(r["skipped"] for r in results)}  # fmt: skip
    out["server_p50"] = {k: statistics.median(r["server"][k] for r in results) for k in results[0]["server"]}
    gaps = [g for r in results for g in r["gaps"]]
    if gaps:
        out["chunk_gap_p50"] = statistics.median(gaps)
    if results[0]["audio"] is not None:
        out["audio_shape"] = results[0]["audio"]
    if want is not None:
        out["actions_per_s"] = sum(r["actions"] for r in results) / wall
        out["actions_shape"] = list(want)
    return out


def side_by_side(deployment: Deployment, overrides: dict, inprocess: int, diffusers: int) -> dict:
    """The served single-shot request through our engine in this process and through diffusers."""
    from types import SimpleNamespace

    from .inprocess import ours, reference

    t2v = deployment.defaults.t2v
    params = {"height": deployment.defaults.height, "width": deployment.defaults.width,
              "num_frames": deployment.defaults.num_frames, "steps": t2v.steps, "guidance_scale": t2v.guidance_scale,
              "shift": t2v.shift, "seed": 0, **overrides}  # fmt: skip
    if not deployment.checkpoint.startswith("random:"):
        raise SystemExit(
            f"--inprocess/--diffusers build random weights at a preset's shapes; {deployment.checkpoint!r} is not random:"
        )
    preset = deployment.checkpoint.removeprefix("random:")
    out = {}
    if inprocess:
        args = SimpleNamespace(preset=preset, repeat=inprocess, compile=deployment.compile,
                               variants=[deployment.attention + ("+graphs" if deployment.cuda_graphs else "")],
                               precision=deployment.precision, fp8_policy=deployment.fp8_policy,
                               fp8_attention=deployment.fp8_attention)  # fmt: skip
        r = next(iter(ours(args, params).values()))
        out["inprocess"] = {"e2e": r["phases"]["e2e"], "phases": r["phases"], "skipped_fraction": r["skipped_fraction"]}
    if diffusers:
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
        out["diffusers"] = reference(SimpleNamespace(preset=preset, repeat=diffusers), params)
    return out


def diffusers_variants(deployment: Deployment, requests: dict[str, tuple], repeat: int) -> dict:
    """Each request kind (name → (parameters, image, clip, raw actions)) through diffusers' `Cosmos3OmniPipeline`
    with the parameters our prefill resolves for it (one 2-step run first, then `repeat` timed) → {name: {"e2e":
    [...]}}. An action request runs as `pipe(action=CosmosActionCondition(...))`; one with `lora` runs with that
    adapter of the deployment's `lora_dir` (`load_lora_adapter` on its first use, timed: `lora_load_s`, then
    `set_adapters` with its scale), a request without one with the adapters disabled."""
    import gc

    import torch
    from diffusers import (
        Cosmos3AVAEAudioTokenizer,
        Cosmos3OmniPipeline,
        Cosmos3OmniTransformer,
        UniPCMultistepScheduler,
    )
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition
    from PIL import Image

    from cosmos3_core.lora_store import WEIGHTS
    from cosmos3_core.model.checkpoint import Checkpoint
    from cosmos3_core.model.config import read_json
    from cosmos3_core.model.provision import resolve_checkpoint
    from cosmos3_core.requests import validate
    from cosmos3_core.sampling import checkpoint_shift

    gc.collect()
    cuda = deployment.torch_device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
    root = resolve_checkpoint(deployment.checkpoint)
    ckpt = Checkpoint.open(root)
    device, dtype = deployment.torch_device, deployment.torch_dtype
    if ckpt.random_weights:  # a skeleton: diffusers' own random init at its shapes (timing does not depend on values)
        tcfg = {k: v for k, v in read_json(root / "transformer" / "config.json").items() if not k.startswith("_")}
        torch.manual_seed(0)
        with torch.device(device):
            transformer = Cosmos3OmniTransformer(**tcfg).to(dtype)
        transformer.time_embedder.float()
        index = read_json(root / "model_index.json")
        sound = None
        if (index.get("sound_tokenizer") or [None])[0] is not None:
            sound = Cosmos3AVAEAudioTokenizer.from_pretrained(root / "sound_tokenizer", torch_dtype=dtype).to(device)
        pipe = Cosmos3OmniPipeline(transformer, ckpt.load_tokenizer(), ckpt.load_vae(device, dtype),
                                   UniPCMultistepScheduler.from_config(ckpt.scheduler_config), sound_tokenizer=sound,
                                   enable_safety_checker=False,
                                   use_native_flow_schedule=ckpt.use_native_flow_schedule)  # fmt: skip
    else:
        pipe = Cosmos3OmniPipeline.from_pretrained(root, dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    base = pipe.scheduler.config
    cfg, shift = ckpt.config, checkpoint_shift(ckpt.scheduler_config)

    def sync() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def run(kw: dict, shift: float, steps: int):
        pipe.scheduler = UniPCMultistepScheduler.from_config(base, flow_shift=shift)
        return pipe(**kw, num_inference_steps=steps, generator=torch.Generator().manual_seed(0))

    from .inprocess import StackCalls, sea_cache_config

    out, adapters = {}, set()
    for name, (params, image, clip, raw) in requests.items():
        if pipe.transformer.is_cache_enabled:
            pipe.transformer.disable_cache()
        config = sea_cache_config(params)
        if config is not None:
            pipe.transformer.enable_cache(config)  # diffusers' own SeaCache on the same fields
        p = validate(PROMPT, {**params, "seed": 0}, image, deployment.defaults, deployment.limits,
                     cfg.pixel_alignment, cfg.vae_scale_temporal, shift, clip, raw)  # fmt: skip
        kw = {"prompt": PROMPT, "num_frames": p.num_frames, "height": p.height, "width": p.width, "fps": p.fps,
              "guidance_scale": p.guidance_scale, "enable_sound": p.enable_sound, "output_type": "np",
              "enable_safety_check": False}  # fmt: skip
        if p.action_mode:  # the chunk sets the frames, the tier the size: not passed
            del kw["num_frames"], kw["height"], kw["width"]
            kw["action"] = CosmosActionCondition(
                mode=p.action_mode, chunk_size=p.chunk_size, domain_name=p.domain, resolution_tier=p.resolution_tier,
                raw_actions=None if raw is None else torch.from_numpy(raw),
                image=None if image is None else Image.fromarray(image),
                video=None if clip is None else [Image.fromarray(f) for f in clip], view_point=p.view_point,
            )  # fmt: skip
        elif image is not None:
            kw["image"] = Image.fromarray(image)
        if clip is not None and not p.action_mode:
            kw |= {"video": [Image.fromarray(f) for f in clip], "condition_video_keep": p.condition_video_keep,
                   "condition_frame_indexes_vision": list(p.condition_frame_indexes)}  # fmt: skip
        lora_load = None
        if p.lora is not None:  # the same adapter through diffusers' PEFT integration
            if p.lora.name not in adapters:
                t0 = sync()
                pipe.transformer.load_lora_adapter(str(Path(deployment.lora_dir) / p.lora.name), prefix=None,
                                                   weight_name=WEIGHTS, adapter_name=p.lora.name)  # fmt: skip
                lora_load = sync() - t0
                adapters.add(p.lora.name)
            pipe.transformer.enable_lora()
            pipe.transformer.set_adapters(p.lora.name, weights=p.lora.scale)
        elif adapters:
            pipe.transformer.disable_lora()
        t0 = sync()
        run(kw, p.shift, 2)
        warm, e2e, skipped = sync() - t0, [], []
        for _ in range(repeat):
            calls = StackCalls(pipe.transformer)
            t0 = sync()
            r = run(kw, p.shift, p.steps)
            e2e.append(sync() - t0)
            calls.remove()
            branches = 1 if p.guidance_scale == 1.0 else 2
            skipped.append(skipped_fraction(calls.skipped(branches), p.steps, branches))
        out[name] = {"e2e": e2e, "warmup_s": warm, "steps": p.steps, "shift": p.shift, "lora_load_s": lora_load,
                     "skipped_fraction": statistics.mean(skipped),
                     "audio_shape": None if r.sound is None else list(r.sound.shape),
                     "actions_shape": None if r.action is None else list(r.action[0].shape)}  # fmt: skip
        print(f"diffusers {name}: e2e {' / '.join(f'{x:.2f}' for x in e2e)} s", flush=True)
    return out


def sound_cost(result: dict) -> str:
    """Sound's cost over video-only: t2v+sound against t2v, same size, same server (p50s); kept in result."""
    video, sound = result["c1:t2v"], result["c1:t2v+sound"]
    parts, cost = [], {}
    for label, key in (("e2e", "e2e_p50"), ("server denoise", "denoise_s"), ("server decode", "decode_s")):
        a = video[key] if key == "e2e_p50" else video["server_p50"].get(key)
        b = sound[key] if key == "e2e_p50" else sound["server_p50"].get(key)
        if a is not None and b is not None:
            parts.append(f"{label} {b:.2f}s vs {a:.2f}s ({100 * (b / a - 1):+.1f} %)")
            cost[label] = {"video_s": a, "sound_s": b, "ratio": b / a}
    result["sound_cost"] = cost
    return "sound's cost over video-only (t2v+sound vs t2v): " + ", ".join(parts)


def floors(deployment: Deployment, requests: dict[str, tuple]) -> dict[str, dict]:
    """Each request kind's compute floor on this machine's card (`floor.request_floor`), its text as our prefill
    tokenizes it.
    `deployment`: the resolved one (its checkpoint a path)."""
    from cosmos3_core.model.checkpoint import Checkpoint
    from cosmos3_core.requests import validate
    from cosmos3_core.sampling import checkpoint_shift

    ckpt = Checkpoint.open(deployment.checkpoint)
    cfg, shift = ckpt.config, checkpoint_shift(ckpt.scheduler_config)
    out = {}
    for name, (params, image, clip, raw) in requests.items():
        p = validate(PROMPT, {**params, "seed": 0}, image, deployment.defaults, deployment.limits,
                     cfg.pixel_alignment, cfg.vae_scale_temporal, shift, clip, raw)  # fmt: skip
        out[name] = request_floor(cfg, p, text_lengths(ckpt, p))
    return out


def floor_line(key: str, r: dict, floor: dict) -> str:
    """The floor beside a run's figures: c=1 e2e and server denoise over it; at c>1 the floor-bound throughput
    (one request per floor, serial) and the achieved share of it."""
    f = floor["floor_s"]
    what = (f"{floor.get('card', 'H200')} floor {f:.3g}s ({floor['vision_tokens']} vision + {floor['action_tokens']} action tokens × "
            f"{floor['branches']} branches (text {'/'.join(map(str, floor['text_tokens']))}) × {floor['steps']} steps)")  # fmt: skip
    if r["concurrency"] == 1:
        denoise = r["server_p50"].get("denoise_s")
        return (f"        {what}: e2e/floor {r['e2e_p50'] / f:.2f}x"
                + (f", server denoise/floor {denoise / f:.2f}x" if denoise else ""))  # fmt: skip
    if "actions_per_s" in r:
        bound = floor["action_tokens"] / f
        return f"        {what}: floor-bound {bound:.2f} actions/s, achieved {r['actions_per_s'] / bound:.2f} of it"
    bound = 60 / f
    return f"        {what}: floor-bound {bound:.2f} videos/min, achieved {r['videos_per_min'] / bound:.2f} of it"


def perf_analyzer(binary: str, url: str, params: dict, counts: dict[int, int]) -> dict[int, dict]:
    """Triton's perf_analyzer (bench/perf_analyzer/fetch.sh) on the same server and request: `--streaming` (the
    ensemble is decoupled), the prompt and `parameters` JSON from an input-data file, at each concurrency c of
    `counts` with count windows of counts[c] requests (up to 3 trials, stable within 50 %) → per c its
    Inferences/Second and latencies (s) from its CSV."""
    import csv
    import os
    import subprocess

    binary = os.path.abspath(binary)
    lib = os.path.join(os.path.dirname(os.path.dirname(binary)), "lib")  # fetch.sh's DIR/lib
    env = {**os.environ, "LD_LIBRARY_PATH": ":".join(filter(None, [lib, os.environ.get("LD_LIBRARY_PATH")]))}
    out: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "input.json"
        data.write_text(json.dumps({"data": [{"prompt": [PROMPT], "parameters": [json.dumps({**params, "seed": 0})]}]}))
        for c, n in counts.items():
            table = Path(tmp) / f"c{c}.csv"
            cmd = [binary, "-m", "cosmos3", "-i", "grpc", "-u", url, "--streaming", "--input-data", str(data),
                   "--concurrency-range", f"{c}:{c}", "--measurement-mode", "count_windows",
                   "--measurement-request-count", str(n), "--max-trials", "3", "--stability-percentage", "50",
                   "-f", str(table)]  # fmt: skip
            try:
                run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            except subprocess.TimeoutExpired:
                print(f"perf_analyzer c={c}: no result within 900 s", flush=True)
                continue
            if run.returncode or not table.exists():
                print(
                    f"perf_analyzer c={c} failed ({run.returncode}):\n{(run.stdout + run.stderr)[-2000:]}", flush=True
                )
                continue
            row = next(csv.DictReader(table.read_text().splitlines()))
            out[c] = {"infer_per_s": float(row["Inferences/Second"]), "command": " ".join(cmd),
                      **{k.replace(" ", "_"): float(row[k]) / 1e6 for k in row if k.endswith("latency")}}  # fmt: skip
            print(f"perf_analyzer c={c}: {60 * out[c]['infer_per_s']:.2f} videos/min, "
                  f"p50 latency {out[c].get('p50_latency', float('nan')):.2f}s", flush=True)  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/bench_edge.yaml")
    ap.add_argument("--c1", type=int, default=3, help="sequential single-shot requests")
    ap.add_argument("--c4", type=int, default=8, help="single-shot requests at concurrency 4")
    ap.add_argument(
        "--frames", type=int, nargs="+", default=[], help="then --c1 single-shot requests at each frame count"
    )
    ap.add_argument("--ar", type=int, default=0, help="AR streams at c=1 and at c=4 (×4)")
    ap.add_argument("--ar-params", default='{"window_mode": "chained", "num_frames": 45}')
    ap.add_argument("--params", default="{}", help="JSON request parameters for single-shot runs")
    ap.add_argument(
        "--inprocess", type=int, default=0, help="then N single-shot requests through our in-process engine"
    )
    ap.add_argument(
        "--diffusers", type=int, default=0, help="then N through diffusers' Cosmos3OmniPipeline (same weights)"
    )
    ap.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), help="single-shot request kinds, each --c1 requests at c=1"
    )
    ap.add_argument("--diffusers-variants", nargs="+", choices=list(VARIANTS), help="default: all --variants")
    ap.add_argument(
        "--no-server", action="store_true",
        help="only diffusers' runs of --variants (--diffusers N), no server: the other half of a side-by-side run "
        "whose two halves do not fit one device call (run on the same machine, one after the other)",
    )  # fmt: skip
    ap.add_argument("--action", default="{}", help=f"JSON over the action variants' `action` (default {ACTION})")
    ap.add_argument("--c4-variants", nargs="+", choices=list(VARIANTS), help="then --c4 requests of each at c=4")
    ap.add_argument("--c8", type=int, default=0, help="then N requests at concurrency 8 of each --c8-variants kind")
    ap.add_argument("--c8-variants", nargs="+", choices=list(VARIANTS), help="default: all --variants")
    ap.add_argument(
        "--perf-analyzer", default="", help="then perf_analyzer (this binary) at c=1 and c=4 on the same request"
    )
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=YAML",
        help="override a top-level config key (e.g. precision=fp8, pool_pages=8192, warmup_requests='[{...}]')",
    )  # fmt: skip
    ap.add_argument("--json", default="")
    ap.add_argument("--md", default="", help="append a row (date, GPU, command, figures) to this file")
    args = ap.parse_args()
    if args.diffusers_variants and not set(args.diffusers_variants) <= set(args.variants or ()):
        ap.error("--diffusers-variants must be among --variants")
    if args.variants and args.c1 < 1:
        ap.error("--variants runs --c1 requests of each kind: --c1 must be at least 1")
    if (args.c8 or args.c8_variants) and not args.variants:
        ap.error("--c8 runs --variants kinds: give --variants")
    if args.c8_variants and not set(args.c8_variants) <= set(args.variants or ()):
        ap.error("--c8-variants must be among --variants")
    if args.c4_variants and not (args.c4 and set(args.c4_variants) <= set(args.variants or ())):
        ap.error("--c4-variants runs --c4 requests of --variants kinds: give both")
    if args.variants and args.c4 and not args.c4_variants:
        ap.error("with --variants, --c4 runs the --c4-variants kinds: give --c4-variants, or --c4 0")
    pa_kind = (args.c4_variants or ["t2v"])[-1]
    if args.perf_analyzer and VARIANTS[pa_kind][1] is not None:
        ap.error(f"--perf-analyzer sends a prompt and parameters only: {pa_kind} needs a conditioning input")
    if args.no_server and not (args.variants and args.diffusers):
        ap.error("--no-server runs diffusers on --variants kinds: give --variants and --diffusers N")
    overrides = parse_sets(args.set)
    # `start` resolves `random:` into a path; side_by_side needs the name
    configured = Deployment.load(args.config, **overrides)
    if args.no_server:
        params = json.loads(args.params)
        size = (params.get("height", configured.defaults.height), params.get("width", configured.defaults.width))
        chosen = {v: variant_request(v, params, *size, json.loads(args.action))
                  for v in args.diffusers_variants or args.variants}  # fmt: skip
        for name, r in diffusers_variants(configured, chosen, args.diffusers).items():
            print(f"diffusers {name:10s} e2e p50 {statistics.median(r['e2e']):7.2f}s  (n={len(r['e2e'])}, "
                  f"{r['steps']} steps)  skipped {100 * r['skipped_fraction']:.0f}%")  # fmt: skip
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="cosmos3-bench-"))
    proc, ports, deployment = start(configured, workdir)
    url = f"127.0.0.1:{ports[0]}"
    result: dict = {"config": args.config}
    params = json.loads(args.params)
    size = (params.get("height", configured.defaults.height), params.get("width", configured.defaults.width))
    action = json.loads(args.action)
    requests = {v: variant_request(v, params, *size, action) for v in args.variants or ()}
    c8 = set(args.c8_variants or requests) if args.c8 else set()
    try:
        result["floors"] = floors(deployment, requests)
        result["startup_s"] = wait_until_ready(ports[1], proc=proc, timeout_s=900)
        ar = json.loads(args.ar_params)
        for name, (p, image, clip, raw) in requests.items():  # each kind's first-request effects, then its requests
            t0 = time.perf_counter()
            first = p if "cache" in p else {**p, "steps": 2}  # a cached request's skips (new layouts) come later
            generate(url, PROMPT, first, image, video=clip, raw_actions=raw)
            print(f"{name}: {first.get('steps', 'all')}-step first request {time.perf_counter() - t0:.1f}s", flush=True)
            result[f"c1:{name}"] = drive(url, p, args.c1, 1, image, clip, raw)
            print(f"{name}: c=1 e2e {' / '.join(f'{x:.2f}' for x in result[f'c1:{name}']['e2e'])} s", flush=True)
            if name in (args.c4_variants or ()):
                r = result[f"c4:{name}"] = drive(url, p, args.c4, 4, image, clip, raw)
                print(f"{name}: c=4 {args.c4} requests in {r['wall_s']:.1f}s", flush=True)
            if name in c8:  # the packed shapes' first-use effects (eager first runs, captures), then the timed run
                burst = drive(url, {**p, "steps": 2}, 8, 8, image, clip, raw)
                print(f"{name}: c=8 burst of 8 2-step requests {burst['wall_s']:.1f}s", flush=True)
                r = result[f"c8:{name}"] = drive(url, p, args.c8, 8, image, clip, raw)
                rate = f", {r['actions_per_s']:.2f} actions/s" if "actions_per_s" in r else ""
                print(f"{name}: c=8 {args.c8} requests in {r['wall_s']:.1f}s{rate}", flush=True)
        if not requests:
            generate(url, PROMPT, {**(params if args.c1 or args.c4 else ar), "steps": 2})  # first-request effects
        if args.c1 and not requests:
            result["c1"] = drive(url, params, args.c1, 1)
            for frames in args.frames:  # another length on the same server: its first request untimed
                generate(url, PROMPT, {**params, "num_frames": frames, "steps": 2})
                result[f"c1@{frames}"] = drive(url, {**params, "num_frames": frames}, args.c1, 1)
        if args.c4 and not requests:
            result["c4"] = drive(url, params, args.c4, 4)
        if args.ar:
            result["ar_c1"] = drive(url, ar, args.ar, 1)
            result["ar_c4"] = drive(url, ar, 4 * args.ar, 4)
        if args.perf_analyzer:  # the last c=4 kind (or the single request), on this server
            name = (args.c4_variants or [None])[-1]
            p = requests[name][0] if name else params
            result["perf_analyzer"] = {"variant": name or "t2v",
                                       **perf_analyzer(args.perf_analyzer, url, p, {1: max(args.c1, 2), 4: max(args.c4, 4)})}  # fmt: skip
    except Exception as e:  # noqa: BLE001
        print(
            f"benchmark failed: {e}\n--- server log tail ---\n{(workdir / 'tritonserver.log').read_text()[-3000:]}",
            file=sys.stderr,
        )
        return 1
    finally:
        stop_server(proc)
    if "c1:t2v" in result and "c1:t2v+sound" in result:  # printed now too, in case diffusers does not finish
        print(sound_cost(result), flush=True)
    if args.json:  # the served figures are kept whatever happens next
        Path(args.json).write_text(json.dumps(result, indent=1))
    if requests and args.diffusers:  # same run, same requests, once the server has released the GPU
        chosen = {v: requests[v] for v in args.diffusers_variants or requests}
        result["diffusers_variants"] = diffusers_variants(configured, chosen, args.diffusers)
    if args.inprocess or (args.diffusers and not requests):  # same run, same request, once the server is gone
        result |= side_by_side(configured, params, args.inprocess, 0 if requests else args.diffusers)
    keys = [*(f"c{c}:{v}" for v in requests for c in (1, 4, 8)), "c1", *(f"c1@{f}" for f in args.frames), "c4",
            "ar_c1", "ar_c4"]  # fmt: skip
    for key in keys:
        if key in result:
            r = result[key]
            extra = f"  TTFC p50 {r['ttfc_p50']:.2f}s" + (
                f"  chunk gap p50 {r['chunk_gap_p50']:.2f}s" if "chunk_gap_p50" in r else ""
            )
            if "audio_shape" in r:
                extra += f"  audio {r['audio_shape']}"
            if "actions_per_s" in r:
                extra += f"  actions/s {r['actions_per_s']:.2f}  actions {r['actions_shape']}"
            print(f"{key:6s} n={r['count']:2d}  e2e p50 {r['e2e_p50']:7.2f}s  videos/min {r['videos_per_min']:6.2f}  "
                  f"frames/s {r['frames_per_s']:6.1f}{extra}  skipped {100 * r['skipped_fraction']:.0f}%")  # fmt: skip
            print("        server-side p50: " + "  ".join(f"{k} {v:.2f}" for k, v in r["server_p50"].items()))
            name = key.split(":", 1)[-1]
            if ":" in key and name in result["floors"]:
                print(floor_line(key, r, result["floors"][name]))
    for c, r in ((c, r) for c, r in result.get("perf_analyzer", {}).items() if c != "variant"):
        name = result["perf_analyzer"]["variant"]
        ours = result.get(f"c{c}:{name}") or result.get(f"c{c}", {})
        print(f"perf_analyzer c={c} {name}: {60 * r['infer_per_s']:.2f} videos/min, "
              f"p50 latency {r.get('p50_latency', float('nan')):.2f}s"
              f"  (bench.served: {ours.get('videos_per_min', float('nan')):.2f} videos/min, "
              f"e2e p50 {ours.get('e2e_p50', float('nan')):.2f}s)")  # fmt: skip
    print(f"server startup (load + compile + warmup) {result['startup_s']:.0f}s")
    for key in ("inprocess", "diffusers"):
        if key in result:
            print(f"{key:10s} e2e p50 {statistics.median(result[key]['e2e']):7.2f}s  (n={len(result[key]['e2e'])})  "
                  f"skipped {100 * result[key]['skipped_fraction']:.0f}%")  # fmt: skip
    if "c1:t2v" in result and "c1:t2v+sound" in result:
        print(sound_cost(result))
    for name, r in result.get("diffusers_variants", {}).items():
        theirs = statistics.median(r["e2e"])
        served = result.get(f"c1:{name}", {}).get("e2e_p50")
        vs = f"  diffusers / served c=1: {theirs / served:.2f}x" if served else ""
        if name in result["floors"]:
            vs += f"  e2e/floor {theirs / result['floors'][name]['floor_s']:.2f}x"
        print(f"diffusers {name:10s} e2e p50 {theirs:7.2f}s  (n={len(r['e2e'])}, {r['steps']} steps)"
              f"  skipped {100 * r['skipped_fraction']:.0f}%{vs}")  # fmt: skip
    if "t2v" in result.get("diffusers_variants", {}):  # every served t2v kind against diffusers uncached
        theirs = statistics.median(result["diffusers_variants"]["t2v"]["e2e"])
        for key in (k for k in keys if k.startswith("c1:t2v") and k in result):
            print(f"diffusers t2v (uncached) / served {key}: {theirs / result[key]['e2e_p50']:.2f}x")
    if "c1" in result and "diffusers" in result:
        served, theirs = result["c1"]["e2e_p50"], statistics.median(result["diffusers"]["e2e"])
        print(f"diffusers / served c=1 e2e: {theirs / served:.2f}x")
        if "inprocess" in result:
            ours = statistics.median(result["inprocess"]["e2e"])
            print(f"served / in-process e2e: {served / ours:.3f}  (server-side denoise {result['c1']['server_p50']['denoise_s']:.2f}s "
                  f"vs in-process {statistics.median(result['inprocess']['phases']['denoise']):.2f}s)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.md:
        from .report import append_row

        figures: dict = {}
        for name, r in result.get("diffusers_variants", {}).items():
            figures[f"diffusers {name} e2e s"] = statistics.median(r["e2e"])
        for key in keys:
            if key in result:
                r = result[key]
                figures |= {f"{key} e2e p50 s": r["e2e_p50"], f"{key} videos/min": r["videos_per_min"],
                            f"{key} TTFC p50 s": r["ttfc_p50"], f"{key} frames/s": r["frames_per_s"]}  # fmt: skip
                if "chunk_gap_p50" in r:
                    figures[f"{key} chunk gap p50 s"] = r["chunk_gap_p50"]
                if "actions_per_s" in r:
                    figures[f"{key} actions/s"] = r["actions_per_s"]
                figures[f"{key} server denoise p50 s"] = r["server_p50"]["denoise_s"]
                figures[f"{key} skipped"] = r["skipped_fraction"]
                if ":" in key and key.split(":", 1)[1] in result["floors"]:
                    floor = result["floors"][key.split(":", 1)[1]]
                    figures[f"{key} {floor['card']} floor s"] = floor["floor_s"]
        figures["startup s"] = result["startup_s"]
        print(append_row(args.md, None, figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
