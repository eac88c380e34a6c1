"""Offline CLI: the three serving stages chained in one process.

  python -m cosmos3_core.generate --checkpoint DIR --prompt P [--negative-prompt N] [--image IMG]
      [--video CLIP.mp4|.npy --condition-frames 0,1 --condition-keep first|last] [--sound --audio-out A.wav|.pt]
      [--height H --width W --num-frames F --fps R --steps S --guidance G --shift X --seed K]
      [--no-system-prompt] [--no-templates] --out FILE(.mp4|.png|.npy|.pt)

`.pt` holds the final latents [1, C, T, h, w] fp32 (the reference pipeline's `output_type="latent"`);
`.npy` the uint8 frames [T, H, W, 3]. Bad arguments print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .deployment import DEFAULT_CONFIG, Deployment
from .engine import DenoiseEngine
from .media import AUDIO_SUFFIXES, FRAME_SUFFIXES, write_audio, write_frames
from .model.checkpoint import Checkpoint
from .model.config import CheckpointError
from .requests import RequestError, add_request_arguments, params_from_arguments
from .stages import DecodeStage, PrefillStage
from .wire import PrefillResult

OUT_SUFFIXES = (*FRAME_SUFFIXES, ".pt")


class Generator:
    """Prefill → engine → decode in one process; what the CLI, tests and the in-process benchmark run."""

    def __init__(self, deployment: Deployment, checkpoint: Checkpoint | None = None):
        self.deployment = d = deployment
        self.ckpt = checkpoint or d.open_checkpoint()
        device, dtype = d.torch_device, d.torch_dtype
        self.prefill = PrefillStage(self.ckpt, device, dtype, d.defaults, d.limits)
        self.engine = DenoiseEngine.from_deployment(self.ckpt, d)
        self.engine.warmup([self.prefill.validate("warmup", r, None) for r in d.warmup_requests])
        self.decode = DecodeStage(self.ckpt, device, dtype, d.compile)

    def generate(
        self,
        prompt: str,
        params: dict,
        image: np.ndarray | None = None,
        progress: bool = False,
        video: np.ndarray | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """→ (final vision latents [1, C, T, h, w], sound latents [sound_dim, T_s] or None)."""
        p = self.prefill.validate(prompt, params, image, video)
        return self.run(self.prefill.run(p, image, video), progress)

    def latents(self, prompt: str, params: dict, image: np.ndarray | None = None, **kw: Any) -> torch.Tensor:
        """`generate`'s vision latents (same arguments)."""
        return self.generate(prompt, params, image, **kw)[0]

    def latents_from(self, prefilled: PrefillResult, progress: bool = False) -> torch.Tensor:
        return self.run(prefilled, progress)[0]

    def run(self, prefilled: PrefillResult, progress: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        sink = _CollectSink(prefilled.params.steps, progress)
        self.engine.submit(prefilled, sink)
        self.engine.run_until_idle()
        if sink.failure is not None:
            raise RuntimeError(sink.failure)
        return sink.latents, sink.sound

    def frames_and_audio(
        self, prompt: str, params: dict, image: np.ndarray | None = None, video: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """uint8 frames and the waveform float32 [2, S] ([0, 0] without sound), as the server returns them."""
        latents, sound = self.generate(prompt, params, image, video=video)
        return self.decode.run(latents), self.decode.audio(sound)

    def frames(self, prompt: str, params: dict, image: np.ndarray | None = None, **kw: Any) -> np.ndarray:
        """The uint8 frames of `frames_and_audio` (same arguments)."""
        return self.frames_and_audio(prompt, params, image, **kw)[0]


class _CollectSink:
    """Joins AR chunks along time; `latents` is the whole video's [1, C, T, h, w] once done."""

    def __init__(self, steps: int, progress: bool):
        self.chunks: list[torch.Tensor] = []
        self.latents: torch.Tensor | None = None
        self.sound: torch.Tensor | None = None
        self.failure: str | None = None
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(desc="denoise", unit="step", file=sys.stderr)

    def progress(self, step: int, steps: int, window: int, windows: int) -> None:
        if self.bar is not None:
            self.bar.total = steps * windows
            self.bar.update(1)

    def chunk(self, latents: torch.Tensor, info: dict) -> None:
        self.chunks.append(latents)

    def done(self, latents: torch.Tensor, info: dict, sound: torch.Tensor | None = None) -> None:
        self.latents = torch.cat([*self.chunks, latents], dim=2)
        self.sound = sound
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
    add_request_arguments(ap)
    ap.add_argument("--device")
    ap.add_argument("--dtype")
    ap.add_argument("--out", required=True, help="output file: " + ", ".join(OUT_SUFFIXES))
    return ap


def load_image(path: str) -> np.ndarray:
    import imageio.v2 as imageio

    try:
        img = np.asarray(imageio.imread(path))
    except Exception as e:  # noqa: BLE001 - any decoder failure is the same user error
        raise RequestError("image", f"cannot read {path!r} ({e})") from e
    if img.ndim == 2:
        img = np.stack([img] * 3, axis=-1)
    return np.ascontiguousarray(img[..., :3]).astype(np.uint8)


def load_video(path: str) -> np.ndarray:
    """A v2v clip: .npy (uint8 [T, H, W, 3], as stored) or a video imageio-ffmpeg reads (.mp4) → uint8 [T, H, W, 3]."""
    try:
        if path.endswith(".npy"):
            return np.load(path, allow_pickle=False)
        import imageio.v2 as imageio

        return np.stack([np.asarray(f)[..., :3] for f in imageio.mimread(path, memtest=False)]).astype(np.uint8)
    except Exception as e:  # noqa: BLE001 - any decoder failure is the same user error
        raise RequestError("video", f"cannot read {path!r} ({e})") from e


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    try:
        if out.suffix not in OUT_SUFFIXES:
            raise RequestError("out", f"suffix must be one of {', '.join(OUT_SUFFIXES)}, got {out.suffix or 'none'!r}")
        if args.audio_out and (not args.enable_sound or Path(args.audio_out).suffix not in AUDIO_SUFFIXES):
            raise RequestError("audio_out", f"needs --sound and a suffix in {', '.join(AUDIO_SUFFIXES)}")
        deployment = Deployment.load(
            args.config, checkpoint=args.checkpoint or None, device=args.device, dtype=args.dtype
        )
        ckpt = deployment.open_checkpoint()
        image = load_image(args.image) if args.image else None
        video = load_video(args.video) if args.video else None
        params = params_from_arguments(args)
        gen = Generator(deployment, ckpt)
        p = gen.prefill.validate(args.prompt, params, image, video)  # fail fast, before any work
        print(f"parameters {json.dumps(p.resolved())}", file=sys.stderr)
        latents, sound = gen.generate(args.prompt, params, image, progress=True, video=video)
    except (RequestError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    audio = gen.decode.audio(sound) if sound is not None else None
    if out.suffix == ".pt":
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(latents.cpu(), out)
    else:
        write_frames(out, gen.decode.run(latents), p.fps, audio)  # .mp4 carries the audio track
    print(f"wrote {out}", file=sys.stderr)
    if args.audio_out and audio is not None:
        write_audio(args.audio_out, audio)
        print(f"wrote {args.audio_out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
