"""Offline CLI: the three serving stages chained in one process.

  python -m cosmos3_core.generate --checkpoint DIR --prompt P [--negative-prompt N] [--image IMG]
      [--video CLIP.mp4|.npy --condition-frames 0,1 --condition-keep first|last] [--sound --audio-out A.wav|.pt]
      [--action-mode policy|forward_dynamics|inverse_dynamics --chunk-size N --domain D --resolution-tier R
       [--view-point V] [--raw-actions A.npy] [--actions-out A.npy|.pt]  (with --image or --video)]
      [--height H --width W --num-frames F --fps R --steps S --guidance G --shift X --seed K]
      [--no-system-prompt] [--no-templates] [--cache '{"policy": "sea", ...}'] [--lora DIR --lora-scale S]
      [--window-mode chained|kv [--window-frames N --overlap-frames N --context-frames N --max-windows N]
       [--then PROMPT ... --then-frames N]]
      --out FILE(.mp4|.png|.npy|.pt)

AR windows run offline too. `--then PROMPT` (repeatable; "" for the same prompt) is the session loop in one process:
the stream keeps its session (docs/requests.md#sessions) and each `--then` continues it with `--then-frames` more
frames (default: one window's), re-prompted where its prompt differs, as `python -m client stream --continue` does
against a server; the output is the whole video.

`.pt` holds the final latents [1, C, T, h, w] fp32 (the reference pipeline's `output_type="latent"`);
`.npy` the uint8 frames [T, H, W, 3]. `--actions-out` (policy, inverse dynamics) writes the actions float32
[chunk, D]; its `.pt` holds exactly the pipeline's `out.action[0]`. With step caching, the steps each CFG branch
skipped are printed, as the server's `done` event reports them. Bad arguments print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .caches import use_kernel_caches
from .deployment import DEFAULT_CONFIG, Deployment, parse_sets
from .engine import DenoiseEngine
from .inputs import load_image, load_raw_actions, load_video
from .media import (
    AUDIO_SUFFIXES,
    FRAME_SUFFIXES,
    write_actions,
    write_audio,
    write_frames,
)
from .model.checkpoint import Checkpoint
from .model.config import CheckpointError
from .parallel.group import Group
from .requests import RequestError, add_request_arguments, params_from_arguments, warmup_inputs
from .safety import Refused
from .stages import DecodeStage, PrefillStage
from .wire import ChunkInfo, PrefillResult

OUT_SUFFIXES = (*FRAME_SUFFIXES, ".pt")
CLI_ACTION_SUFFIXES = (".npy", ".pt")  # the client writes .json too (media.ACTION_SUFFIXES)


@dataclass(frozen=True)
class Generated:
    latents: torch.Tensor  # the final vision latents [1, C, T, h, w] fp32 (the pipeline's output_type="latent")
    sound: torch.Tensor | None  # enable_sound: the sound latents [sound_dim, T_s] fp32
    actions: (
        torch.Tensor | None
    )  # policy / inverse dynamics: [chunk, raw_action_dim] fp32 (the pipeline's out.action[0])
    info: ChunkInfo  # the engine's info of the last piece, as the `done` event carries it (timings, cache_skipped)


class Generator:
    """Prefill → engine → decode in one process; what the CLI, tests and the in-process benchmark run."""

    def __init__(self, deployment: Deployment, checkpoint: Checkpoint | None = None):
        self.ckpt = checkpoint or deployment.open_checkpoint()
        # the memory plan's pool and step bound, and on CUDA the largest admitted request in the warmup
        self.deployment = d = deployment.planned(self.ckpt)[0]
        device = d.torch_device
        self.prefill = PrefillStage.from_deployment(self.ckpt, d, device)  # the deployment's guardrail, as served
        # one group for the denoise and the decode ranks (parallel/group.py), when the deployment splits either
        self.group = Group(d.worker_spec(self.ckpt.root, ("denoise", "decode"))) if d.parallel.ranks > 1 else None
        self.engine = DenoiseEngine.from_deployment(self.ckpt, d, group=self.group)
        self.engine.warmup(
            [self.prefill.validate("warmup", r, *warmup_inputs(r, d.defaults)) for r in d.warmup_requests]
        )
        self.decode = DecodeStage.from_deployment(self.ckpt, d, device, self.group)

    def close(self) -> None:
        """End the worker processes, if the deployment has a group (they also end when this process does)."""
        if self.group is not None:
            self.group.close()

    def generate(
        self,
        prompt: str,
        params: dict,
        image: np.ndarray | None = None,
        progress: bool = False,
        video: np.ndarray | None = None,
        raw_actions: np.ndarray | None = None,
    ) -> Generated:
        """A request's final vision latents, sound latents and actions (as it has them)."""
        p = self.prefill.validate(prompt, params, image, video, raw_actions)
        return self.run(self.prefill.run(p, image, video, raw_actions), progress)

    def session(self, prompt: str, params: dict, then: list[tuple[str, dict]], progress: bool = False) -> Generated:
        """An AR stream that keeps its session, then each of `then`'s (prompt, parameters) continuing it (the last one
        not keeping it) → the whole video's latents, and the last request's info. A continuation's prompt "" is the
        stream's own."""
        p = self.prefill.validate(prompt, {**params, "session": {"keep": bool(then)}}, None)
        out = [self.run(self.prefill.run(p, None), progress)]
        for i, (text, more) in enumerate(then):
            ident = out[-1].info["session_id"]
            kept = self.engine.scheduler.session_info(ident)
            q = self.prefill.validate(text or prompt, {**more, "session": {"continue": ident, "keep": i < len(then) - 1}},
                                      None, kept=None if kept is None else kept.params)  # fmt: skip
            out.append(self.run(self.prefill.run(q, None, reuse=kept.params.text_digest), progress))  # type: ignore[union-attr]
        return Generated(torch.cat([g.latents for g in out], dim=2), None, None, out[-1].info)

    def latents(self, prompt: str, params: dict, image: np.ndarray | None = None, **kw: Any) -> torch.Tensor:
        """`generate`'s vision latents (same arguments)."""
        return self.generate(prompt, params, image, **kw).latents

    def latents_from(self, prefilled: PrefillResult, progress: bool = False) -> torch.Tensor:
        return self.run(prefilled, progress).latents

    def run(self, prefilled: PrefillResult, progress: bool = False) -> Generated:
        return self.run_together([prefilled], progress)[0]

    def run_together(self, prefilled: list[PrefillResult], progress: bool = False) -> list[Generated]:
        """Submit every request, then run the engine until idle: they share its ticks (packed steps) as concurrent
        requests to a server do → each one's result, in order."""
        sinks = [_CollectSink(p.params.steps, progress) for p in prefilled]
        for p, sink in zip(prefilled, sinks):
            self.engine.submit(p, sink)
        self.engine.run_until_idle()
        for sink in sinks:
            if sink.failure is not None:
                raise RuntimeError(sink.failure)
        return [Generated(s.latents, s.sound, s.actions, s.info) for s in sinks]  # type: ignore[arg-type]

    def frames_and_audio(
        self, prompt: str, params: dict, image: np.ndarray | None = None, video: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """uint8 frames and the waveform float32 [2, S] ([0, 0] without sound), as the server returns them."""
        out = self.generate(prompt, params, image, video=video)
        return self.decode.run(out.latents, params.get("enable_safety_check", True)), self.decode.audio(out.sound)

    def frames(self, prompt: str, params: dict, image: np.ndarray | None = None, **kw: Any) -> np.ndarray:
        """The uint8 frames of `frames_and_audio` (same arguments)."""
        return self.frames_and_audio(prompt, params, image, **kw)[0]


class _CollectSink:
    """Joins AR chunks along time; `latents` is the whole video's [1, C, T, h, w] once done."""

    def __init__(self, steps: int, progress: bool):
        self.chunks: list[torch.Tensor] = []
        self.latents: torch.Tensor | None = None
        self.sound: torch.Tensor | None = None
        self.actions: torch.Tensor | None = None
        self.info: ChunkInfo | None = None  # the done piece's
        self.failure: str | None = None
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(desc="denoise", unit="step", file=sys.stderr)

    def progress(self, step: int, steps: int, window: int, windows: int) -> None:
        if self.bar is not None:  # a continuation's windows count on from its session's
            self.bar.total = steps * windows
            self.bar.update(window * steps + step - self.bar.n)

    def chunk(self, latents: torch.Tensor, info: dict) -> None:
        self.chunks.append(latents)

    def done(
        self, latents: torch.Tensor, info: dict, sound: torch.Tensor | None = None, actions: torch.Tensor | None = None
    ) -> None:
        self.latents = torch.cat([*self.chunks, latents], dim=2)
        self.sound, self.actions, self.info = sound, actions, info
        if self.bar is not None:
            self.bar.close()

    def error(self, message: str) -> None:
        self.failure = message

    def cancelled(self) -> bool:
        return False


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m cosmos3_core.generate", description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoint", default="", help="checkpoint dir (diffusers layout); default: the tiny one")
    ap.add_argument(
        "--config", default=str(DEFAULT_CONFIG), help="deployment YAML (defaults, limits, device, dtype); default: "
        "the server's default, configs/tiny.yaml"
    )  # fmt: skip
    add_request_arguments(ap, windows=True)
    ap.add_argument("--then", action="append", default=[], metavar="PROMPT",
                    help='continue the AR stream\'s session with this prompt ("": the same); repeatable')  # fmt: skip
    ap.add_argument("--then-frames", type=int, help="new frames per --then (a multiple of 4; default: one window's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=YAML",
                    help="override a top-level config key, e.g. precision=fp8 (as the server takes it)")  # fmt: skip
    ap.add_argument("--device")
    ap.add_argument("--dtype")
    ap.add_argument("--out", required=True, help="output file: " + ", ".join(OUT_SUFFIXES))
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    use_kernel_caches()
    out = Path(args.out)
    try:
        if out.suffix not in OUT_SUFFIXES:
            raise RequestError("out", f"suffix must be one of {', '.join(OUT_SUFFIXES)}, got {out.suffix or 'none'!r}")
        if args.audio_out and (not args.enable_sound or Path(args.audio_out).suffix not in AUDIO_SUFFIXES):
            raise RequestError("audio_out", f"needs --sound and a suffix in {', '.join(AUDIO_SUFFIXES)}")
        if args.actions_out and Path(args.actions_out).suffix not in CLI_ACTION_SUFFIXES:
            raise RequestError("actions_out", f"suffix must be one of {', '.join(CLI_ACTION_SUFFIXES)}")
        lora_dir = None
        if args.lora:  # a folder save_lora_adapter wrote: served from its parent, by its name
            lora_dir, args.lora = str(Path(args.lora).resolve().parent), Path(args.lora).resolve().name
        flags = {
            "checkpoint": args.checkpoint or None,
            "device": args.device,
            "dtype": args.dtype,
            "lora_dir": lora_dir,
        }
        overrides = {**parse_sets(args.set), **{k: v for k, v in flags.items() if v is not None}}
        deployment = Deployment.load(args.config, **overrides)
        ckpt = deployment.open_checkpoint()
        image = load_image(args.image) if args.image else None
        video = load_video(args.video) if args.video else None
        raw_actions = load_raw_actions(args.raw_actions) if args.raw_actions else None
        params = params_from_arguments(args)
        gen = Generator(deployment, ckpt)
        p = gen.prefill.validate(args.prompt, params, image, video, raw_actions)  # fail fast, before any work
        if args.actions_out and not p.returns_actions:
            raise RequestError("actions_out", "only policy and inverse_dynamics return actions")
        print(f"parameters {json.dumps(p.resolved())}", file=sys.stderr)
        if args.then:
            if p.window_mode == "none":
                raise RequestError("then", "continues an AR stream's session: needs --window-mode chained or kv")
            more = {} if args.then_frames is None else {"num_frames": args.then_frames}
            result = gen.session(args.prompt, params, [(t, more) for t in args.then], progress=True)
        else:
            result = gen.generate(args.prompt, params, image, progress=True, video=video, raw_actions=raw_actions)
    except (RequestError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if "cache_skipped" in result.info:
        print(f"cache_skipped {json.dumps(result.info['cache_skipped'])}", file=sys.stderr)
    audio = gen.decode.audio(result.sound) if result.sound is not None else None
    if out.suffix == ".pt":
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(result.latents.cpu(), out)
    else:
        try:  # the video guardrail, as the server runs it (the latents of a .pt are not checked, as the pipeline's)
            frames = gen.decode.run(result.latents, p.enable_safety_check)
        except Refused as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        write_frames(out, frames, p.fps, audio)  # .mp4 carries the audio track
    print(f"wrote {out}", file=sys.stderr)
    if args.audio_out and audio is not None:
        write_audio(args.audio_out, audio)
        print(f"wrote {args.audio_out}", file=sys.stderr)
    if args.actions_out and result.actions is not None:
        write_actions(args.actions_out, result.actions.cpu().numpy())
        print(f"wrote {args.actions_out}: actions {list(result.actions.shape)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
