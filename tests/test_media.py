"""mp4 with sound: H.264 + stereo AAC muxed by PyAV, read back with PyAV; the offline CLI's --sound .mp4 carries it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cosmos3_core.media import write_frames


def read_mp4(path: Path) -> tuple[int, list[tuple[int, int, float]]]:
    """→ (video frame count, [(channels, rate, seconds)] per audio stream)."""
    import av

    with av.open(str(path)) as c:
        assert len(c.streams.video) == 1
        audio = [(s.codec_context.layout.nb_channels, s.rate, s.codec_context.name) for s in c.streams.audio]
        frames = sum(1 for _ in c.decode(video=0))
    tracks = []
    for i, (channels, rate, codec) in enumerate(audio):
        assert codec == "aac"
        with av.open(str(path)) as c:
            samples = sum(f.samples for f in c.decode(audio=i))
        tracks.append((channels, rate, samples / rate))
    return frames, tracks


def test_mp4_with_audio(tmp_path):
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (9, 32, 48, 3), dtype=np.uint8)
    audio = rng.uniform(-0.5, 0.5, (2, 15 * 1920)).astype(np.float32)  # 0.6 s at 48 kHz
    write_frames(tmp_path / "a.mp4", frames, 16.0, audio)
    count, tracks = read_mp4(tmp_path / "a.mp4")
    assert count == 9 and len(tracks) == 1
    channels, rate, seconds = tracks[0]
    assert (channels, rate) == (2, 48000) and abs(seconds - 0.6) < 0.05  # AAC pads up to one 1024-sample frame
    write_frames(tmp_path / "b.mp4", frames, 16.0)
    assert read_mp4(tmp_path / "b.mp4") == (9, [])


def test_cli_mp4_carries_sound(tmp_path):
    from cosmos3_core.generate import main
    from cosmos3_core.tools.make_tiny import make_tiny

    ckpt = make_tiny(tmp_path / "nano", variant="nano", seed=7, sound=True)
    args = ["--checkpoint", str(ckpt), "--prompt", "surf", "--num-frames", "9", "--height", "32", "--width", "48"]
    assert main([*args, "--steps", "1", "--fps", "16", "--sound", "--out", str(tmp_path / "o.mp4")]) == 0
    count, tracks = read_mp4(tmp_path / "o.mp4")
    assert count == 9 and len(tracks) == 1 and tracks[0][:2] == (2, 48000) and abs(tracks[0][2] - 0.6) < 0.05
