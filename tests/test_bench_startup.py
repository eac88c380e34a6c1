"""`bench.decode_startup` (the vae_decode stage's load steps, timed on the GPU) runs its steps on the CPU too: a
smoke run on the tiny checkpoint, so the tool the next H200 session depends on does not first fail there."""

from __future__ import annotations

from pathlib import Path

from bench.decode_startup import child

CONFIGS = Path(__file__).parent.parent / "configs"


def test_decode_startup_times_each_load_step_and_the_videos():
    parts = child(str(CONFIGS / "tiny.yaml"), "benchmark")
    assert list(parts) == ["vae", "decoder", "first video", "steady video"]  # no compile warmup on the CPU
    assert all(s > 0 for s in parts.values()), parts


def test_the_compile_warmup_decodes_without_cudnn_benchmark_and_restores_it(nano_ckpt, monkeypatch):
    """`stages.warm_decoder` (the decode stage's compile warmup on CUDA) runs the decoder on its 1 + 4 + 1 frames
    with cuDNN's benchmark off (those shapes never serve) and leaves the process's setting as it found it."""
    import torch

    from cosmos3_core.model.checkpoint import Checkpoint
    from cosmos3_core.model.conditioning import VaeCodec
    from cosmos3_core.stages import warm_decoder

    ckpt = Checkpoint.open(nano_ckpt)
    codec = VaeCodec(ckpt.load_vae("cpu", torch.float32))
    seen = []
    decode = codec.decode
    monkeypatch.setattr(codec, "decode", lambda z: seen.append((torch.backends.cudnn.benchmark, z.shape)) or decode(z))
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    warm_decoder(codec, ckpt.config.latent_channel)
    assert seen == [(False, (1, ckpt.config.latent_channel, 6, 5, 7))]
    assert torch.backends.cudnn.benchmark
