"""`bench.decode_startup` (the vae_decode stage's load steps, timed on the GPU) runs its steps on the CPU too: a
smoke run on the tiny checkpoint, so the tool the next H200 session depends on does not first fail there."""

from __future__ import annotations

from pathlib import Path

from bench.decode_startup import child

CONFIGS = Path(__file__).parent.parent / "configs"


def test_decode_startup_times_each_load_step_and_the_videos():
    parts = child(str(CONFIGS / "tiny.yaml"), "heuristics")
    assert list(parts) == ["vae", "decoder", "first video", "steady video"]  # no compile warmup on the CPU
    assert all(s > 0 for s in parts.values()), parts
