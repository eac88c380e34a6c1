"""The sound and v2v benchmarks on the CPU: bench.parity's v2v / sound cases on the tiny preset (fp32 against fp32:
vision latents and waveform), the sound parts `random_checkpoint.add_sound` adds in place (every other tensor kept,
loads in ours and in diffusers), its tokenizer passing a change of the latents through, and bench.served's request
kinds. The served run itself (tritonserver, minutes on this CPU) is `python -m bench.served --config
configs/bench_tiny_sound.yaml ...`, not run here."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bench import parity


def test_omni_cases_and_selection():
    assert len(parity.select("nano", None)) == 16  # without --cases: the t2v/i2v run, as before
    names = [c.name for c in parity.omni_cases("nano")]
    assert "t2v+sound-9f-4s-flow" in names and "v2v-last-33f-8s-native" in names and "v2v+sound-33f-4s-flow" in names
    assert not any("sound" in c.name for c in parity.omni_cases("edge"))  # Edge has no sound
    chosen = [c.name for c in parity.select("nano", ["*+sound-9f-4s-flow", "v2v-*-9f-4s-flow"])]
    assert chosen == ["v2v-first-9f-4s-flow", "v2v-last-9f-4s-flow", "t2v+sound-9f-4s-flow",
                      "i2v+sound-9f-4s-flow", "v2v+sound-9f-4s-flow"]  # fmt: skip
    v2v = parity.Case("v2v-last", 9, 4, "flow")
    p = parity.params_of(v2v, "nano", 0)
    assert (v2v.kind, v2v.sound, p["condition_frame_indexes"], p["condition_video_keep"]) == (
        "v2v",
        False,
        [0, 1],
        "last",
    )
    assert parity.params_of(parity.Case("i2v+sound", 9, 4, "flow"), "nano", 0)["enable_sound"] is True
    clip = parity.cond_clip(32, 64)
    assert clip.dtype == np.uint8 and clip.shape == (12, 32, 64, 3) and not np.array_equal(clip[0], clip[-1])


def test_tiny_parity_sound_and_v2v(tmp_path, monkeypatch):
    monkeypatch.setenv("COSMOS3_CACHE", str(tmp_path / "cache"))
    cases = ["v2v+sound-9f-4s-native"]  # v2v and sound in one case: the tiny run's cost is per case
    result = parity.main(["--preset", "tiny", "--device", "cpu", "--cases", *cases, "--json", str(tmp_path / "r.json")])
    assert set(result["cases"]) == set(cases)
    for name, row in result["cases"].items():
        runs = row["runs"]
        assert row["pass"] and runs["diffusers"]["rel_l2"] == 0.0 and runs["sdpa"]["rel_l2"] < 1e-5, name
        if "sound" in name:  # the waveform is judged too: fp32 against fp32
            assert runs["diffusers"]["wave_rel_l2"] == 0.0 and runs["sdpa"]["wave_rel_l2"] < 1e-5, name
            assert runs["sdpa"]["sound_rel_l2"] < 1e-5, name
        else:
            assert "wave_rel_l2" not in runs["sdpa"]
    saved = json.loads((tmp_path / "r.json").read_text())
    video_only = {"case": {}, "pass": True, "runs": {k: {"rel_l2": 0.07, "ratio": 1.0, "psnr_db": 30.0}
                                                    for k in ("diffusers", "sdpa")}}  # fmt: skip
    table = parity.table({**saved, "cases": {**saved["cases"], "t2v-9f-4s-flow": video_only}})
    assert "waveform rel-L2: diffusers / sdpa (ratios)" in table and "| 0.000 % / 0.000 % (nan) | pass |" in table
    assert "| t2v-9f-4s-flow | 7.000 % | 7.000 % | 1.000 | 30.0 / 30.0 | — | pass |" in table


def test_sound_tokenizer_passes_a_change_through(tmp_path):
    from diffusers import Cosmos3AVAEAudioTokenizer

    from cosmos3_core.model.random_checkpoint import sound_parts, write_sound_tokenizer

    _, cfg = sound_parts("tiny")
    write_sound_tokenizer(tmp_path / "tok", cfg, seed=0)
    tok = Cosmos3AVAEAudioTokenizer.from_pretrained(tmp_path / "tok", torch_dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    lat = torch.randn(1, cfg["vocoder_input_dim"], 10, generator=g)
    with torch.no_grad():
        wave = tok.decoder(lat)
        moved = tok.decoder(lat + 1e-3 * torch.randn(lat.shape, generator=g))
        assert 0.1 < wave.std() < 1.0 and tok.decoder(torch.zeros_like(lat)).abs().max() == 0  # no bias floor
    change = ((moved - wave).norm() / wave.norm()) / (1e-3 * np.sqrt(lat.numel()) / lat.norm())
    assert 0.3 < change < 3  # neither swallowed nor amplified


def test_served_request_kinds():
    from bench.served import VARIANTS, variant_request

    p, image, clip, raw = variant_request("v2v", {"steps": 3}, 32, 64)
    assert p == {"steps": 3, "condition_frame_indexes": [0, 1]} and image is None and clip.shape == (12, 32, 64, 3)
    p, image, clip, raw = variant_request("i2v+sound", {}, 32, 64)
    assert p == {"enable_sound": True} and image.shape == (32, 64, 3) and clip is None and raw is None
    assert {"t2v", "t2v+sound", "i2v", "i2v+sound", "v2v", "v2v+sound"} <= set(VARIANTS)


@pytest.mark.parametrize("preset", ["nano_sound", "tiny_sound"])
def test_sound_presets_resolve(preset):
    from cosmos3_core.model.random_checkpoint import sound_parts

    tcfg, tok = sound_parts(preset)
    assert tcfg["sound_gen"] and (tok.get("vocoder_input_dim", tcfg["sound_dim"]) == tcfg["sound_dim"])
    with pytest.raises(ValueError, match="no sound"):
        sound_parts("edge")
