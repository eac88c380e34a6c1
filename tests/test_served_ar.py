"""Nano AR through tritonserver: concurrent streams equal their solo runs, cancel mid-stream, metrics, client."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from bench.pool import run_pool
from client.stream import generate
from tests.test_served import wait_metric

pytestmark = pytest.mark.served

CHAINED = {"window_mode": "chained", "num_frames": 33, "window_frames": 17, "overlap_frames": 8, "steps": 3, "seed": 21}
KV = {"window_mode": "kv", "num_frames": 33, "window_frames": 9, "context_frames": 13, "steps": 3, "seed": 22}
SINGLE = {"num_frames": 9, "steps": 8, "seed": 23}


def test_two_streams_and_a_single_shot_equal_solo(server, offline):
    before = server.metrics(settle=True)
    jobs = [("a harbour", CHAINED), ("a forest path", KV), ("a kite", SINGLE)]
    results = dict(run_pool(range(len(jobs)), len(jobs), lambda i: (i, generate(server.url, *jobs[i]))))
    after = server.metrics(settle=True)
    for i, (prompt, params) in enumerate(jobs):
        r = results[i]
        expected = offline.frames(prompt, params)
        bad = [t for t in range(expected.shape[0]) if not np.array_equal(r.video[t], expected[t])]
        assert not bad, (
            f"{prompt} differs from its solo run at frames {bad}: {[(e['type'], e.get('frame_offset')) for e in r.events if e['type'] != 'progress']}"
        )
        chunks = [e for e in r.events if e["type"] in ("chunk", "done")]
        assert [c["window"] for c in chunks] == sorted(c["window"] for c in chunks)
        assert [c["frame_offset"] for c in chunks] == list(np.cumsum([0] + [c["frames"] for c in chunks[:-1]]))
        assert chunks[-1]["window"] == chunks[-1]["windows"] - 1 and chunks[-1]["type"] == "done"
    # chained, 9 latent frames: windows of 5 (4 + 1 pieces), 3 new, 1 new → 3 windows
    assert sorted({e["window"] for e in results[0].events if e["type"] in ("chunk", "done")}) == [0, 1, 2]
    assert after["cosmos3_max_requests_per_tick"] >= 2
    assert after["cosmos3_ttfc_seconds_count"] - before.get("cosmos3_ttfc_seconds_count", 0) == 3
    pieces = sum(len([e for e in results[i].events if e["type"] in ("chunk", "done")]) for i in range(3))
    gaps = after["cosmos3_chunk_gap_seconds_count"] - before.get("cosmos3_chunk_gap_seconds_count", 0)
    assert gaps == pieces - 3  # every piece after a request's first
    assert after["cosmos3_kv_pages_used"] == 0


def test_cancel_mid_stream(server):
    before = server.metrics(settle=True)
    params = {**KV, "num_frames": 65, "steps": 40}  # 6 windows × 40 steps: seconds, even on a loaded machine
    r = generate(server.url, "a very long road", params, cancel_after=lambda e: e["type"] == "chunk")
    assert len([e for e in r.events if e["type"] == "chunk"]) == 1 and not any(e["type"] == "done" for e in r.events)
    m = wait_metric(server, "cosmos3_requests_total:cancelled", before["cosmos3_requests_total:cancelled"] + 1, 30)
    assert m["cosmos3_requests_total:cancelled"] == before["cosmos3_requests_total:cancelled"] + 1
    assert m["cosmos3_kv_pages_used"] == 0 and m["cosmos3_live_requests"] == 0
    assert generate(server.url, "after", {"steps": 2}).video.shape == (9, 32, 64, 3)


def test_client_stream_command(server, served_deployment, tmp_path):
    out = tmp_path / "long.mp4"
    args = [
        "--url",
        server.url,
        "--prompt",
        "a river",
        "--num-frames",
        "33",
        "--window-frames",
        "17",
        "--steps",
        "2",
        "--out",
        str(out),
    ]
    r = subprocess.run([sys.executable, "-m", "client", "stream", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert out.is_file() and len(list(tmp_path.glob("long.chunk*.mp4"))) >= 3
    import imageio.v3 as iio

    fps = served_deployment[1].defaults.fps  # the server's default rate: the request sent none
    for path in [out, *tmp_path.glob("long.chunk*.mp4")]:
        assert iio.immeta(path)["fps"] == pytest.approx(fps), path
    assert "TTFC" in r.stderr and "chunk gaps" in r.stderr and "frames/s" in r.stderr
