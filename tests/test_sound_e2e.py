"""Sound end to end on a tiny sound checkpoint (fp32, CPU): the CLI's vision latents and waveform against
`Cosmos3OmniPipeline(enable_sound=True)` for t2v, i2v and v2v; a packed forward mixing video-only and sound
requests against each alone; a checkpoint without sound refuses the request (naming `enable_sound`); AR windows
with sound refused (naming `window_mode`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from cosmos3_core.engine import DenoiseEngine
from cosmos3_core.generate import main
from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.requests import Defaults, Limits, RequestError
from cosmos3_core.stages import PrefillStage
from cosmos3_core.tools.make_tiny import make_tiny
from tests.conftest import KeepSink, reference_pipeline, rel_l2
from tests.test_video_input import make_clip

PROMPT = "thunder over a wheat field"
BASE = dict(num_frames=9, height=32, width=48, steps=3, guidance_scale=5.0, shift=8.0, seed=2, fps=16.0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("snd") / "nano", variant="nano", seed=7, sound=True)


@pytest.fixture(scope="module")
def pipe(ckpt):
    return reference_pipeline(ckpt)


def reference(pipe, params: dict, image=None, clip=None):
    pipe.scheduler = pipe.scheduler.from_config(pipe.scheduler.config, flow_shift=params["shift"])
    extra = (
        {"video": [Image.fromarray(f) for f in clip], "condition_frame_indexes_vision": [0, 2]}
        if clip is not None
        else {}
    )
    out = pipe(
        prompt=PROMPT, image=None if image is None else Image.fromarray(image), num_frames=params["num_frames"],
        height=params["height"], width=params["width"], fps=params["fps"], num_inference_steps=params["steps"],
        guidance_scale=params["guidance_scale"], generator=torch.Generator().manual_seed(params["seed"]),
        output_type="latent", enable_sound=True, enable_safety_check=False, **extra,
    )  # fmt: skip
    return out.video, out.sound


def args_for(ckpt, params: dict, out, audio) -> list[str]:
    flags = {"num_frames": "--num-frames", "guidance_scale": "--guidance"}
    args = ["--checkpoint", str(ckpt), "--prompt", PROMPT, "--out", str(out), "--sound", "--audio-out", str(audio)]
    for k, v in params.items():
        args += [flags.get(k, f"--{k}"), str(v)]
    return args


@pytest.fixture(scope="module")
def gen(ckpt):
    from cosmos3_core.deployment import Deployment
    from cosmos3_core.generate import Generator

    # a sound warmup request: warmup passes the sound band through the real step like any request
    warmup = [{**BASE, "steps": 2, "enable_sound": True}]
    d = Deployment.load(
        "configs/tiny.yaml", checkpoint=str(ckpt), device="cpu", dtype="float32", warmup_requests=warmup
    )
    return Generator(d)


@pytest.mark.parametrize("task", ["t2v", "i2v", "v2v", "t2v_guidance1"])
def test_cli_sound_matches_pipeline(ckpt, pipe, gen, tmp_path, task, test_image):
    """Vision latents, sound latents and the waveform rel-L2 <= 1e-4; the pipeline's sound latents decode to the
    bit through our decode."""
    import imageio.v2 as imageio

    params = {**BASE, "guidance_scale": 1.0} if task == "t2v_guidance1" else BASE
    args = args_for(ckpt, params, tmp_path / "v.pt", tmp_path / "a.pt")
    image = clip = None
    request = {**params, "enable_sound": True}
    if task == "i2v":
        image = test_image
        imageio.imwrite(tmp_path / "c.png", image)
        args += ["--image", str(tmp_path / "c.png")]
    if task == "v2v":
        clip = make_clip(7)
        np.save(tmp_path / "c.npy", clip)
        args += ["--video", str(tmp_path / "c.npy"), "--condition-frames", "0,2"]
        request["condition_frame_indexes"] = [0, 2]
    assert main(args) == 0
    captured = {}
    decode = pipe.decode_sound
    pipe.decode_sound = lambda lat: decode(captured.setdefault("sound", lat.clone()))
    try:
        ref_v, ref_s = reference(pipe, params, image, clip)
    finally:
        pipe.decode_sound = decode
    ours_v, ours_s = torch.load(tmp_path / "v.pt"), torch.load(tmp_path / "a.pt")
    assert ours_v.shape == ref_v.shape and ours_s.shape == ref_s.shape == (2, 15 * 1920)  # 9 frames at 16 fps
    assert rel_l2(ours_v, ref_v) <= 1e-4
    out = gen.generate(PROMPT, request, image, video=clip)
    latents, sound = out.latents, out.sound
    assert torch.equal(latents, ours_v)  # the CLI is this engine
    assert sound.shape == captured["sound"].shape and rel_l2(sound, captured["sound"]) <= 1e-4
    assert torch.equal(torch.from_numpy(gen.decode.audio(captured["sound"])), ref_s)
    assert rel_l2(ours_s, ref_s) <= 1e-4


def test_wav_written(ckpt, tmp_path):
    import wave

    assert main(args_for(ckpt, {**BASE, "steps": 1}, tmp_path / "v.npy", tmp_path / "a.wav")) == 0
    with wave.open(str(tmp_path / "a.wav")) as w:
        assert (w.getnchannels(), w.getframerate(), w.getnframes()) == (2, 48000, 15 * 1920)


def test_packed_sound_and_video_only_equal_each_alone(ckpt):
    c = Checkpoint.open(ckpt)
    prefill = PrefillStage(c, "cpu", torch.float32, Defaults(height=32, width=48, num_frames=9), Limits())
    requests = [
        ({"steps": 3, "seed": 1, "enable_sound": True}, None),
        ({"steps": 3, "seed": 2}, None),
        ({"steps": 3, "seed": 3, "enable_sound": True, "num_frames": 13, "guidance_scale": 1.0}, None),
        ({"steps": 3, "seed": 4, "enable_sound": True}, make_clip(5)),
    ]
    pre = [prefill.run(prefill.validate(PROMPT, q, None, v), None, v) for q, v in requests]

    def run(items):
        engine = DenoiseEngine(c, "cpu", torch.float32, 128, 16, 8)
        sinks = [KeepSink() for _ in items]
        for r, s in zip(items, sinks):
            engine.submit(r, s)
        engine.run_until_idle()
        return [(s.latents, s.sound) for s in sinks], engine.stats.max_requests_in_tick

    together, packed = run(pre)
    assert packed == 4 and together[1][1] is None and together[0][1].shape == (8, 10)  # 9 frames at 24 fps
    for i, r in enumerate(pre):
        ((lat, snd),) = run([r])[0]
        assert torch.equal(together[i][0], lat), f"request {i}: vision differs when packed"
        assert (snd is None and together[i][1] is None) or torch.equal(together[i][1], snd), f"request {i}: sound"


def test_sound_refused_without_tokenizer_and_with_windows(nano_ckpt, ckpt):
    plain = PrefillStage(Checkpoint.open(nano_ckpt), "cpu", torch.float32, Defaults(32, 48, 9), Limits())
    with pytest.raises(RequestError, match="enable_sound: this checkpoint cannot make sound"):
        plain.validate(PROMPT, {"enable_sound": True}, None)
    assert plain.validate(PROMPT, {}, None).enable_sound is False  # the rest is served
    sound = PrefillStage(Checkpoint.open(ckpt), "cpu", torch.float32, Defaults(32, 48, 9), Limits())
    with pytest.raises(RequestError, match="window_mode: sound is not supported with AR windows"):
        sound.validate(PROMPT, {"enable_sound": True, "window_mode": "kv", "num_frames": 33}, None)
    with pytest.raises(RequestError, match="enable_sound: must be true or false"):
        sound.validate(PROMPT, {"enable_sound": "yes"}, None)
    with pytest.raises(RequestError, match="enable_sound: sound comes with a video"):
        sound.validate(PROMPT, {"enable_sound": True, "num_frames": 1}, None)
