"""Write generated frames: .mp4 (H.264 via imageio-ffmpeg; with audio, H.264 + AAC via PyAV), .png (first frame),
.npy (uint8 [T, H, W, 3]); the waveform; robot actions (float32 [chunk, D]: .npy, .pt, .json), and read raw actions.

numpy + imageio + av only, so the client can use it without torch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

FRAME_SUFFIXES = (".mp4", ".png", ".npy")
AUDIO_SUFFIXES = (".wav", ".pt", ".npy")
ACTION_SUFFIXES = (".npy", ".pt", ".json")


def write_actions(path: str | Path, actions: np.ndarray) -> None:
    """actions: float32 [chunk, D]. .npy as is; .pt a torch tensor (exactly the pipeline's `out.action[0]`); .json a
    list of rows."""
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".pt":
        import torch

        torch.save(torch.from_numpy(np.ascontiguousarray(actions)), path)
    elif path.suffix == ".npy":
        np.save(path, actions)
    elif path.suffix == ".json":
        path.write_text(json.dumps(actions.tolist()))
    else:
        raise ValueError(f"unsupported actions suffix {path.suffix!r}; use one of {', '.join(ACTION_SUFFIXES)}")


def read_raw_actions(path: str | Path) -> np.ndarray:
    """A forward-dynamics action sequence from .npy: floats become float32 (the wire's type); anything else is left
    for validation to name."""
    raw = np.load(path, allow_pickle=False)
    return raw.astype(np.float32) if raw.dtype.kind == "f" else raw


def write_audio(path: str | Path, audio: np.ndarray, rate: int = 48000) -> None:
    """audio: float32 [channels, samples] in [-1, 1]. .wav: 16-bit PCM (stdlib `wave`); .npy as is; .pt a torch
    tensor (exactly the pipeline's `out.sound`)."""
    import wave

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".pt":
        import torch

        torch.save(torch.from_numpy(np.ascontiguousarray(audio)), path)
    elif path.suffix == ".npy":
        np.save(path, audio)
    elif path.suffix == ".wav":
        pcm = np.round(np.clip(audio, -1, 1).T * 32767).astype("<i2")  # interleaved [samples, channels]
        with wave.open(str(path), "wb") as w:
            w.setnchannels(audio.shape[0])
            w.setsampwidth(2)
            w.setframerate(rate)
            w.writeframes(pcm.tobytes())
    else:
        raise ValueError(f"unsupported audio suffix {path.suffix!r}; use one of {', '.join(AUDIO_SUFFIXES)}")


def write_frames(
    path: str | Path, frames: np.ndarray, fps: float, audio: np.ndarray | None = None, sample_rate: int = 48000
) -> None:
    """frames: uint8 [T, H, W, 3]; audio (.mp4 only, ignored otherwise): float32 [2, S] in [-1, 1]."""
    import imageio.v2 as imageio

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".npy":
        np.save(path, frames)
    elif path.suffix == ".png":
        imageio.imwrite(path, frames[0])
    elif path.suffix == ".mp4":
        _write_mp4(path, frames, fps, audio if audio is not None and audio.size else None, sample_rate)
    else:
        raise ValueError(f"unsupported output suffix {path.suffix!r}; use one of {', '.join(FRAME_SUFFIXES)}")


def _write_mp4(path: Path, frames: np.ndarray, fps: float, audio: np.ndarray | None, sample_rate: int) -> None:
    """H.264 video (+ stereo AAC audio) in one mp4, encoded in this process by PyAV (its encoder regroups the
    samples into AAC frames). In process, not through an ffmpeg child: the client writes each streamed piece from
    inside a gRPC callback, where a child's pipe broke now and then (a newcomer's audit: 4 of 11 long streams)."""
    from fractions import Fraction

    import av

    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
        video.width, video.height = frames.shape[2], frames.shape[1]
        video.pix_fmt = "yuv444p" if frames.shape[1] % 2 or frames.shape[2] % 2 else "yuv420p"
        sound = container.add_stream("aac", rate=sample_rate, layout="stereo") if audio is not None else None
        for frame in frames:
            container.mux(video.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(video.encode())
        if sound is None:
            return
        planar = np.ascontiguousarray(np.clip(audio, -1, 1), dtype=np.float32)  # fltp: [channels, samples]
        samples = av.AudioFrame.from_ndarray(planar, format="fltp", layout="stereo")
        samples.sample_rate, samples.pts = sample_rate, 0
        container.mux(sound.encode(samples))
        container.mux(sound.encode())
