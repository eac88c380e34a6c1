"""AR sessions through a real server: a kept stream and its continuation give the frames one long stream gives (the
decoder goes on from the kept stream's state), a re-prompt is served, and refusals name `session`."""

from __future__ import annotations

import numpy as np
import pytest

from client.stream import ServerError, generate

pytestmark = pytest.mark.served

WINDOWS = {
    "chained": {"window_mode": "chained", "window_frames": 13, "overlap_frames": 8},  # 4 latent frames, 2 new a window
    "kv": {"window_mode": "kv", "window_frames": 9, "context_frames": 0},
}


@pytest.mark.parametrize("mode", list(WINDOWS))
def test_kept_and_continued_frames_equal_one_long_stream(server, mode):
    prompt, params = "a red car on a coast road", {**WINDOWS[mode], "seed": 3}
    whole = generate(server.url, prompt, {**params, "num_frames": 21})
    kept = params["window_frames"]  # one whole window
    first = generate(server.url, prompt, {**params, "num_frames": kept, "session": {"keep": True}})
    ident = first.events[-1]["session_id"]
    assert server.metrics(settle=True).get("cosmos3_sessions") == 1
    then = generate(server.url, prompt, {"num_frames": 21 - kept, "session": {"continue": ident}})
    done = then.events[-1]
    assert done["continues"] == ident and done["timings"]["prefill_s"] < 0.5  # no text tower
    joined = np.concatenate([first.video, then.video])
    assert joined.shape == whole.video.shape and np.array_equal(joined, whole.video)
    with pytest.raises(ServerError, match=f"session: {ident} has ended"):
        generate(server.url, prompt, {"num_frames": 4, "session": {"continue": ident}})
    assert server.metrics(settle=True).get("cosmos3_sessions") == 0


def test_a_reprompted_continuation_and_refusals_by_name(server):
    params = {**WINDOWS["kv"], "num_frames": 9, "session": {"keep": True}}
    ident = generate(server.url, "a red car", params).events[-1]["session_id"]
    with pytest.raises(ServerError, match="width: a continuation keeps its session's width"):
        generate(server.url, "a red car", {"width": 128, "session": {"continue": ident}})
    then = generate(
        server.url, "the car enters a tunnel", {"num_frames": 8, "session": {"continue": ident, "keep": True}}
    )
    assert then.video.shape[0] == 8 and then.events[-1]["session_id"] == ident
    with pytest.raises(ServerError, match="session: .* is unknown"):
        generate(server.url, "x", {"num_frames": 4, "session": {"continue": "0" * 32}})


def test_client_world_goes_on_reprompted_and_writes_the_whole_video(server, tmp_path, monkeypatch):
    import io

    from client.__main__ import main

    monkeypatch.setattr("sys.stdin", io.StringIO("the car turns left\n\nq\n"))  # a new prompt, go on, stop
    out = tmp_path / "world.npy"
    args = ["world", "--url", server.url, "--prompt", "a red car", "--window-mode", "kv", "--window-frames", "9",
            "--num-frames", "9", "--then-frames", "8", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    assert np.load(out).shape[0] == 9 + 8 + 8  # the first stream and two continuations
    assert len(list(tmp_path.glob("world.chunk*.mp4"))) >= 3


@pytest.fixture(scope="module")
def bf16_server(served_deployment, tmp_path_factory):
    """The served config in bfloat16, as a GPU serves: every tensor between the models has the deployment's type."""
    import dataclasses

    from tests.conftest import running_server

    d = dataclasses.replace(served_deployment[1], dtype="bfloat16", safety_checker="none")
    yield from running_server(d, tmp_path_factory.mktemp("serve_bf16"))


def test_a_same_prompt_continuation_is_served_in_bfloat16(bf16_server):
    """Its prefill sends no text K/V: the placeholder still has the model config's type (BF16, not FP32)."""
    params = {**WINDOWS["kv"], "num_frames": 9, "seed": 5, "session": {"keep": True}}
    ident = generate(bf16_server.url, "a red car", params).events[-1]["session_id"]
    then = generate(bf16_server.url, "a red car", {"num_frames": 8, "session": {"continue": ident}})
    assert then.video.shape[0] == 8 and then.events[-1]["continues"] == ident
