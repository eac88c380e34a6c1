"""Scrape the metrics port during and after a run: every engine and latency metric moves as it should, and every
request sent is counted once in `cosmos3_requests_total` (docs/metrics.md)."""

from __future__ import annotations

import functools
import threading
import time
from collections import Counter

import pytest

from bench.pool import run_pool
from client.stream import ServerError, generate
from cosmos3_core.errors import OVER_CAPACITY

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


OUTCOMES = ("completed", "cancelled", "failed", "rejected", "bad_input", "refused")


def outcome_of(run) -> str:
    """How one request ended, as its client saw it."""
    try:
        run()
    except ServerError as e:
        text = str(e)
        if OVER_CAPACITY in text or "queue full" in text:
            return "rejected"
        if "injected fault" in text:
            return "failed"
        if text.startswith(("prompt:", "negative_prompt:")):
            return "bad_input"
        raise
    return "completed"


def test_every_request_counted_once(server):
    """A known mix: a burst of twice the server's queue (the door refuses what does not fit: rejected; the rest
    completed; sent again, up to 3 bursts, until one overruns), one cancelled, a failure in the engine and one in decode, bad input caught by prefill and by the
    engine. Each outcome's counter grows by what the clients saw, and sent = the sum of all of them."""
    before = server.metrics(settle=True)
    small = {"steps": 1, "num_frames": 1, "height": 32, "width": 32}
    long = {"num_frames": 33, "height": 128, "width": 128, "steps": 60, "seed": 9}
    words = "x " + "word " * 80  # each branch within prefill's 600 tokens; both together need 69 K/V pages of 64
    denoise_bad_input = engine_bad_input(server)

    def burst(attempt: int, i: int) -> tuple[int, str]:
        return i, outcome_of(lambda: generate(server.url, f"burst {attempt} {i}", {**small, "seed": i}))

    seen, bursts = Counter(), 0
    for attempt in range(3):  # a burst whose clients start slower than the server serves them (a loaded machine) fits
        seen.update(dict(run_pool(range(16), 16, functools.partial(burst, attempt))).values())
        bursts += 16
        if seen["rejected"]:
            break
    assert seen["rejected"] >= 1 and seen["completed"] >= 1, seen  # a burst overran the queue, and was served
    cancelled = generate(server.url, "a long one", long, cancel_after=lambda e: e.get("step") == 1)
    assert [e["type"] for e in cancelled.events] == ["progress"]
    seen["cancelled"] += 1
    others = [
        lambda: generate(server.url, "fails in its step", {**small, "seed": 666}),
        lambda: generate(server.url, "fails in its decode", {**small, "seed": 667}),
        lambda: generate(server.url, "", small),  # prefill's
        lambda: generate(server.url, words, {**small, "negative_prompt": words}),  # the engine's (K/V pages)
    ]
    seen.update(outcome_of(run) for run in others)
    assert seen["failed"] == 2 and seen["bad_input"] == 2, seen
    sent = bursts + 1 + len(others)

    def ended(m: dict[str, float]) -> Counter:
        return Counter({k: m.get(f"cosmos3_requests_total:{k}", 0) - before.get(f"cosmos3_requests_total:{k}", 0)
                        for k in OUTCOMES})  # fmt: skip

    deadline = time.monotonic() + 15  # the engine's counts are published every 0.2 s; a cancel lands within a step
    while sum((counted := ended(server.metrics())).values()) < sent and time.monotonic() < deadline:
        time.sleep(0.1)
    assert counted == seen, f"counted {dict(counted)}, the clients saw {dict(seen)}"
    assert sum(counted.values()) == sent
    assert engine_bad_input(server) == denoise_bad_input + 1  # the pool's size: only the engine knows it


def engine_bad_input(server) -> float:
    """`cosmos3_requests_total{model="cosmos3_denoise", outcome="bad_input"}` (the fixture's scrape sums models)."""
    import re
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    pattern = r'^cosmos3_requests_total\{(?=[^}]*model="cosmos3_denoise")(?=[^}]*outcome="bad_input")[^}]*\} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))
