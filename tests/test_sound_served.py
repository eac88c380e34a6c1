"""Sound through a real tritonserver on a tiny sound checkpoint: the served video and waveform equal the offline
Generator's on the same deployment; a request without sound gets no audio; a bad `enable_sound` is an error naming
it and the server keeps serving."""

from __future__ import annotations

import numpy as np
import pytest

from client.stream import ServerError, generate
from cosmos3_core.tools.make_tiny import make_tiny
from tests.conftest import SERVED_CONFIG, running_server

pytestmark = pytest.mark.served

PROMPT = "rain on a tin roof"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    import yaml

    from cosmos3_core.deployment import Deployment

    root = tmp_path_factory.mktemp("sound_served")
    ckpt = make_tiny(root / "nano", "nano", seed=7, sound=True)
    path = root / "served.yaml"
    path.write_text(yaml.safe_dump({**SERVED_CONFIG, "checkpoint": str(ckpt)}))
    return Deployment.load(path)


@pytest.fixture(scope="module")
def sound_server(deployment, tmp_path_factory):
    for server in running_server(deployment, tmp_path_factory.mktemp("serve_sound")):
        yield server.url


def test_served_sound_equals_offline(sound_server, deployment):
    from cosmos3_core.generate import Generator

    params = {"num_frames": 9, "steps": 3, "seed": 11, "enable_sound": True}
    served = generate(sound_server, PROMPT, params)
    frames, audio = Generator(deployment).frames_and_audio(PROMPT, params)
    assert served.video.dtype == np.uint8 and np.array_equal(served.video, frames)
    assert served.audio is not None and served.audio.dtype == np.float32
    assert served.audio.shape == audio.shape == (2, 15 * 1920)  # 9 frames at 16 fps, 48 kHz
    assert np.array_equal(served.audio, audio)  # same code, same device and dtype: bit-equal
    assert [e for e in served.events if e["type"] == "done"]


def test_no_sound_no_audio_and_bad_enable_sound(sound_server):
    plain = generate(sound_server, PROMPT, {"steps": 1, "seed": 1})
    assert plain.video.shape == (9, 32, 64, 3) and plain.audio is None  # the done response's audio is empty
    with pytest.raises(ServerError, match="enable_sound"):
        generate(sound_server, PROMPT, {"steps": 1, "enable_sound": "yes"})
    again = generate(sound_server, PROMPT, {"steps": 1, "seed": 2, "enable_sound": True})
    assert again.video.shape == (9, 32, 64, 3) and again.audio is not None and again.audio.shape == (2, 15 * 1920)


def test_client_mp4_carries_sound(sound_server, tmp_path):
    from client.__main__ import main
    from tests.test_media import read_mp4

    out = tmp_path / "c.mp4"
    assert (
        main(["generate", "--url", sound_server, "--prompt", PROMPT, "--steps", "1", "--sound", "--out", str(out)]) == 0
    )
    count, tracks = read_mp4(out)
    assert count == 9 and len(tracks) == 1 and tracks[0][:2] == (2, 48000) and abs(tracks[0][2] - 0.6) < 0.05
