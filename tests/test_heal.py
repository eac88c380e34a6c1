"""Failures inside a tick heal, and capture and bucket rules that hold on every thread and config (CPU, the real
engine and step).

- A packed forward that raises (`fail_forward`, as an OOM or a kernel error would) ends that tick's requests with
  one error each; the step drops its layouts, and the next request is served, equal to its run without the fault.
- A layout captures only on a thread that ran it eagerly (graphs.py: the served warmup and engine threads differ).
- `graph_buckets` left out is derived from `warmup_requests`; a given list that pads a warmup pack by over 10 % is
  warned about with the figure.
"""

from __future__ import annotations

import threading

import pytest
import torch

from cosmos3_core import faults
from cosmos3_core.deployment import Deployment
from cosmos3_core.engine import DenoiseEngine
from cosmos3_core.generate import Generator, _CollectSink
from cosmos3_core.graphs import StepLayout
from cosmos3_core.step import DenoiseStep, derive_buckets
from tests.test_buckets import BucketedSdpa

REQUESTS = [
    ("a red fox", {"num_frames": 9, "height": 64, "width": 96, "steps": 3, "seed": 1}),
    ("a blue boat", {"num_frames": 5, "height": 64, "width": 64, "steps": 3, "seed": 2}),
]
WARM = {"num_frames": 9, "height": 128, "width": 192, "steps": 2}  # 72 tokens a branch: buckets 128, 256


@pytest.fixture(scope="module")
def gen(nano_ckpt) -> Generator:
    return Generator(Deployment(checkpoint=str(nano_ckpt), device="cpu", dtype="float32"))


def submit_all(gen: Generator) -> list[_CollectSink]:
    sinks = []
    for prompt, params in REQUESTS:
        sink = _CollectSink(params["steps"], False)
        gen.engine.submit(gen.prefill.run(gen.prefill.validate(prompt, params, None), None), sink)
        sinks.append(sink)
    return sinks


def test_a_failed_forward_ends_its_tick_and_the_engine_heals(gen, monkeypatch):
    solo = [gen.latents(prompt, params) for prompt, params in REQUESTS]
    monkeypatch.setattr(faults, "FAIL_FORWARD", 2)  # the second packed forward from now: both requests are in it
    monkeypatch.setitem(faults._counts, "forward", 0)
    sinks = submit_all(gen)
    gen.engine.tick()  # the first forward runs
    assert gen.engine.step.layouts
    gen.engine.tick()  # the second raises: its requests end, the step's layouts go
    assert not gen.engine.step.layouts and not gen.engine.has_work()
    for sink in sinks:
        assert sink.latents is None and "denoise step failed (InjectedFault" in (sink.failure or "")
        assert "retry" in sink.failure  # type: ignore[operator]
    assert gen.engine.stats.tick_failures == 1 and gen.engine.stats.failed == 2
    assert gen.engine.pool.pages_free == gen.engine.pool.num_pages  # nothing held by the ended requests
    after = gen.run_together([gen.prefill.run(gen.prefill.validate(p, q, None), None) for p, q in REQUESTS])
    for ours, alone in zip(after, solo):
        assert torch.equal(ours.latents, alone)


def test_failing_every_tick_gives_up(gen, monkeypatch):
    """A forward that fails every time: the engine heals MAX_FAILED_TICKS - 1 times, then says it is broken (the
    host restarts it) rather than stay up failing every request."""
    from cosmos3_core.engine import MAX_FAILED_TICKS, EngineBroken

    def always(*_):
        raise faults.InjectedFault("injected: every forward fails")

    monkeypatch.setattr(gen.engine, "step", gen.engine.step)
    monkeypatch.setattr(type(gen.engine.step), "__call__", always)
    for i in range(MAX_FAILED_TICKS):
        submit_all(gen)
        if i < MAX_FAILED_TICKS - 1:
            gen.engine.tick()
        else:
            with pytest.raises(EngineBroken, match=f"{MAX_FAILED_TICKS} denoise steps in a row failed"):
                gen.engine.tick()
    gen.engine.abort_all("test over")
    gen.engine.failed_ticks = 0


def test_a_layout_captures_only_on_a_thread_that_ran_it_eagerly(gen):
    """The capture rule itself (no graphs on the CPU: a layout given a pool marker is capturable)."""
    step = gen.engine.step
    prompt, params = REQUESTS[0]
    gen.latents(prompt, params)
    layout: StepLayout = next(reversed(step.layouts.values()))
    layout.capturable = True
    assert layout.captures_next()  # this thread ran it eagerly
    seen = {}
    t = threading.Thread(target=lambda: seen.setdefault("other", layout.captures_next()))
    t.start()
    t.join()
    assert seen["other"] is False  # another thread's first use is eager, never a capture
    layout.capturable = False


def warm_engine(nano_ckpt, buckets):
    d = Deployment(checkpoint=str(nano_ckpt), device="cpu", dtype="float32", graph_buckets=buckets)
    gen = Generator(d)  # its warmup has no requests yet: the buckets come from the one below
    eng = gen.engine
    eng.step = DenoiseStep(eng.model, eng.pool, attention=BucketedSdpa(eng.pool), graph_buckets=tuple(buckets or ()))
    eng.derive_buckets = buckets is None
    return gen, [gen.prefill.validate("warmup", {**WARM, "guidance_scale": 4.0}, None)]


@pytest.mark.parametrize(
    ("given", "cuda_graphs", "max_captures", "derive", "buckets"),
    [(None, True, 16, True, ()), ([], True, 16, False, ()), ([128], True, 16, False, (128,)),
     (None, False, 16, False, ()), (None, True, 0, False, ())],
)  # fmt: skip
def test_the_deployment_says_whether_buckets_are_derived(nano_ckpt, given, cuda_graphs, max_captures, derive, buckets):
    """Not given: derived at warmup; `[]`: none; without graphs or captures: none (padding would only cost)."""
    d = Deployment(checkpoint=str(nano_ckpt), device="cpu", dtype="float32", graph_buckets=given,
                   cuda_graphs=cuda_graphs, max_captures=max_captures)  # fmt: skip
    eng = DenoiseEngine.from_deployment(d.open_checkpoint(), d)
    assert eng.derive_buckets is derive and eng.step.buckets == buckets


def test_buckets_are_derived_from_warmup_requests(nano_ckpt, capfd):
    gen, warmup = warm_engine(nano_ckpt, None)
    gen.engine.warmup(warmup)
    step = gen.engine.step
    cfg = gen.engine.cfg
    h, w = cfg.token_grid(128, 192)
    per_branch = ((9 - 1) // cfg.vae_scale_temporal + 1) * h * w  # the row builder's tokens of one branch
    assert step.buckets == derive_buckets({(per_branch, 0, 0, 2)})
    assert len(step.buckets) == 2  # one and both CFG branches running
    assert "graph_buckets derived from warmup_requests" in capfd.readouterr().err
    gen.latents("a red fox", {**WARM, "steps": 3, "seed": 1})
    assert any(key[0][0] == "bucket" for key in step.layouts)  # served in a derived bucket
    step.layouts.clear()
    small = {"num_frames": 1, "height": 32, "width": 32, "steps": 2, "seed": 2, "guidance_scale": 1.0}
    gen.latents("a small one", small)  # one 64-row segment: the 128 bucket would pad it 100 %
    assert all(key[0][0] != "bucket" for key in step.layouts)  # an exact layout instead


def test_buckets_that_pad_a_warmup_request_are_warned_about(nano_ckpt, capfd):
    gen, warmup = warm_engine(nano_ckpt, [4096])
    gen.engine.warmup(warmup)
    err = capfd.readouterr().err
    assert "warning: graph_buckets pads a warmup request's" in err and "padding" in err
    assert "% padding" in err
