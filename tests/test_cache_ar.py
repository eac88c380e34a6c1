"""Step caching (SeaCache, cosmos3_core/cache.py) on AR windows (chained and kv), through the real engine on the tiny
Nano checkpoint (fp32, CPU).

Each window is its own denoise loop with its own decisions: threshold 0 streams equal the uncached ones bit for bit;
window 0 equals the same request without windows (num_frames = window_frames) with the same cache, in its latents and
skipped steps; no window reuses at its step 0 (no indicator crosses windows) while every window skips; a cached stream
packed with other requests (a commit pass, an uncached request of another size) equals its solo run. `done` reports
`cache_skipped` as a list, one entry per window (docs/caching.md). The deployment default applies to AR streams too.
Served: one cached chained stream equals the offline run, `cache_skipped` included.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cosmos3_core.engine import DenoiseEngine
from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.requests import Defaults, Limits, SeaCacheParams, validate
from cosmos3_core.stages import PrefillStage

SKIPS = {"policy": "sea", "threshold": 1.0, "retention_steps": 0, "max_consecutive_cached": 0}  # skips in each window
STREAMS = {  # 32×32: one token per latent frame
    "chained": {"window_mode": "chained", "num_frames": 33, "window_frames": 17, "overlap_frames": 8},  # 5 + 3 + 1 new
    "kv": {"window_mode": "kv", "num_frames": 17, "window_frames": 9, "context_frames": 0},  # 3 + 2, then a commit
}
WINDOWS = {"chained": 3, "kv": 2}


class Stream:
    """An engine sink that keeps every piece and its info; an error fails the test."""

    def __init__(self):
        self.chunks: list[torch.Tensor] = []
        self.infos: list[dict] = []
        self.finished = False

    def progress(self, *a): ...

    def chunk(self, latents, info):
        self.chunks.append(latents.clone())
        self.infos.append(info)

    def done_info(self) -> dict:
        assert self.finished
        return self.infos[-1]

    def done(self, latents, info):
        self.chunk(latents, info)
        self.finished = True

    def error(self, message):
        raise AssertionError(message)

    def cancelled(self):
        return False


@pytest.fixture(scope="module")
def parts(nano_ckpt):
    ckpt = Checkpoint.open(nano_ckpt)
    prefill = PrefillStage(ckpt, "cpu", torch.float32, Defaults(height=32, width=32, num_frames=5), Limits())
    return ckpt, prefill


def run(parts, requests: list[dict]) -> list[Stream]:
    """The requests submitted together to one engine (they share its ticks) → their sinks."""
    ckpt, prefill = parts
    engine = DenoiseEngine(ckpt, "cpu", torch.float32, pool_pages=512, page_size=16, max_queue=8)
    sinks = [Stream() for _ in requests]
    for params, sink in zip(requests, sinks):
        engine.submit(prefill.run(prefill.validate("a red cube slides", params, None), None), sink)
    engine.run_until_idle()
    assert all(s.finished for s in sinks) and engine.pool.pages_used == 0
    return sinks


def request(mode: str, **extra) -> dict:
    return {**STREAMS[mode], "steps": 8, "seed": 4, "guidance_scale": 5.0, **extra}


@pytest.mark.parametrize("mode", list(STREAMS))
def test_threshold_zero_equals_uncached_bit_for_bit(parts, mode):
    cached, uncached = run(parts, [request(mode, cache={"policy": "sea", "threshold": 0.0}), request(mode)])
    assert len(cached.chunks) == len(uncached.chunks) == WINDOWS[mode]
    assert all(torch.equal(a, b) for a, b in zip(cached.chunks, uncached.chunks))
    assert cached.done_info()["cache_skipped"] == [{"cond": [], "uncond": []}] * WINDOWS[mode]
    assert "cache_skipped" not in uncached.done_info()


@pytest.mark.parametrize("mode", list(STREAMS))
def test_window_zero_equals_the_request_without_windows(parts, mode):
    """Window 0 is the same trajectory as the windowless request of window_frames frames (same templates, noise and
    schedule): the same steps skipped, the same latents. Every window skips, none at its step 0 (retention 0: only a
    fresh window's missing indicator forces it), and the windowless `cache_skipped` keeps its per-branch form."""
    (stream,) = run(parts, [request(mode, cache=SKIPS)])
    windowless = {"num_frames": STREAMS[mode]["window_frames"], "steps": 8, "seed": 4, "guidance_scale": 5.0}
    (single,) = run(parts, [{**windowless, "cache": SKIPS}])
    per_window = stream.done_info()["cache_skipped"]
    alone = single.done_info()["cache_skipped"]
    assert isinstance(per_window, list) and len(per_window) == WINDOWS[mode]
    assert set(alone) == {"cond", "uncond"} and alone["cond"]
    assert per_window[0] == alone
    assert torch.equal(stream.chunks[0], single.chunks[0])
    for skipped in per_window:
        assert skipped["cond"] and skipped["uncond"] and min(skipped["cond"] + skipped["uncond"]) >= 1, per_window


@pytest.mark.parametrize("mode", list(STREAMS))
def test_decisions_restart_every_window(parts, mode):
    """With a threshold nothing reaches, no retention and no run limit, a step runs in full only when forced: each
    window's step 0 (a fresh window has no indicator nor residual; carried over from the last window, it would
    reuse) and its last step. Every window reports its own steps, counted from its start."""
    cache = {**SKIPS, "threshold": 1e9}
    (stream,) = run(parts, [request(mode, cache=cache)])
    every = {"cond": list(range(1, 7)), "uncond": list(range(1, 7))}  # 8 steps: 0 and 7 in full
    assert stream.done_info()["cache_skipped"] == [every] * WINDOWS[mode]


def test_packed_mix_equals_each_solo(parts):
    """Two cached streams (chained; kv, whose commit passes share ticks) with an uncached single-shot request of
    another size and a cached one: each equals its solo run, chunk for chunk, with the same skipped steps."""
    mix = [
        request("chained", cache=SKIPS),
        request("kv", cache={"policy": "sea", "threshold": 0.6}, seed=9),
        {"num_frames": 9, "height": 48, "steps": 6, "seed": 2},
        {"num_frames": 5, "steps": 7, "seed": 3, "guidance_scale": 1.0, "cache": SKIPS},
    ]
    packed = run(parts, mix)
    assert any(w["cond"] for w in packed[1].done_info()["cache_skipped"][1:]), "the kv stream must skip after window 0"
    for params, got in zip(mix, packed):
        (alone,) = run(parts, [params])
        assert len(got.chunks) == len(alone.chunks)
        assert all(torch.equal(a, b) for a, b in zip(got.chunks, alone.chunks)), params
        assert got.done_info().get("cache_skipped") == alone.done_info().get("cache_skipped"), params


def test_windowed_requests_take_the_cache_and_the_deployment_default():
    def check(params: dict, defaults: Defaults | None = None):
        return validate("p", params, None, defaults or Defaults(), Limits(), 16, 4, 3.0)

    for mode in STREAMS:
        assert check({**STREAMS[mode], "cache": SKIPS}).cache == SeaCacheParams(**SKIPS)
        on = Defaults(cache={"policy": "sea", "threshold": 0.5})
        assert check(STREAMS[mode], on).cache == SeaCacheParams(threshold=0.5)
        assert check({**STREAMS[mode], "cache": None}, on).cache is None


@pytest.mark.served
def test_served_cached_stream_equals_offline(server, offline):
    from client.stream import generate

    params = {"window_mode": "chained", "num_frames": 33, "window_frames": 17, "overlap_frames": 8, "steps": 6,
              "seed": 21, "cache": SKIPS}  # fmt: skip
    served = generate(server.url, "a harbour at dawn", params)
    p = offline.prefill.validate("a harbour at dawn", params, None)
    out = offline.run(offline.prefill.run(p, None))
    assert np.array_equal(served.video, offline.decode.run(out.latents))
    done = next(e for e in served.events if e["type"] == "done")
    assert done["cache_skipped"] == out.info["cache_skipped"] and len(done["cache_skipped"]) == done["windows"] == 3
    assert all(w["cond"] for w in done["cache_skipped"])
