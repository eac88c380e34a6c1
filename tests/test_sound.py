"""Sound pieces (`cosmos3_core.model.sound`) against the pipeline's own functions on a tiny sound checkpoint
(`make_tiny(..., sound=True)`): latent shape, noise order, rotary ids, tokenizer decode; and the checkpoint itself
(loads with `Cosmos3OmniPipeline`, runs t2v + sound, weights shared with the plain checkpoint, no zero terms)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.model.sound import SoundSpec, decode_sound, initial_noise, load_sound_tokenizer, sound_position_ids
from cosmos3_core.tools.make_tiny import make_tiny
from tests.conftest import reference_pipeline

WEIGHTS = "transformer/diffusion_pytorch_model.safetensors"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("sound") / "nano", variant="nano", seed=7, sound=True)


@pytest.fixture(scope="module")
def pipe(ckpt):
    return reference_pipeline(ckpt)


@pytest.fixture(scope="module")
def spec(ckpt):
    return SoundSpec.open(ckpt)


def prepare(pipe, num_frames: int, fps: float, seed: int = 0, hw: int = 16):
    out = pipe.prepare_latents(
        num_frames=num_frames,
        height=hw,
        width=hw,
        fps=fps,
        generator=torch.Generator().manual_seed(seed),
        device="cpu",
        dtype=torch.float32,
        enable_sound=True,
    )
    return out[0], out[1], out[4]  # vision latents, sound latents, sound fps


def test_spec(spec):
    assert spec == SoundSpec(sound_dim=8, latent_fps=25.0, sampling_rate=48000, hop_size=1920, channels=2)


@pytest.mark.parametrize("num_frames,fps", [(17, 24.0), (189, 24.0), (121, 30.0), (9, 16.0), (61, 23.976), (5, 7.0)])
def test_latent_shape(pipe, spec, num_frames, fps):
    _, sound, sound_fps = prepare(pipe, num_frames, fps)
    assert spec.latent_shape(num_frames, fps) == tuple(sound.shape)
    assert sound_fps == spec.latent_fps


@pytest.mark.parametrize("num_frames,hw", [(17, 16), (9, 32)])
def test_noise_order(pipe, spec, num_frames, hw):
    """Sound noise is the generator's next draw after the full vision noise."""
    vision, sound, _ = prepare(pipe, num_frames, 24.0, seed=11, hw=hw)
    v, s = initial_noise(tuple(vision.shape), spec.latent_shape(num_frames, 24.0), seed=11)
    assert torch.equal(v, vision) and torch.equal(s, sound)


@pytest.mark.parametrize("sound_len", [1, 2, 13, 200])
@pytest.mark.parametrize("text_len", [5, 41])
@pytest.mark.parametrize("fps_mod,reset", [(True, True), (False, True), (True, False)])
def test_position_ids(pipe, ckpt, sound_len, text_len, fps_mod, reset):
    cfg = dataclasses.replace(
        Checkpoint.open(ckpt).config, enable_fps_modulation=fps_mod, reset_spatial_ids=reset
    )  # the pipeline reads the same two switches from the transformer config
    saved = dict(pipe.transformer.config)
    pipe.transformer.register_to_config(enable_fps_modulation=fps_mod, unified_3d_mrope_reset_spatial_ids=reset)
    try:
        text = pipe._prepare_text_segment(list(range(text_len)), device="cpu")
        seg = pipe._prepare_sound_segment(
            torch.zeros(8, sound_len), text["vision_start_temporal_offset"], 25.0, curr=text_len + 6, device="cpu"
        )
    finally:
        pipe.transformer.register_to_config(
            enable_fps_modulation=saved["enable_fps_modulation"],
            unified_3d_mrope_reset_spatial_ids=saved["unified_3d_mrope_reset_spatial_ids"],
        )
    ref = seg["sound_mrope_ids"]
    ours = sound_position_ids(cfg, sound_len, text_len, latent_fps=25.0)
    assert ours.shape == ref.shape == (3, sound_len)
    assert torch.equal(ours, ref.to(torch.float32))


def test_position_ids_values(ckpt):
    """The grid itself: 24/25 per latent (not x4 like vision), h = w = 0, starting at text_len + margin."""
    cfg = Checkpoint.open(ckpt).config
    ids = sound_position_ids(cfg, 3, 10)
    base = 10 + cfg.temporal_modality_margin
    assert torch.allclose(ids[0], torch.tensor([0.0, 0.96, 1.92]) + base) and not ids[1:].any()


@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("sound_len", [1, 7, 26])
def test_decode_equals_pipeline(pipe, ckpt, spec, sound_len, fold):
    tok = load_sound_tokenizer(ckpt, fold=fold)
    latents = torch.randn(8, sound_len, generator=torch.Generator().manual_seed(sound_len))
    ref = pipe.decode_sound(latents)
    ours = decode_sound(tok, latents)
    assert ours.shape == ref.shape == (2, spec.samples(sound_len)) and ours.dtype == torch.float32
    assert torch.equal(ours, ref)
    assert (ours.abs() < 1).float().mean() > 0.95 and ours.abs().max() > 0.01  # mostly unclamped: differences show


def test_pipeline_runs_t2v_with_sound(pipe, spec):
    out = pipe(
        prompt="rain on a tin roof",
        num_frames=9,
        height=32,
        width=32,
        num_inference_steps=2,
        enable_sound=True,
        generator=torch.Generator().manual_seed(0),
        output_type="latent",
        enable_safety_check=False,
    )
    assert tuple(out.sound.shape) == (2, spec.samples(spec.latent_frames(9, 24.0)))
    assert out.sound.abs().max() <= 1 and out.sound.std() > 0.01


def test_checkpoint_parts(ckpt, tmp_path):
    """Sound weights and a tokenizer present, zero-initialised terms redrawn, our transformer loader still loads it."""
    w = load_file(ckpt / WEIGHTS)
    assert {"audio_proj_in.weight", "audio_proj_out.weight", "audio_modality_embed"} <= set(w)
    assert w["audio_modality_embed"].abs().mean() > 0.3
    tok = load_file(ckpt / "sound_tokenizer" / "diffusion_pytorch_model.safetensors")
    snake = [v for k, v in tok.items() if k.endswith((".alpha", ".beta"))]
    assert snake and all(v.abs().min() > 0 for v in snake) and torch.cat([v.flatten() for v in snake]).std() > 0.3
    from cosmos3_core.model.layers import GEN, UND

    Checkpoint.open(ckpt).load_transformer({UND, GEN}, "cpu", torch.float32)


def test_base_weights_equal_plain_checkpoint(ckpt, tmp_path):
    plain = make_tiny(tmp_path / "plain", variant="nano", seed=7)
    a, b = load_file(plain / WEIGHTS), load_file(ckpt / WEIGHTS)
    assert set(a) < set(b) and all(torch.equal(a[k], b[k]) for k in a)
    va, vb = (load_file(c / "vae/diffusion_pytorch_model.safetensors") for c in (plain, ckpt))
    assert va.keys() == vb.keys() and all(torch.equal(va[k], vb[k]) for k in va)
    with pytest.raises(ValueError, match="sound_tokenizer"):
        SoundSpec.open(plain)


def test_no_sound_gen_is_an_error(ckpt, tmp_path):
    root = shutil.copytree(ckpt, tmp_path / "c", ignore=shutil.ignore_patterns("*.safetensors"))
    cfg_path = root / "transformer" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["sound_gen"] = False
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="sound_gen"):
        SoundSpec.open(root)
