"""v2v end to end: the CLI against `Cosmos3OmniPipeline(video=...)` (fp32, CPU, tiny checkpoint), a packed forward
mixing v2v and t2v requests against each alone, served against offline, and every new field's bad input."""

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
from tests.conftest import KeepSink, reference_pipeline, rel_l2, run_reference
from tests.test_video_input import make_clip

PROMPT = "a paper boat drifts down a gutter"
BASE = dict(num_frames=17, height=32, width=48, steps=3, guidance_scale=5.0, shift=8.0, seed=4)


def reference_v2v(pipe, clip: np.ndarray, params: dict, indexes, keep: str) -> torch.Tensor:
    video = [Image.fromarray(f) for f in clip]
    return run_reference(pipe, PROMPT, params, None, video=video, condition_frame_indexes_vision=list(indexes),
                         condition_video_keep=keep)  # fmt: skip


def cli(ckpt, params: dict, clip_path, out, indexes, keep) -> list[str]:
    flags = {"num_frames": "--num-frames", "guidance_scale": "--guidance"}
    args = ["--checkpoint", str(ckpt), "--prompt", PROMPT, "--out", str(out), "--video", str(clip_path)]
    args += ["--condition-frames", ",".join(map(str, indexes)), "--condition-keep", keep]
    for k, v in params.items():
        args += [flags.get(k, f"--{k}"), str(v)]
    return args


CASES = [  # (clip frames, indexes, keep): longer / shorter than the max(idx)*4+1 frames needed, gaps
    (12, (0, 1), "first"),
    (12, (0, 1), "last"),
    (3, (0, 1), "first"),
    (12, (0, 2), "last"),
    (6, (0, 2), "first"),
]


@pytest.fixture(scope="module")
def pipe(nano_ckpt):
    return reference_pipeline(nano_ckpt)


@pytest.mark.parametrize("frames,indexes,keep", CASES)
def test_cli_v2v_matches_pipeline(nano_ckpt, pipe, tmp_path, frames, indexes, keep):
    clip = make_clip(frames, seed=frames)
    np.save(tmp_path / "clip.npy", clip)
    out = tmp_path / "latents.pt"
    assert main(cli(nano_ckpt, BASE, tmp_path / "clip.npy", out, indexes, keep)) == 0
    ours = torch.load(out)
    ref = reference_v2v(pipe, clip, BASE, indexes, keep)
    assert ours.shape == ref.shape == (1, 16, 5, 2, 3)
    assert rel_l2(ours, ref) <= 1e-4


def test_cli_reads_mp4(nano_ckpt, tmp_path):
    from cosmos3_core.generate import load_video
    from cosmos3_core.media import write_frames

    write_frames(tmp_path / "clip.mp4", make_clip(5, 32, 48), 8.0)
    clip = load_video(str(tmp_path / "clip.mp4"))
    assert clip.dtype == np.uint8 and clip.shape == (5, 32, 48, 3)
    assert main(cli(nano_ckpt, {**BASE, "steps": 1}, tmp_path / "clip.mp4", tmp_path / "o.npy", (0, 1), "first")) == 0
    assert np.load(tmp_path / "o.npy").shape == (17, 32, 48, 3)


@pytest.fixture(scope="module")
def parts(nano_ckpt):
    ckpt = Checkpoint.open(nano_ckpt)
    defaults = Defaults(height=32, width=48, num_frames=17)
    return ckpt, PrefillStage(ckpt, "cpu", torch.float32, defaults, Limits(max_video_frames=64, max_image_pixels=65536))


def test_packed_v2v_and_t2v_equal_each_alone(parts):
    ckpt, prefill = parts
    clip = make_clip(12)
    requests = [
        ({"steps": 3, "seed": 1, "condition_frame_indexes": [0, 2]}, clip),
        ({"steps": 3, "seed": 2}, None),
        ({"steps": 3, "seed": 3, "condition_video_keep": "last", "guidance_scale": 1.0}, clip),
    ]
    pre = [prefill.run(prefill.validate(PROMPT, q, None, v), None, v) for q, v in requests]

    def run(items):
        engine = DenoiseEngine(ckpt, "cpu", torch.float32, 128, 16, 8)
        sinks = [KeepSink() for _ in items]
        for r, s in zip(items, sinks):
            engine.submit(r, s)
        engine.run_until_idle()
        return [s.latents for s in sinks], engine.stats.max_requests_in_tick

    together, packed = run(pre)
    assert packed == 3
    for i, r in enumerate(pre):
        assert torch.equal(together[i], run([r])[0][0]), f"request {i} differs when packed"


BAD = [  # (params, image, video, message)
    (
        {},
        np.zeros((8, 8, 3), np.uint8),
        make_clip(3),
        "condition_video: pass either `image` (i2v) or `condition_video` (v2v)",
    ),
    ({"num_frames": 1}, None, make_clip(3), "condition_video: a clip conditions video only"),
    ({}, None, np.zeros((3, 8, 8), np.uint8), "condition_video: must be [T, H, W, 3]"),
    ({}, None, np.zeros((3, 8, 8, 4), np.uint8), "condition_video: must be [T, H, W, 3]"),
    ({}, None, np.zeros((3, 8, 8, 3), np.float32), "condition_video: must be UINT8"),
    ({}, None, np.zeros((0, 8, 8, 3), np.uint8), "condition_video: has 0 frames"),
    ({}, None, np.zeros((65, 8, 8, 3), np.uint8), "condition_video: has 65 frames"),
    ({}, None, np.zeros((2, 300, 300, 3), np.uint8), "condition_video: has 300x300 pixels"),
    ({"condition_frame_indexes": [0, 5]}, None, make_clip(3), "condition_frame_indexes: must be < 5"),
    ({"condition_frame_indexes": [0, -1]}, None, make_clip(3), "condition_frame_indexes: must be a list"),
    ({"condition_frame_indexes": [0, 1.5]}, None, make_clip(3), "condition_frame_indexes: must be a list"),
    ({"condition_frame_indexes": "01"}, None, make_clip(3), "condition_frame_indexes: must be a list"),
    ({"condition_frame_indexes": []}, None, make_clip(3), "condition_frame_indexes: must contain"),
    ({"condition_frame_indexes": [0]}, None, None, "condition_frame_indexes: only applies with a `video`"),
    ({"condition_video_keep": "middle"}, None, make_clip(3), "condition_video_keep: must be 'first' or 'last'"),
    ({"condition_video_keep": "last"}, None, None, "condition_video_keep: only applies"),
    (
        {"window_mode": "chained", "num_frames": 33},
        None,
        make_clip(3),
        "condition_video: v2v is not supported with window_mode",
    ),
]


@pytest.mark.parametrize("params,image,video,message", BAD, ids=[b[3][:40] for b in BAD])
def test_bad_input_names_the_field(parts, params, image, video, message):
    with pytest.raises(RequestError) as e:
        parts[1].validate(PROMPT, params, image, video)
    assert message in str(e.value)


def test_v2v_params_echo_and_roundtrip(parts):
    from cosmos3_core.requests import GenerationParams

    p = parts[1].validate(PROMPT, {"condition_frame_indexes": [2, 0]}, None, make_clip(3))
    assert p.task == "v2v" and p.clean_frames == (0, 2) and p.resolved()["condition_frame_indexes"] == (2, 0)
    assert GenerationParams.from_json(p.to_json()) == p
    t2v = parts[1].validate(PROMPT, {}, None, None)
    assert "condition_frame_indexes" not in t2v.resolved() and t2v.clean_frames == ()


@pytest.mark.served
def test_served_v2v_equals_offline(server, offline):
    from client.stream import generate

    clip = make_clip(12, 40, 56)
    for params in ({"seed": 5, "condition_frame_indexes": [0, 2], "condition_video_keep": "last"}, {"seed": 6}):
        served = generate(server.url, PROMPT, params, video=clip)
        expected = offline.frames(PROMPT, params, video=clip)
        assert served.video.shape == expected.shape and np.array_equal(served.video, expected)
        done = next(e for e in served.events if e["type"] == "done")
        assert done["params"]["condition_frame_indexes"] == params.get("condition_frame_indexes", [0, 1])


@pytest.mark.served
@pytest.mark.parametrize(
    "params,image,video,message",
    [
        ({}, np.zeros((8, 8, 3), np.uint8), make_clip(3), "condition_video: pass either"),
        ({"num_frames": 1}, None, make_clip(3), "condition_video: a clip conditions video only"),
        ({}, None, np.zeros((3, 8, 8), np.uint8), "input 'condition_video'"),  # wrong rank: Triton names the input
        ({}, None, np.zeros((3, 8, 8, 3), np.float32), "input 'condition_video'"),  # wrong dtype: likewise
        ({"condition_frame_indexes": [0, 9]}, None, make_clip(3), "condition_frame_indexes: must be <"),
        ({"condition_frame_indexes": ["a"]}, None, make_clip(3), "condition_frame_indexes: must be a list"),
        ({"condition_video_keep": 1}, None, make_clip(3), "condition_video_keep: must be"),
    ],
)
def test_served_bad_v2v_input_then_served(server, params, image, video, message):
    from client.stream import ServerError, generate

    with pytest.raises(ServerError) as e:
        generate(server.url, PROMPT, params, image, video=video)
    assert message in str(e.value)
    assert generate(server.url, "fine", {"steps": 1, "num_frames": 1, "height": 32, "width": 32}).video.shape[0] == 1
