"""Every stream ends, every cancel stops the work, every part comes back every time (docs/operations.md), through
real servers on the CPU:

- a client that cancels after its first frames (raw tritonclient: `stop_stream(cancel_requests=True)`) while later
  pieces still decode is counted `cancelled`, never `completed`, and its pages are freed;
- a decoder killed after a stream's first frames: the stream ends with `part_died("vae_decode")` within 5 s;
- the same part killed twice in one server's life is served again both times, and SIGINT still stops the server.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from bench.faults_part import Supervised, kill_part
from client.stream import ServerError, generate
from cosmos3_core import errors

pytestmark = pytest.mark.served

# 33 frames → 9 latent frames → 3 pieces of decode_chunk_frames (4): seconds of decode after the first frames
LONG_DECODE = {"steps": 4, "num_frames": 33, "height": 128, "width": 128}


def wait_for(server, done, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while not done(m := server.metrics()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return m


def test_a_cancel_after_the_first_frames_is_counted_cancelled_not_completed(server):
    before = server.metrics(settle=True)
    r = generate(server.url, "a long decode", {**LONG_DECODE, "seed": 21}, cancel_after=lambda e: e["type"] == "chunk",
                 timeout_s=300)  # fmt: skip
    assert r.events[-1]["type"] == "chunk" and r.frames, r.events
    key = "cosmos3_requests_total:cancelled"
    m = wait_for(server, lambda m: m.get(key, 0) > before.get(key, 0))
    time.sleep(1.0)  # nothing more is counted after it
    m = server.metrics(settle=True)
    ended = {k.split(":")[1]: m.get(k, 0) - before.get(k, 0) for k in m if k.startswith("cosmos3_requests_total:")}
    assert ended.get("cancelled") == 1 and sum(ended.values()) == 1, ended
    assert m["cosmos3_kv_pages_used"] == 0 and m["cosmos3_live_requests"] == 0


@pytest.fixture(scope="module")
def supervised(served_deployment, tmp_path_factory):
    server = Supervised(
        str(served_deployment[0]), tmp_path_factory.mktemp("streams"), {"COSMOS3_FAULTS": "step_delay_s=0.05"}
    )
    try:
        server.wait_ready(600)
        yield server
    finally:
        server.stop()


def test_a_decoder_killed_after_the_first_frames_ends_the_stream_naming_it(supervised):
    first, out = threading.Event(), {}

    def run() -> None:
        try:
            generate(supervised.url, "killed mid-decode", {**LONG_DECODE, "seed": 31},
                     on_event=lambda e, f: f is not None and first.set(), timeout_s=300)  # fmt: skip
            out["end"] = "finished"
        except ServerError as e:
            out["end"] = f"error: {e}"
        out["t"] = time.monotonic()
        first.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert first.wait(300) and "end" not in out, out
    t_kill = time.monotonic()
    os.kill(supervised.stub("vae_decode"), signal.SIGKILL)
    thread.join(60)
    assert out.get("end") == f"error: {errors.part_died('vae_decode')}", out
    assert out["t"] - t_kill < 5.0, out["t"] - t_kill
    supervised.wait_ready(300)


def test_the_same_part_killed_twice_comes_back_both_times_and_sigint_stops(supervised):
    for i in range(2):
        r = kill_part(supervised, "denoise", 40, seed=40 + i, back_timeout_s=240)
        print(r)
        assert r["in_flight"] == f"error: {errors.part_died('denoise')}", r
        assert r["served_again_s"] is not None and r["restarts_total"] == 1, r
    t0 = time.monotonic()
    supervised.proc.send_signal(signal.SIGINT)
    assert supervised.proc.wait(120) == 0
    print(f"stopped {time.monotonic() - t0:.1f} s after SIGINT")
