"""Robot actions through a real tritonserver on a tiny checkpoint with an action head: each mode's served video and
actions equal the offline Generator's on the same deployment (bit for bit: same code, device and dtype); bad input
for each new field is an error naming it and the server keeps serving; the client writes the actions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from client.stream import ServerError, generate
from tests.conftest import SERVED_CONFIG, running_server
from tests.test_action import act, make_image
from tests.test_video_input import make_clip

pytestmark = pytest.mark.served

PROMPT = "push the block to the target"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, action_ckpt):
    import yaml

    from cosmos3_core.deployment import Deployment

    limits = {**SERVED_CONFIG["limits"], "max_height": 1280, "max_width": 1280, "max_chunk_size": 16}
    # JSON captions are long in the tiny byte-level tokenizer: pages for a few requests at once
    config = {**SERVED_CONFIG, "checkpoint": str(action_ckpt), "pool_pages": 256, "limits": limits}
    path = tmp_path_factory.mktemp("action_served") / "served.yaml"
    path.write_text(yaml.safe_dump(config))
    return Deployment.load(path)


@pytest.fixture(scope="module")
def action_server(deployment, tmp_path_factory):
    yield from running_server(deployment, tmp_path_factory.mktemp("serve_action"))


def test_served_actions_equal_offline(action_server, deployment):
    from cosmos3_core.generate import Generator

    gen = Generator(deployment)
    raw = np.random.default_rng(1).standard_normal((3, 9)).astype(np.float32)
    cases = [  # (parameters, image, clip, raw actions, action shape)
        ({**act("policy", 8, "bridge_orig_lerobot", resolution_tier=256), "seed": 4}, make_image(40, 56), None, None,
         (8, 10)),
        ({**act("forward_dynamics", 4, "av", resolution_tier=256), "seed": 5}, None, make_clip(5, 48, 64), raw, None),
        ({**act("inverse_dynamics", 6, "pusht", resolution_tier=256), "seed": 6}, None, make_clip(7, 40, 56), None,
         (6, 2)),
    ]  # fmt: skip
    for params, image, clip, raw_actions, shape in cases:
        params = {**params, "steps": 2}
        served = generate(action_server.url, PROMPT, params, image, video=clip, raw_actions=raw_actions)
        expected = gen.generate(PROMPT, params, image, video=clip, raw_actions=raw_actions)
        frames = gen.decode.run(expected.latents)
        assert served.video.shape == frames.shape and np.array_equal(served.video, frames)
        if shape is None:
            assert served.actions is None and expected.actions is None
        else:
            assert served.actions.dtype == np.float32 and served.actions.shape == shape
            assert np.array_equal(served.actions, expected.actions.numpy())
        done = next(e for e in served.events if e["type"] == "done")
        assert done["params"]["action"]["mode"] == params["action"]["mode"] and done["frames"] == frames.shape[0]


def act256(*args, **kw) -> dict:
    """An action request at tier 256 (480's canvas exceeds this deployment's pixel budget)."""
    return act(*args, **{"resolution_tier": 256, **kw})


BAD = [  # (parameters, image, clip, raw actions, what the error must say)
    (act256(domain="ur5"), make_image(40, 56), None, None, "action.domain: must be an embodiment"),
    (act256(domain="galbot"), make_image(40, 56), None, None, "action.domain: 'galbot' has 30 action channels"),
    (act256(chunk=17), make_image(40, 56), None, None, "action.chunk_size: must be in [1, 16]"),
    (act256(mode="rollout"), make_image(40, 56), None, None, "action.mode: must be one of"),
    (act256(resolution_tier=300), make_image(40, 56), None, None, "action.resolution_tier: must be one of"),
    (act256(view_point="top"), make_image(40, 56), None, None, "action.view_point: must be one of"),
    ({**act256(), "num_frames": 9}, make_image(40, 56), None, None, "num_frames: does not apply with `action`"),
    (act256("inverse_dynamics"), make_image(40, 56), None, None, "condition_video: mode inverse_dynamics needs a clip"),
    (act256("forward_dynamics", domain="av"), make_image(40, 56), None, np.zeros((4, 10), np.float32),
     "raw_actions: has 10 channels"),
    (act256("forward_dynamics", domain="av"), make_image(40, 56), None, np.zeros((2, 4, 9), np.float32),
     "input 'raw_actions'"),  # wrong rank: Triton names the input
    (act256("forward_dynamics", domain="av"), make_image(40, 56), None, np.zeros((4, 9), np.int32),
     "input 'raw_actions'"),  # wrong dtype: likewise
    (act256("forward_dynamics", domain="av"), make_image(40, 56), None, None, "raw_actions: mode forward_dynamics needs"),
    ({"action": "policy"}, make_image(40, 56), None, None, "action: must be a JSON object"),
]  # fmt: skip


def test_served_bad_action_input_then_served(action_server):
    for params, image, clip, raw, message in BAD:
        with pytest.raises(ServerError) as e:
            generate(action_server.url, PROMPT, params, image, video=clip, raw_actions=raw)
        assert message in str(e.value), (message, str(e.value))
    assert action_server.alive()
    ok = generate(action_server.url, PROMPT, {**act(resolution_tier=256), "steps": 1}, make_image(40, 56))
    assert ok.video.shape == (5, 32, 48, 3) and ok.actions.shape == (4, 2)


def test_client_writes_actions(action_server, tmp_path):
    import imageio.v2 as imageio

    from client.__main__ import main

    imageio.imwrite(tmp_path / "c.png", make_image(40, 56))
    args = ["generate", "--url", action_server.url, "--prompt", PROMPT, "--steps", "1", "--image",
            str(tmp_path / "c.png"), "--action-mode", "policy", "--chunk-size", "4", "--domain", "av",
            "--resolution-tier", "256", "--out", str(tmp_path / "v.npy"), "--actions-out", str(tmp_path / "a.json")]  # fmt: skip
    assert main(args) == 0
    actions = json.loads((tmp_path / "a.json").read_text())
    assert np.asarray(actions).shape == (4, 9) and np.load(tmp_path / "v.npy").shape == (5, 32, 48, 3)


def test_stops_promptly_after_a_request_triton_refused(action_server):
    """Last in this module (it stops the server): a request Triton itself refuses (raw_actions' data type, against
    the ensemble's config) keeps a reference to the ensemble in Triton 2.51, which then never unloads; the drained
    supervisor stops tritonserver once every stub is gone instead of waiting out its 30 s exit timeout."""
    import time

    from cosmos3_core.triton.launcher import stop_server

    with pytest.raises(ServerError, match="input 'raw_actions'"):
        generate(action_server.url, PROMPT, act256("forward_dynamics", domain="av"), make_image(40, 56),
                 raw_actions=np.zeros((4, 9), np.int32))  # fmt: skip
    t0 = time.monotonic()
    assert stop_server(action_server.proc) == 0
    assert time.monotonic() - t0 < 15.0
