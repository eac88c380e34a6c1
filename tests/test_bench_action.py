"""The robot-action benchmarks on the CPU: bench.parity's policy / forward / inverse dynamics cases on the tiny preset
(fp32 against fp32: vision latents and actions), the action heads `random_checkpoint.add_action` adds in place
(every other tensor kept, loads in ours and in diffusers) and the `nano_action` skeleton, the compute floor of an
action request (vision + action tokens, both branches, all steps), bench.served's action request kinds and an
action warmup request. The served run itself (tritonserver, ~2.5 min on this CPU) is `python -m bench.served
--config configs/bench_tiny_action.yaml ...`, not run here."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from bench import parity


def test_action_cases_and_selection():
    assert len(parity.select("nano", None)) == 16  # without --cases: the t2v/i2v run, as before
    names = [c.name for c in parity.action_cases("nano")]
    assert len(names) == 12 and {"policy-480-16c-4s-flow", "fd-256-8c-4s-flow", "id-480-8c-4s-flow"} <= set(names)
    assert not parity.action_cases("edge")  # Edge has no action heads
    chosen = [c.name for c in parity.select("nano", ["policy-480-*", "fd-480-16c-*", "id-256-8c-*"])]
    assert chosen == ["policy-480-8c-4s-flow", "policy-480-16c-4s-flow", "fd-480-16c-4s-flow", "id-256-8c-4s-flow"]
    assert not any(c.action for c in parity.select("nano", ["*-9f-*"]))  # the older globs pick no action case
    fd = parity.Case("fd", 17, 4, "flow", 480)
    p = parity.params_of(fd, "nano", 0)
    assert p["action"] == {"mode": "forward_dynamics", "chunk_size": 16, "domain": "bridge_orig_lerobot",
                           "resolution_tier": 480} and not {"height", "width", "num_frames"} & set(p)  # fmt: skip
    image, clip, raw = parity.inputs_of(fd, 480, 832)
    assert image.shape == (480, 832, 3) and clip is None and raw.dtype == np.float32 and raw.shape == (16, 10)
    image, clip, raw = parity.inputs_of(parity.Case("id", 9, 4, "flow", 256), 480, 832)
    assert image is None and clip.shape == (9, 480, 832, 3) and raw is None


def test_tiny_parity_actions(tmp_path, monkeypatch):
    monkeypatch.setenv("COSMOS3_CACHE", str(tmp_path / "cache"))
    cases = ["policy-256-8c-4s-flow"]  # one case: the tiny run's cost is per case (all 12: `--cases 'policy-*' ...`)
    result = parity.main(["--preset", "tiny", "--device", "cpu", "--cases", *cases, "--json", str(tmp_path / "r.json")])
    assert set(result["cases"]) == set(cases)
    runs = result["cases"][cases[0]]["runs"]
    assert result["cases"][cases[0]]["pass"] and runs["diffusers"]["rel_l2"] == 0.0 and runs["sdpa"]["rel_l2"] < 1e-5
    assert runs["diffusers"]["action_rel_l2"] == 0.0 and runs["sdpa"]["action_rel_l2"] < 1e-5  # actions judged too
    saved = json.loads((tmp_path / "r.json").read_text())
    no_actions = {"case": {}, "pass": False, "runs": {k: {"rel_l2": 0.07, "ratio": 1.1, "psnr_db": 30.0}
                                                      for k in ("diffusers", "sdpa")}}  # fmt: skip
    table = parity.table({**saved, "cases": {**saved["cases"], "fd-256-8c-4s-flow": no_actions}})
    assert "actions rel-L2: diffusers / sdpa (ratios)" in table and "| 0.000 % / 0.000 % (nan) | pass |" in table
    assert "| fd-256-8c-4s-flow | 7.000 % | 7.000 % | 1.100 | 30.0 / 30.0 | — | **FAIL** |" in table


@pytest.mark.parametrize("part", ["sound", "action"])
def test_add_part_in_place_keeps_the_rest_and_loads(tmp_path, part):
    """random_checkpoint.add_sound / add_action: the transformer's sound or action heads in a shard of their own
    (drawn LLM-like), every earlier tensor as it was, and both loaders read the new ones."""
    from diffusers import Cosmos3OmniTransformer

    from cosmos3_core.model import random_checkpoint as rc
    from cosmos3_core.model.checkpoint import Checkpoint
    from cosmos3_core.model.layers import GEN, UND
    from cosmos3_core.model.sound import SoundSpec
    from cosmos3_core.tools.make_tiny import make_tiny

    add, has, shard = {"sound": (rc.add_sound, rc.has_sound, rc.SOUND_SHARD),
                       "action": (rc.add_action, rc.has_action, rc.ACTION_SHARD)}[part]  # fmt: skip
    root = make_tiny(tmp_path / "ckpt", variant="edge", seed=1, shard_size=200_000)  # sharded: an index to extend
    tdir = root / "transformer"
    before = {f.name: load_file(f) for f in tdir.glob("*.safetensors")}
    assert not has(root) and len(before) > 1
    add(root, "tiny", seed=1)
    assert has(root)
    for name, tensors in before.items():  # every earlier tensor, file and value, as it was
        assert all(torch.equal(v, load_file(tdir / name)[k]) for k, v in tensors.items())
    added = load_file(tdir / shard)
    cfg = json.loads((tdir / "config.json").read_text())
    if part == "sound":
        assert SoundSpec.open(root).sound_dim == 8
        assert sorted(added) == ["audio_modality_embed", "audio_proj_in.bias", "audio_proj_in.weight",
                                 "audio_proj_out.bias", "audio_proj_out.weight"]  # fmt: skip
        assert added["audio_modality_embed"].float().std() > 0.01  # redrawn: a missing term shows
    else:
        assert (cfg["action_dim"], cfg["num_embodiment_domains"]) == (16, 32)
        assert sorted(added) == ["action_modality_embed", "action_proj_in.bias.weight", "action_proj_in.fc.weight",
                                 "action_proj_out.bias.weight", "action_proj_out.fc.weight"]  # fmt: skip
        assert added["action_proj_in.fc.weight"].shape == (32, 16 * cfg["hidden_size"])  # (in, out) per domain
        for k, v in added.items():  # every one drawn LLM-like, the zero-initialised ones included
            assert 0.015 < v.float().std() < 0.025, k
    ours = Checkpoint.open(root).load_transformer({GEN, UND}, "cpu", torch.float32).state_dict()
    assert all(torch.equal(ours[k], v.float()) for k, v in added.items())
    theirs = Cosmos3OmniTransformer.from_pretrained(tdir, torch_dtype=torch.float32).state_dict()
    assert all(torch.equal(theirs[k], v.float()) for k, v in added.items())


def test_nano_action_skeleton_and_floor(tmp_path):
    from bench.floor import denoise_flops, request_floor, text_lengths
    from cosmos3_core.model.checkpoint import Checkpoint
    from cosmos3_core.model.random_checkpoint import write_skeleton
    from cosmos3_core.requests import Defaults, Limits, validate

    root = write_skeleton(tmp_path / "nano_action", "nano_action")  # configs only: weights are drawn at load
    ckpt = Checkpoint.open(root)
    cfg = ckpt.config
    assert ckpt.random_weights and (cfg.action_gen, cfg.action_dim, cfg.num_embodiment_domains) == (True, 64, 32)
    with pytest.raises(ValueError, match="no action heads"):
        write_skeleton(tmp_path / "edge_action", "edge_action")
    params = {"action": {"mode": "policy", "chunk_size": 16, "domain": "droid_lerobot", "resolution_tier": 480},
              "steps": 35, "guidance_scale": 6.0}  # fmt: skip
    image = parity.cond_image(480, 832)
    p = validate(parity.PROMPT, params, image, Defaults(), Limits(), cfg.pixel_alignment, cfg.vae_scale_temporal, 10.0)
    text = text_lengths(ckpt, p)
    floor = request_floor(cfg, p, text)
    # tier 480's 480x832 canvas filled: 5 latent frames of 15x26 patches, and 16 action tokens, per branch
    assert (floor["vision_tokens"], floor["action_tokens"], floor["branches"]) == (5 * 15 * 26, 16, 2)
    assert len(text) == 2 and text[0] > text[1]  # the JSON caption, the empty negative prompt's template
    assert floor["flops"] == sum(denoise_flops(cfg, 1966, t, 35, 1) for t in text)
    assert 2.0 < floor["floor_s"] < 3.5  # ≈ 2.1e15 FLOP at 790 TF/s
    b200 = request_floor(cfg, p, text, card="NVIDIA B200")  # each card's own floor, named
    assert b200["card"] == "B200" and b200["floor_s"] < floor["floor_s"] / 2
    assert request_floor(cfg, p, text, card="NVIDIA H100 80GB HBM3")["card"] == "H100"
    fd = validate(parity.PROMPT, {**params, "action": {**params["action"], "mode": "forward_dynamics"},
                                  "guidance_scale": 1.0}, image, Defaults(), Limits(), 16, 4, 10.0,
                  raw_actions=np.zeros((16, 10), np.float32))  # fmt: skip
    assert request_floor(cfg, fd, text_lengths(ckpt, fd))["branches"] == 1  # guidance 1: one branch


def test_served_action_request_kinds():
    from bench.served import expected_actions, variant_request

    p, image, clip, raw = variant_request("policy", {"steps": 3, "height": 64}, 32, 64)
    assert p == {"steps": 3, "action": {"chunk_size": 16, "domain": "droid_lerobot", "resolution_tier": 480,
                                        "mode": "policy"}}  # fmt: skip
    assert image.shape == (32, 64, 3) and clip is None and raw is None and expected_actions(p) == (16, 10)
    p, image, clip, raw = variant_request("fd", {}, 32, 64, {"chunk_size": 8, "domain": "av"})
    assert p["action"]["mode"] == "forward_dynamics" and raw.shape == (8, 9) and expected_actions(p) is None
    p, image, clip, raw = variant_request("id", {}, 32, 64, {"chunk_size": 8})
    assert image is None and clip.shape == (9, 32, 64, 3) and expected_actions(p) == (8, 10)


def test_action_warmup_requests(action_ckpt):
    """A deployment's action warmup requests (each mode) run on blank inputs at the default size."""
    from cosmos3_core.deployment import Deployment
    from cosmos3_core.generate import Generator
    from cosmos3_core.requests import Defaults, warmup_inputs

    act = {"chunk_size": 4, "domain": "av", "resolution_tier": 256}
    warm = [{"action": {**act, "mode": m}} for m in ("policy", "forward_dynamics", "inverse_dynamics")]
    image, clip, raw = warmup_inputs(warm[1], Defaults(height=32, width=48))
    assert image.shape == (32, 48, 3) and clip is None and raw.shape == (4, 9) and not raw.any()
    assert warmup_inputs(warm[2], Defaults(height=32, width=48))[1].shape == (5, 32, 48, 3)
    assert warmup_inputs({"action": "policy"}, Defaults()) == (None, None, None)  # validate names the field
    d = Deployment.load("configs/tiny.yaml", checkpoint=str(action_ckpt), device="cpu", dtype="float32",
                        warmup_requests=warm)  # fmt: skip
    gen = Generator(d)
    assert gen.engine.stats.max_requests_in_tick == 0  # counts start after warmup
