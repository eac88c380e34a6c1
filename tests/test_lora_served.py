"""LoRA adapters through a real tritonserver (a tiny checkpoint with sound and an action head, `max_loras: 2`):
concurrent t2v / i2v / action requests on three adapters — one on the generation tower, one on both towers, at
scales 1 and 0.5 — equal the offline Generator's on the same deployment bit for bit (same code, device and dtype;
the offline path is checked against diffusers in test_lora.py), a third adapter waiting for a slot instead of
evicting one in use; `done.params` echoes `lora`; the client's `--lora NAME --lora-scale S`; bad input naming its
field, the server serving the next request; an adapter added while serving."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bench.pool import run_pool
from client.stream import ServerError, generate
from cosmos3_core.tools.make_lora import make_lora
from tests.conftest import SERVED_CONFIG, running_server
from tests.test_action import act, make_image
from tests.test_lora import bad_adapters

pytestmark = pytest.mark.served

PROMPT = "a robot arm stacks wooden blocks"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, action_ckpt):
    import yaml

    from cosmos3_core.deployment import Deployment

    loras = tmp_path_factory.mktemp("served_loras")
    make_lora(action_ckpt, loras / "gen", rank=4, targets=("gen",), alpha=8, seed=1)
    make_lora(action_ckpt, loras / "both", rank=6, targets=("gen", "und"), seed=2, std=0.2)
    make_lora(action_ckpt, loras / "mlp", rank=5, targets=("mlp_moe_gen.up_proj", "mlp_moe_gen.down_proj"), seed=5)
    make_lora(action_ckpt, loras / "big_rank", rank=16, targets=("gen",), seed=6)
    bad_adapters(loras, loras / "gen")
    limits = {**SERVED_CONFIG["limits"], "max_height": 1280, "max_width": 1280, "max_chunk_size": 16}
    config = {**SERVED_CONFIG, "checkpoint": str(action_ckpt), "pool_pages": 256, "limits": limits,
              "lora_dir": str(loras), "max_loras": 2, "max_lora_rank": 8}  # fmt: skip
    path = tmp_path_factory.mktemp("lora_served") / "served.yaml"
    path.write_text(yaml.safe_dump(config))
    return Deployment.load(path)


@pytest.fixture(scope="module")
def lora_server(deployment, tmp_path_factory):
    yield from running_server(deployment, tmp_path_factory.mktemp("serve_lora"))


@pytest.fixture(scope="module")
def offline(deployment):
    from cosmos3_core.generate import Generator

    return Generator(deployment)


SMALL = {"num_frames": 5, "steps": 2}
CASES = [  # (parameters, image)
    ({**SMALL, "seed": 1, "lora": {"name": "gen"}}, None),
    ({**SMALL, "seed": 2, "lora": {"name": "both", "scale": 0.5}}, None),
    ({**SMALL, "seed": 3, "lora": {"name": "mlp"}}, make_image(40, 56)),  # i2v; a third adapter in two slots
    ({**act("policy", 4, "bridge_orig_lerobot", resolution_tier=256), "steps": 2, "seed": 4, "lora": {"name": "both"}},
     make_image(40, 56)),
]  # fmt: skip


def test_served_adapters_equal_offline(lora_server, offline):
    results = dict(run_pool(range(len(CASES)), len(CASES), lambda i: (i, generate(lora_server.url, PROMPT, *CASES[i]))))
    for i, (params, image) in enumerate(CASES):
        served = results[i]
        expected = offline.generate(PROMPT, params, image)
        assert np.array_equal(served.video, offline.decode.run(expected.latents)), f"case {i}: video differs"
        if expected.actions is not None:
            assert np.array_equal(served.actions, expected.actions.numpy()), f"case {i}: actions differ"
        done = next(e for e in served.events if e["type"] == "done")
        assert done["params"]["lora"] == {"name": params["lora"]["name"], "scale": params["lora"].get("scale", 1.0)}
    base = offline.generate(PROMPT, {k: v for k, v in CASES[0][0].items() if k != "lora"})
    assert not torch.equal(base.latents, offline.generate(PROMPT, CASES[0][0]).latents), "the adapter had no effect"


def test_client_lora_flags(lora_server, offline, tmp_path):
    from client.__main__ import main

    out = tmp_path / "v.npy"
    argv = ["generate", "--url", lora_server.url, "--prompt", PROMPT, "--num-frames", "5", "--steps", "2", "--seed",
            "7", "--lora", "gen", "--lora-scale", "0.5", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    expected = offline.frames(PROMPT, {**SMALL, "seed": 7, "lora": {"name": "gen", "scale": 0.5}})
    assert np.array_equal(np.load(out), expected)


BAD = [  # (parameters.lora, the error's start)
    ("gen", "lora: must be a JSON object"),
    ({"scale": 1.0}, "lora.name: must be the name"),
    ({"name": "../gen"}, "lora.name: must match"),
    ({"name": ".."}, "lora.name: must match"),
    ({"name": "no_such_adapter"}, "lora.name: no adapter"),
    ({"name": "gen", "scale": float("nan")}, "lora.scale: must be a finite number"),
    ({"name": "gen", "scale": 1e9}, "lora.scale: must be a finite number"),
    ({"name": "gen", "alpha": 2}, "lora.alpha: unknown field"),
    ({"name": "pickled"}, "lora: pickled: pickled weights are refused"),
    ({"name": "wrong_shape"}, "lora: wrong_shape:"),
    ({"name": "wrong_key"}, "lora: wrong_key:"),
    ({"name": "half_pair"}, "lora: half_pair:"),
    ({"name": "not_finite"}, "lora: not_finite:"),
    ({"name": "dora"}, "lora: dora: use_dora"),
    ({"name": "big_rank"}, "lora: big_rank:"),
]


def test_bad_lora_input_named_and_the_server_serves_on(lora_server, deployment, action_ckpt, offline):
    for value, message in BAD:
        params = json.dumps({"num_frames": 1, "steps": 1, "lora": value})  # NaN as JSON's NaN token
        with pytest.raises(ServerError) as e:
            generate(lora_server.url, PROMPT, params)
        assert message in str(e.value), (value, str(e.value))
        assert lora_server.alive()
    # and an adapter added while serving is served, no restart
    make_lora(action_ckpt, f"{deployment.lora_dir}/added_later", rank=2, targets=("und", "add_v_proj"), seed=9)
    params = {"num_frames": 1, "steps": 1, "lora": {"name": "added_later"}}
    ok = generate(lora_server.url, PROMPT, params)
    assert np.array_equal(ok.video, offline.frames(PROMPT, params)) and lora_server.alive()
