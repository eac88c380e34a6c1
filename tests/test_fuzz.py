"""Bad requests the fuzzer (`bench/fuzz.py`) found, each pinned as a plain test, and a small fuzz run through the
served ensemble: no crash, no hang, every rejection names its field within 1 s, the server keeps serving."""

from __future__ import annotations

import numpy as np
import pytest

from cosmos3_core.requests import Defaults, Limits, RequestError, parse_parameters_json, validate

LIMITS = Limits(max_height=256, max_width=256, max_frames=33, max_image_pixels=65536, max_windows=8)
BASE = {"height": 32, "width": 32, "num_frames": 5, "steps": 1}


def check(params: dict, image: np.ndarray | None = None, prompt: bytes | str = "a fox"):
    return validate(prompt, {**BASE, **params}, image, Defaults(), LIMITS, 16, 4, 3.0)


@pytest.mark.parametrize(
    "params, field",
    [
        ({"height": float("inf")}, "height"),  # json.loads reads Infinity / NaN / 1e400
        ({"steps": float("-inf")}, "steps"),
        ({"num_frames": float("nan")}, "num_frames"),
        ({"window_mode": "kv", "window_frames": float("inf")}, "window_frames"),
        ({"fps": 10**400}, "fps"),  # an int too large for a float
        ({"guidance_scale": -(10**400)}, "guidance_scale"),
        ({"negative_prompt": "\ud800"}, "negative_prompt"),  # JSON "\ud800": a lone surrogate, not UTF-8
        ({"": 1}, "parameters"),  # an unknown key that is no name: the error names `parameters`
        ({"a: b": 1}, "parameters"),
        ({"cache": {"policy": "sea", "power_exp": 10**400}}, "cache.power_exp"),  # a field of the `cache` object
        ({"cache": {"policy": "sea", "threshold": float("inf")}}, "cache.threshold"),
        ({"cache": {"policy": "sea", "": 1}}, "cache"),  # an unknown field that is no name
    ],
)
def test_bad_values_are_rejected_naming_their_field(params, field):
    with pytest.raises(RequestError) as e:
        check(params)
    assert e.value.field == field and str(e.value).startswith(f"{field}: ")


@pytest.mark.parametrize(
    "raw",
    [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000, b'{"seed": 1' + b"0" * 5000 + b"}"],
)
def test_parameters_json_python_cannot_hold_is_rejected(raw):
    with pytest.raises(RequestError, match=r"^parameters: is not valid JSON"):
        parse_parameters_json(raw)


@pytest.mark.parametrize("shape", [(1, 65536, 3), (65536, 1, 3)])
def test_extreme_aspect_image_is_rejected_before_its_resize(shape):
    """Resized to cover 256x256 before the crop, a 1x65536 image would be 256x16.7M pixels (~50 GB in fp32):
    the prefill stub would be killed for memory."""
    with pytest.raises(RequestError, match=r"^image: .*aspect"):
        check({"height": 256, "width": 256}, np.zeros(shape, np.uint8))


def test_images_of_other_aspects_are_still_accepted():
    for shape in [(40, 56, 3), (1, 1, 3), (256, 256, 3), (256, 64, 3)]:
        assert check({"height": 64, "width": 32}, np.zeros(shape, np.uint8)).has_image


@pytest.mark.served
def test_fuzz_served(server, served_deployment):
    from bench.fuzz import run

    report = run(server.url, 100, served_deployment[1].limits, seed=1, probe_every=3, alive=server.alive)
    print(report.summary())
    assert report.ok, report.summary() + "\n" + "\n".join(report.failures[:10])
    assert report.counts["accepted"] and report.counts["rejected"]
