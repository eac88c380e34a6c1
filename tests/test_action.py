"""Robot actions end to end on a tiny checkpoint with an action head and sound (fp32, CPU): the CLI's vision latents
and actions against `Cosmos3OmniPipeline(action=CosmosActionCondition(...))` for each mode, domains of three
widths, two tiers, image and clip inputs (one with sound too); the anchor encode against frame 0 of the pipeline's
full-clip encode (bit for bit, cost ratio printed); a packed forward mixing domains, modes, chunk sizes and a video
request against each alone; every new field's bad input named."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from PIL import Image

from cosmos3_core.engine import DenoiseEngine
from cosmos3_core.generate import main
from cosmos3_core.model.action import encode_action_condition
from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.model.conditioning import VaeCodec
from cosmos3_core.model.embodiments import ActionGeometry
from cosmos3_core.requests import Defaults, GenerationParams, Limits, RequestError
from cosmos3_core.stages import PrefillStage
from tests.conftest import KeepSink, reference_pipeline, rel_l2
from tests.test_video_input import make_clip

PROMPT = "pick up the red cube and place it in the bowl"
SHIFT = 5.0


def make_image(h: int, w: int, seed: int = 0) -> np.ndarray:
    return make_clip(1, h, w, seed)[0]


# (mode, domain (raw width), tier, chunk, input (h, w, clip frames; 0: an image), raw action rows, extra parameters)
CASES = [
    ("policy", "bridge_orig_lerobot", 256, 8, (40, 56, 0), 0, {"negative_prompt": "blurry, static"}),  # width 10
    ("policy", "pusht", 480, 4, (120, 150, 3), 0, {"fps": 16.0, "view_point": "wrist_view"}),  # odd latent grid
    ("forward_dynamics", "av", 256, 6, (400, 280, 0), 3, {}),  # width 9; downscaled, reflect-padded; short raw
    ("forward_dynamics", "bridge_orig_lerobot", 480, 4, (64, 64, 9), 7, {"guidance_scale": 1.0}),  # long raw
    ("inverse_dynamics", "pusht", 256, 8, (40, 56, 12), 0, {}),  # width 2; a clip longer than chunk + 1
    ("inverse_dynamics", "av", 480, 4, (120, 150, 3), 0, {}),  # a clip shorter than chunk + 1
    ("policy", "av", 256, 5, (48, 64, 0), 0, {"sound": True}),  # with sound: noise order vision, sound, action
]
IDS = [f"{c[0]}-{c[1]}-{c[2]}-{'clip' if c[4][2] else 'image'}{'-sound' if c[6].get('sound') else ''}" for c in CASES]


@pytest.fixture(scope="module")
def pipe(action_ckpt):
    return reference_pipeline(action_ckpt)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    """The CLI's default deployment (configs/tiny.yaml) with room for tier 480's canvases (up to 832 wide)."""
    import yaml

    raw = yaml.safe_load(open("configs/tiny.yaml"))
    raw["limits"].update(max_height=1280, max_width=1280)
    path = tmp_path_factory.mktemp("action_cfg") / "action.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def inputs_of(case) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    mode, domain, _, chunk, (h, w, frames), rows, _ = case
    image = make_image(h, w, seed=h) if not frames else None
    clip = make_clip(frames, h, w, seed=w) if frames else None
    if not rows:
        return image, clip, None
    raw = np.random.default_rng(rows).standard_normal((rows, {"av": 9, "bridge_orig_lerobot": 10}[domain]))
    return image, clip, raw.astype(np.float32)


def reference(pipe, case, image, clip, raw, steps: int = 3, seed: int = 3):
    """→ (vision latents, out.action[0] or None, sound waveform or None) of the pipeline."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition

    mode, domain, tier, chunk, _, _, extra = case
    pipe.scheduler = pipe.scheduler.from_config(pipe.scheduler.config, flow_shift=SHIFT)
    condition = CosmosActionCondition(
        mode=mode, chunk_size=chunk, domain_name=domain, resolution_tier=tier,
        raw_actions=None if raw is None else torch.from_numpy(raw),
        image=None if image is None else Image.fromarray(image),
        video=None if clip is None else [Image.fromarray(f) for f in clip],
        view_point=extra.get("view_point", "ego_view"),
    )  # fmt: skip
    out = pipe(
        prompt=PROMPT, negative_prompt=extra.get("negative_prompt"), action=condition, fps=extra.get("fps", 24.0),
        num_inference_steps=steps, guidance_scale=extra.get("guidance_scale", 5.0),
        generator=torch.Generator().manual_seed(seed), output_type="latent", enable_sound=extra.get("sound", False),
        enable_safety_check=False,
    )  # fmt: skip
    return out.video, None if out.action is None else out.action[0], out.sound


def cli_args(ckpt, config, case, tmp_path, image, clip, raw, steps: int = 3, seed: int = 3) -> list[str]:
    import imageio.v2 as imageio

    mode, domain, tier, chunk, _, _, extra = case
    args = ["--checkpoint", str(ckpt), "--config", str(config), "--prompt", PROMPT, "--out", str(tmp_path / "v.pt"), "--steps", str(steps),
            "--seed", str(seed), "--shift", str(SHIFT), "--guidance", str(extra.get("guidance_scale", 5.0)),
            "--fps", str(extra.get("fps", 24.0)), "--action-mode", mode, "--chunk-size", str(chunk),
            "--domain", domain, "--resolution-tier", str(tier)]  # fmt: skip
    if "negative_prompt" in extra:
        args += ["--negative-prompt", extra["negative_prompt"]]
    if "view_point" in extra:
        args += ["--view-point", extra["view_point"]]
    if image is not None:
        imageio.imwrite(tmp_path / "c.png", image)
        args += ["--image", str(tmp_path / "c.png")]
    if clip is not None:
        np.save(tmp_path / "c.npy", clip)
        args += ["--video", str(tmp_path / "c.npy")]
    if raw is not None:
        np.save(tmp_path / "raw.npy", raw.astype(np.float64))  # the CLI reads any float .npy as float32
        args += ["--raw-actions", str(tmp_path / "raw.npy")]
    if mode != "forward_dynamics":
        args += ["--actions-out", str(tmp_path / "a.pt")]
    if extra.get("sound"):
        args += ["--sound", "--audio-out", str(tmp_path / "s.pt")]
    return args


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cli_action_matches_pipeline(action_ckpt, config, pipe, tmp_path, case):
    """Vision latents and actions (and, with sound, the waveform) rel-L2 <= 1e-4; shapes as the pipeline's."""
    image, clip, raw = inputs_of(case)
    assert main(cli_args(action_ckpt, config, case, tmp_path, image, clip, raw)) == 0
    ref_v, ref_a, ref_s = reference(pipe, case, image, clip, raw)
    ours_v = torch.load(tmp_path / "v.pt")
    assert ours_v.shape == ref_v.shape
    assert rel_l2(ours_v, ref_v) <= 1e-4, rel_l2(ours_v, ref_v)
    if case[0] == "forward_dynamics":
        assert ref_a is None and not (tmp_path / "a.pt").exists()
    else:
        ours_a = torch.load(tmp_path / "a.pt")
        assert ours_a.shape == ref_a.shape == (case[3], {"pusht": 2, "av": 9, "bridge_orig_lerobot": 10}[case[1]])
        assert rel_l2(ours_a, ref_a) <= 1e-4, rel_l2(ours_a, ref_a)
    if ref_s is not None:
        ours_s = torch.load(tmp_path / "s.pt")
        assert ours_s.shape == ref_s.shape and rel_l2(ours_s, ref_s) <= 1e-4


@pytest.fixture(scope="module")
def codec(action_ckpt):
    return VaeCodec(Checkpoint.open(action_ckpt).load_vae("cpu", torch.float32))


@pytest.mark.parametrize("tier,chunk,frames", [(256, 8, 0), (480, 8, 12)], ids=["image-256", "clip-480"])
def test_anchor_encode_is_frame_0_of_the_full_clip(pipe, codec, tier, chunk, frames):
    """The standalone causal encode of the anchor frame equals frame 0 of the pipeline's encode of the whole
    repeat-padded canvas clip, bit for bit; and costs a fraction of it (printed)."""
    clip = make_clip(frames, 72, 100, seed=5) if frames else make_image(72, 100, seed=5)[None]
    source = [Image.fromarray(f) for f in clip]
    with torch.inference_mode():
        pixels, size, _, _ = pipe._prepare_action_video_conditioning(source, tier, chunk + 1, "cpu", torch.float32)
        t0 = time.perf_counter()
        full = pipe._remove_action_video_padding_from_latent(pipe._encode_video(pixels).float(), size)
        t1 = time.perf_counter()
        geo = ActionGeometry.of(*clip.shape[1:3], tier, 16)
        ours = encode_action_condition(codec, clip, "policy", chunk, geo)
        t2 = time.perf_counter()
    assert ours.shape == full.shape and geo.canvas == tuple(pixels.shape[-2:])
    assert torch.equal(ours[:, :, :1], full[:, :, :1])
    assert not ours[:, :, 1:].any()  # the frames that start as noise are not encoded
    print(f"\nanchor encode, tier {tier}, chunk {chunk}: full clip {t1 - t0:.3f}s, anchor {t2 - t1:.3f}s, "
          f"cost ratio {(t1 - t0) / (t2 - t1):.1f}x")  # fmt: skip
    inverse = encode_action_condition(codec, clip, "inverse_dynamics", chunk, geo)
    assert torch.equal(inverse, full)  # inverse dynamics: the whole clip, as the pipeline encodes it


@pytest.mark.parametrize(
    "h,w,tier,frames",
    [(40, 56, 256, 1), (400, 280, 256, 3), (30, 500, 480, 2), (720, 1280, 720, 1), (17, 33, 704, 4), (96, 96, 480, 5)],
)
def test_sizes_and_canvas_match_pipeline(pipe, h, w, tier, frames):
    """Stretch, bin, downscale, pad (reflect and replicate) and latent crop, as the pipeline derives them."""
    from cosmos3_core.model.action import canvas_frames

    clip = make_clip(frames, h, w, seed=h + w)
    chunk_frames = frames + 2  # the last frame repeated
    ref, size, th, tw = pipe._prepare_action_video_conditioning(
        [Image.fromarray(f) for f in clip], tier, chunk_frames, "cpu", torch.float32
    )
    geo = ActionGeometry.of(h, w, tier, 16)
    assert geo.canvas == (th, tw) and geo.content == tuple(int(v) for v in size[2:].tolist())
    latent = pipe._remove_action_video_padding_from_latent(torch.zeros(1, 1, 1, th // 16, tw // 16), size)
    assert geo.latent == tuple(latent.shape[-2:])
    assert torch.equal(canvas_frames(clip, geo, chunk_frames), ref)


@pytest.mark.parametrize("chunk,fps,tier", [(8, 24.0, 256), (1, 24.0, 480), (6, 16.0, 720), (13, 30.0, 704)])
def test_caption_and_positions_match_pipeline(pipe, action_ckpt, chunk, fps, tier):
    from cosmos3_core.model.action import action_position_ids
    from cosmos3_core.model.config import ModelConfig
    from cosmos3_core.model.prompts import VIEW_POINTS, action_caption

    th, tw = ActionGeometry.of(48, 64, tier, 16).canvas
    for view in (*VIEW_POINTS, None):
        expected = pipe._build_action_json_prompt(
            PROMPT, view_point=view, num_frames=chunk + 1, fps=fps, height=th, width=tw
        )
        assert action_caption(PROMPT, view, chunk + 1, fps, th, tw) == expected
    cfg = ModelConfig.from_files(action_ckpt / "transformer" / "config.json", action_ckpt / "vae" / "config.json")
    segment = pipe._prepare_action_segment(torch.zeros(chunk, 16), [], 57 + 15000, fps, 0, "cpu")
    assert torch.equal(action_position_ids(cfg, chunk, 57, fps), segment["action_mrope_ids"].float())


@pytest.fixture(scope="module")
def stage(action_ckpt):
    ckpt = Checkpoint.open(action_ckpt)
    limits = Limits(max_chunk_size=16, max_height=1280, max_width=1280, max_raw_actions=32)
    return ckpt, PrefillStage(ckpt, "cpu", torch.float32, Defaults(height=32, width=48, num_frames=9), limits)


def test_packed_domains_modes_and_video_equal_each_alone(stage):
    """Requests of three domains, all modes, four chunk sizes and a plain video request in ONE forward per tick;
    each request's latents and actions equal its run alone, bit for bit."""
    ckpt, prefill = stage
    rng = np.random.default_rng(0)
    requests = [  # (parameters, image, clip, raw actions)
        ({"action": {"mode": "policy", "chunk_size": 8, "domain": "bridge_orig_lerobot", "resolution_tier": 256}},
         make_image(40, 56), None, None),
        ({"action": {"mode": "forward_dynamics", "chunk_size": 4, "domain": "av", "resolution_tier": 256}},
         None, make_clip(5, 48, 64), rng.standard_normal((4, 9)).astype(np.float32)),
        ({"action": {"mode": "inverse_dynamics", "chunk_size": 6, "domain": "pusht", "resolution_tier": 256},
          "guidance_scale": 1.0}, None, make_clip(7, 40, 56), None),
        ({}, None, None, None),  # t2v
        ({"action": {"mode": "policy", "chunk_size": 5, "domain": "pusht", "resolution_tier": 256}, "seed": 9},
         make_image(64, 48), None, None),
    ]  # fmt: skip
    pre = []
    for params, image, clip, raw in requests:
        p = prefill.validate(PROMPT, {"steps": 3, **params}, image, clip, raw)
        pre.append(prefill.run(p, image, clip, raw))

    def run(items):  # JSON captions are long in a byte-level tokenizer: pages for all five at once
        engine = DenoiseEngine(ckpt, "cpu", torch.float32, 512, 16, 8)
        sinks = [KeepSink() for _ in items]
        for r, s in zip(items, sinks):
            engine.submit(r, s)
        engine.run_until_idle()
        return [(s.latents, s.actions) for s in sinks], engine.stats.max_requests_in_tick

    together, packed = run(pre)
    assert packed == len(requests)
    assert [None if a is None else tuple(a.shape) for _, a in together] == [(8, 10), None, (6, 2), None, (5, 2)]
    for i, r in enumerate(pre):
        ((latents, actions),) = run([r])[0]
        assert torch.equal(together[i][0], latents), f"request {i}: vision differs when packed"
        assert (actions is None and together[i][1] is None) or torch.equal(together[i][1], actions), f"request {i}"


def act(mode="policy", chunk=4, domain="pusht", **kw) -> dict:
    return {"action": {"mode": mode, "chunk_size": chunk, "domain": domain, **kw}}


IMG, CLIP = make_image(40, 56), make_clip(3, 40, 56)
RAW9 = np.zeros((4, 9), np.float32)
BAD = [  # (parameters, image, clip, raw actions, message)
    (act(domain="ur5"), IMG, None, None, "action.domain: must be an embodiment"),
    (act(domain="libero"), IMG, None, None, "action.domain: must be an embodiment with a known action width"),
    (act(domain="galbot"), IMG, None, None, "action.domain: 'galbot' has 30 action channels; this checkpoint's"),
    (act(domain="hand_pose"), IMG, None, None, "action.domain: 'hand_pose' has 57 action channels"),
    (act("forward_dynamics", domain="av"), IMG, None, np.zeros((4, 10), np.float32), "raw_actions: has 10 channels"),
    (act("forward_dynamics", domain="av"), IMG, None, np.zeros(9, np.float32), "raw_actions: must be [T, 9]"),
    (act("forward_dynamics", domain="av"), IMG, None, np.zeros((2, 4, 9), np.float32), "raw_actions: must be [T, 9]"),
    (act("forward_dynamics", domain="av"), IMG, None, np.zeros((0, 9), np.float32), "raw_actions: has 0 rows"),
    (act("forward_dynamics", domain="av"), IMG, None, np.zeros((33, 9), np.float32), "raw_actions: has 33 rows"),
    (act("forward_dynamics", domain="av"), IMG, None, RAW9.astype(np.float64), "raw_actions: must be FP32"),
    (act("forward_dynamics", domain="av"), IMG, None, RAW9 * np.nan, "raw_actions: must be finite"),
    (act("forward_dynamics", domain="av"), IMG, None, None, "raw_actions: mode forward_dynamics needs raw_actions"),
    (act("policy"), IMG, None, RAW9, "raw_actions: only applies with mode forward_dynamics"),
    ({}, None, None, RAW9, "raw_actions: only applies with `action`"),
    ({**act(), "num_frames": 9}, IMG, None, None, "num_frames: does not apply with `action`"),
    ({**act(), "height": 32}, IMG, None, None, "height: does not apply with `action`"),
    ({**act(), "window_mode": "kv"}, IMG, None, None, "window_mode: does not apply with `action`"),
    (act("inverse_dynamics"), IMG, None, None, "condition_video: mode inverse_dynamics needs a clip"),
    (act(), IMG, CLIP, None, "condition_video: pass either `image` or `condition_video`"),
    (act(), None, None, None, "image: `action` needs an `image` or a `condition_video`"),
    (act(chunk=17), IMG, None, None, "action.chunk_size: must be in [1, 16], got 17"),
    (act(chunk=0), IMG, None, None, "action.chunk_size: must be in [1, 16], got 0"),
    (act(chunk=2.5), IMG, None, None, "action.chunk_size: must be an integer"),
    (act(mode="rollout"), IMG, None, None, "action.mode: must be one of policy, forward_dynamics, inverse_dynamics"),
    ({"action": {"chunk_size": 4, "domain": "av"}}, IMG, None, None, "action.mode: is required"),
    (act(resolution_tier=360), IMG, None, None, "action.resolution_tier: must be one of 256, 480, 704, 720"),
    (act(resolution_tier=True), IMG, None, None, "action.resolution_tier: must be one of"),
    (act(view_point="top_view"), IMG, None, None, "action.view_point: must be one of ego_view"),
    (act(speed=2), IMG, None, None, "action.speed: unknown key 'speed'"),
    ({"action": "policy"}, IMG, None, None, "action: must be a JSON object"),
    (act(), np.zeros((8, 40, 3), np.uint8), None, None, "image: too small for `action`"),
    (act(), None, np.zeros((3, 40, 8, 3), np.uint8), None, "condition_video: too small for `action`"),
    (act(), None, np.zeros((3, 40, 56), np.uint8), None, "condition_video: must be [T, H, W, 3]"),
]


@pytest.mark.parametrize("params,image,clip,raw,message", BAD, ids=[b[4][:48] for b in BAD])
def test_bad_action_input_names_the_field(stage, params, image, clip, raw, message):
    with pytest.raises(RequestError) as e:
        stage[1].validate(PROMPT, params, image, clip, raw)
    assert message in str(e.value)


def test_checkpoint_without_action_head_refuses(nano_ckpt, stage):
    plain = PrefillStage(Checkpoint.open(nano_ckpt), "cpu", torch.float32, Defaults(32, 48, 9), Limits())
    with pytest.raises(RequestError, match="^action: this checkpoint has no action weights"):
        plain.validate(PROMPT, act(), IMG)
    limits = Limits(max_height=512, max_width=512)
    small = PrefillStage(Checkpoint.open(stage[0].root), "cpu", torch.float32, Defaults(32, 48, 9), limits)
    with pytest.raises(RequestError, match="^action.resolution_tier: its 640x640 canvas exceeds the limits 512x512"):
        small.validate(PROMPT, act(resolution_tier=480), make_image(64, 64))


def test_a_request_naming_no_tier_takes_the_deployments(stage):
    """`defaults.resolution_tier` (configs/tiny.yaml: 256, within its 512×512 limits); unset, the pipeline's 480."""
    ckpt, limits = Checkpoint.open(stage[0].root), Limits(max_height=512, max_width=512)
    tier256 = PrefillStage(ckpt, "cpu", torch.float32, Defaults(32, 48, 9, resolution_tier=256), limits)
    p = tier256.validate(PROMPT, act(), make_image(64, 64))
    assert (p.resolution_tier, p.height, p.width) == (256, 256, 256)
    tier480 = PrefillStage(ckpt, "cpu", torch.float32, Defaults(32, 48, 9), limits)
    with pytest.raises(RequestError, match="^action.resolution_tier: its 640x640 canvas exceeds the limits 512x512"):
        tier480.validate(PROMPT, act(), make_image(64, 64))
    with pytest.raises(ValueError, match="^defaults.resolution_tier: must be one of 256, 480, 704, 720, got 300"):
        Defaults(resolution_tier=300)


def test_action_params_echo_and_roundtrip(stage):
    p = stage[1].validate(PROMPT, act("inverse_dynamics", chunk=8, resolution_tier=256), None, make_clip(3, 40, 56))
    assert (p.task, p.num_frames, (p.height, p.width), p.frame_size) == ("action", 9, (192, 320), (32, 48))
    assert p.clean_frames == (0, 1, 2) and p.raw_action_dim == 2 and p.returns_actions
    shown = p.resolved()
    assert shown["action"] == {"mode": "inverse_dynamics", "chunk_size": 8, "domain": "pusht", "resolution_tier": 256,
                               "view_point": "ego_view"}  # fmt: skip
    assert not {"condition_frame_indexes", "num_frames", "height", "add_templates", "window_mode"} & set(shown)
    assert stage[1].validate(PROMPT, shown, None, make_clip(3, 40, 56)) == p  # sent back, the same request
    assert GenerationParams.from_json(p.to_json()) == p
    plain = stage[1].validate(PROMPT, {}, None)
    assert "action_mode" not in plain.resolved() and not plain.returns_actions


def test_cli_actions_out_and_its_errors(action_ckpt, tmp_path, capsys):
    import imageio.v2 as imageio

    np.save(tmp_path / "raw.npy", np.zeros((4, 9), np.float32))
    imageio.imwrite(tmp_path / "c.png", IMG)
    base = ["--checkpoint", str(action_ckpt), "--prompt", PROMPT, "--out", str(tmp_path / "v.pt"), "--steps", "1",
            "--image", str(tmp_path / "c.png"), "--chunk-size", "4", "--domain", "av", "--resolution-tier", "256"]  # fmt: skip
    fd = ["--action-mode", "forward_dynamics", "--raw-actions", str(tmp_path / "raw.npy")]
    for args, message in [
        ([*fd, "--actions-out", str(tmp_path / "a.npy")], "actions_out: only policy and inverse_dynamics return"),
        (["--action-mode", "policy", "--actions-out", str(tmp_path / "a.txt")], "actions_out: suffix must be one of"),
        ([], "action.mode: is required"),  # action flags without --action-mode
        (["--action-mode", "policy", "--resolution-tier", "480"], "action.resolution_tier: its 736x544 canvas"),
    ]:
        assert main([*base, *args]) == 2
        assert message in capsys.readouterr().err
    assert main([*base, "--action-mode", "policy", "--actions-out", str(tmp_path / "a.npy")]) == 0
    assert np.load(tmp_path / "a.npy").shape == (4, 9) and torch.load(tmp_path / "v.pt").shape == (1, 16, 2, 2, 3)
