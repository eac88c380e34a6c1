"""A small soak through the real server: mixed single-shot and AR requests, a quarter cancelled at random
points. Nothing lost, nothing mismatched, pages back to baseline; over-limit requests rejected fast."""

from __future__ import annotations

import time

import pytest

from bench.soak import check, make_requests, run_soak
from client.stream import ServerError, generate
from tests.test_served import wait_metric

pytestmark = pytest.mark.served


def test_small_soak(server, offline):
    requests = make_requests(64, cancel=0.3, seed=1)
    assert sum(r["cancel_at"] is not None for r in requests) >= 0.2 * len(requests)
    outcomes = run_soak(server.url, requests, concurrency=6)
    report = check(outcomes, offline)
    print(report["counts"])
    assert len(outcomes) == 64
    assert (
        report["lost"] == 0 and not report["mismatched"] and not report["bad_finals"] and not report["unclear_errors"]
    )
    assert report["counts"].get("completed", 0) >= 30
    m = wait_metric(server, "cosmos3_kv_pages_used", 0)
    assert m["cosmos3_kv_pages_used"] == 0 and m["cosmos3_live_requests"] == 0 and m["cosmos3_queue_depth"] == 0


def test_over_limit_rejected_fast_without_allocating(server):
    before = server.metrics(settle=True)
    for params in ({"steps": 1000}, {"num_frames": 4097}, {"height": 4096}):
        t = time.perf_counter()
        with pytest.raises(ServerError):
            generate(server.url, "too much", params)
        assert time.perf_counter() - t < 0.05
    after = server.metrics(settle=True)
    assert after["cosmos3_kv_pages_used"] == 0
    assert after["cosmos3_engine_ticks_total"] == before["cosmos3_engine_ticks_total"]  # no work was done
