"""The product through a real tritonserver on loopback: equality with the offline CLI path, shared engine
steps, cancellation, and bad input that never kills a stub."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from bench.pool import run_pool
from client.stream import ServerError, generate

pytestmark = pytest.mark.served

CASES = {
    "t2i": ({"num_frames": 1, "height": 64, "width": 32, "seed": 3}, False),
    "t2v": ({"num_frames": 9, "seed": 4, "negative_prompt": "blurry"}, False),
    "i2v": ({"num_frames": 9, "seed": 5}, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_served_equals_offline(server, offline, case, test_image):
    params, with_image = CASES[case]
    image = test_image if with_image else None
    served = generate(server.url, "a lighthouse at dusk", params, image)
    expected = offline.frames("a lighthouse at dusk", params, image)
    assert served.video.dtype == np.uint8 and served.video.shape == expected.shape
    assert np.array_equal(served.video, expected)
    done = [e for e in served.events if e["type"] == "done"]
    assert len(done) == 1 and done[0]["frames"] == expected.shape[0]
    assert [e["step"] for e in served.events if e["type"] == "progress"] == list(
        range(1, offline.prefill.defaults.t2v.steps + 1)
    )


def test_concurrent_requests_share_steps(server, offline):
    requests = [
        ("a red fox", {"num_frames": 17, "height": 64, "width": 128, "steps": 40, "seed": 1}),
        ("a blue boat", {"num_frames": 9, "height": 128, "width": 64, "steps": 30, "seed": 2, "guidance_scale": 1.0}),
        ("a green hill", {"num_frames": 1, "height": 64, "width": 64, "steps": 50, "seed": 3}),
    ]
    before = server.metrics(settle=True)
    results = dict(run_pool(range(len(requests)), len(requests), lambda i: (i, generate(server.url, *requests[i]))))
    after = server.metrics(settle=True)
    for i, (prompt, params) in enumerate(requests):
        assert np.array_equal(results[i].video, offline.frames(prompt, params)), f"request {i} differs from solo"
    ticks = after["cosmos3_engine_ticks_total"] - before["cosmos3_engine_ticks_total"]
    steps = after["cosmos3_request_steps_total"] - before["cosmos3_request_steps_total"]
    assert steps == 40 + 30 + 50
    assert ticks < steps, "requests never shared a packed forward"
    assert after["cosmos3_max_requests_per_tick"] >= 2


def wait_metric(server, key: str, value: float, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m.get(key) == value or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_cancel_frees_pages_and_server_keeps_serving(server):
    before = server.metrics(settle=True)
    params = {"num_frames": 33, "height": 128, "width": 128, "steps": 60, "seed": 9}
    r = generate(server.url, "a long one", params, cancel_after=lambda e: e.get("step") == 2)
    assert [e["step"] for e in r.events] == [1, 2]
    m = wait_metric(server, "cosmos3_requests_total:cancelled", before["cosmos3_requests_total:cancelled"] + 1)
    assert m["cosmos3_requests_total:cancelled"] == before["cosmos3_requests_total:cancelled"] + 1
    steps_run = m["cosmos3_request_steps_total"] - before["cosmos3_request_steps_total"]
    assert steps_run <= 3, f"cancelled at step 2 but ran {steps_run} steps"  # stops within one step
    m = wait_metric(server, "cosmos3_kv_pages_used", 0)  # gauges are polled: one scrape may pair old and new values
    assert m["cosmos3_kv_pages_used"] == 0 and m["cosmos3_live_requests"] == 0
    assert generate(server.url, "next", {"steps": 2}).video.shape == (9, 32, 64, 3)


def ensemble_requests_ended(server) -> float:
    """The ensemble's success and failure counts: Triton counts a request only once it is released (a failed or
    cancelled one may count twice), so a request held in flight never moves them."""
    import re
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    pattern = r'^nv_inference_request_(?:success|failure)\{model="cosmos3",(?:reason="\w+",)?version="1"\} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def test_cancelled_and_failed_requests_end_in_the_ensemble(server):
    """No step answers with an error while another step of the request is in flight: Triton 2.51 would then keep
    the ensemble request in flight forever (triton/cancel.py). One request at a time, each must be released."""
    long = {"num_frames": 33, "height": 128, "width": 128, "steps": 60, "seed": 9}

    def cancelled() -> None:
        generate(server.url, "a long one", long, cancel_after=lambda e: e.get("step") == 2)

    def failed() -> None:
        with pytest.raises(ServerError, match="injected fault"):
            generate(server.url, "fails in its step", {"steps": 5, "seed": 666})

    for name, run in (("cancelled", cancelled), ("cancelled again", cancelled), ("failed", failed)):
        before = ensemble_requests_ended(server)
        run()
        deadline = time.monotonic() + 15
        while ensemble_requests_ended(server) == before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ensemble_requests_ended(server) > before, f"the {name} request stayed in flight"


def test_failing_request_fails_alone(server):
    """An exception inside one request's step fails that request only; its neighbour completes."""
    results: dict[str, object] = {}

    def run(name: str, seed: int) -> None:
        try:
            results[name] = generate(server.url, name, {"steps": 20, "seed": seed})
        except ServerError as e:
            results[name] = e

    threads = [threading.Thread(target=run, args=("ok", 1)), threading.Thread(target=run, args=("bad", 666))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert isinstance(results["bad"], ServerError) and "injected fault" in str(results["bad"])
    assert results["ok"].video.shape == (9, 32, 64, 3)
    assert wait_metric(server, "cosmos3_kv_pages_used", 0)["cosmos3_kv_pages_used"] == 0


def test_failing_decode_answers_with_an_error_and_the_next_request_is_served(server):
    """An exception in vae_decode's send thread becomes that request's final error; the thread lives on."""
    with pytest.raises(ServerError, match="injected fault in the decode"):
        generate(server.url, "bad decode", {"steps": 2, "seed": 667}, timeout_s=60)
    assert generate(server.url, "next", {"steps": 2, "seed": 1}, timeout_s=60).video.shape == (9, 32, 64, 3)


BAD = [
    ("", {}, None, "prompt: must not be empty"),
    (b"\xff\xfe bad", {}, None, "prompt: is not valid UTF-8"),
    ("word " * 400, {}, None, "tokens with templates, limit 600"),
    ("x" * 3000, {}, None, "prompt: is 3000 bytes, limit 2048"),
    ("ok", "{not json", None, "parameters: is not valid JSON"),
    ("ok", {"heigth": 64}, None, "heigth: unknown parameter"),
    ("ok", {"height": 40}, None, "height: must be a multiple of 16"),
    ("ok", {"width": 4096}, None, "width: must be in [16, 256]"),
    ("ok", {"num_frames": 8}, None, "num_frames: must be 1 mod 4"),
    ("ok", {"num_frames": 37}, None, "num_frames: must be in [1, 33]"),
    ("ok", {"steps": 0}, None, "steps: must be in [1, 60]"),
    ("ok", {"steps": 61}, None, "steps: must be in [1, 60]"),
    ("ok", {"guidance_scale": -1}, None, "guidance_scale: must be in"),
    ("ok", '{"guidance_scale": NaN}', None, "guidance_scale: must be a finite number"),
    ("ok", {"seed": "x"}, None, "seed: must be an integer"),
    ("ok", {}, np.zeros((8, 8), np.uint8), "input 'image'"),  # wrong rank: Triton rejects it, naming the input
    ("ok", {}, np.zeros((8, 8, 3), np.float32), "input 'image'"),  # wrong dtype: likewise
    ("ok", {}, np.zeros((8, 8, 4), np.uint8), "image: must be [H, W, 3]"),
    ("ok", {}, np.zeros((300, 300, 3), np.uint8), "image: has 300x300 pixels"),
    ("ok", {"num_frames": 1}, np.zeros((8, 8, 3), np.uint8), "image: an image conditions video only"),
]


@pytest.mark.parametrize(
    "prompt, params, image, message", BAD, ids=[b[3].split(":")[0] + str(i) for i, b in enumerate(BAD)]
)
def test_bad_input_named_error_then_served(server, prompt, params, image, message):
    with pytest.raises(ServerError) as e:
        generate(server.url, prompt, params, image)
    assert message in str(e.value)
    assert generate(server.url, "fine", {"steps": 1, "num_frames": 1, "height": 32, "width": 32}).video.shape == (
        1,
        32,
        32,
        3,
    )
