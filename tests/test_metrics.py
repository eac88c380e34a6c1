"""Scrape the metrics port during and after a run: every engine and latency metric moves as it should."""

from __future__ import annotations

import threading
import time

import pytest

from client.stream import ServerError, generate

pytestmark = pytest.mark.served


def test_metrics_move_during_a_run(server):
    before = server.metrics(settle=True)
    during: list[dict[str, float]] = []
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            during.append(server.metrics())
            time.sleep(0.1)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    threads = [
        threading.Thread(target=generate, args=(server.url, f"m{i}", {"steps": 30, "seed": i})) for i in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    with pytest.raises(ServerError):
        generate(server.url, "", {})  # rejected in prefill: counted by Triton, not by the engine
    with pytest.raises(ServerError):
        generate(server.url, "x", {"window_mode": "kv", "num_frames": 33, "window_frames": 9, "seed": 666, "steps": 1})
    stop.set()
    scraper.join()
    after = server.metrics(settle=True)

    def grew(key: str, by: float = 1) -> bool:
        return after.get(key, 0) - before.get(key, 0) >= by

    assert max(m.get("cosmos3_live_requests", 0) for m in during) >= 2
    assert max(m.get("cosmos3_kv_pages_used", 0) for m in during) > 0
    assert max(m.get("cosmos3_request_steps_per_second", 0) for m in during) > 0
    assert max(m.get("cosmos3_rows_last_tick", 0) for m in during) > 0
    assert grew("cosmos3_engine_ticks_total") and grew("cosmos3_request_steps_total", 90)
    assert grew("cosmos3_queue_seconds_count", 4) and grew("cosmos3_e2e_seconds_count", 3)
    assert grew("cosmos3_ttfc_seconds_count", 3)
    assert grew("cosmos3_requests_total:completed", 3) and grew(
        "cosmos3_requests_total:failed", 1
    )  # seed 666: injected
    assert (
        after["cosmos3_kv_pages_used"] == 0
        and after["cosmos3_live_requests"] == 0
        and after["cosmos3_queue_depth"] == 0
    )
