"""The denoise engine without Triton: admission by pages, the bounded queue, cancellation, packing."""

from __future__ import annotations

import pytest
import torch

from cosmos3_core.engine import DenoiseEngine, QueueFull
from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.requests import Defaults, Limits, RequestError
from cosmos3_core.stages import PrefillStage


class Recorder:
    def __init__(self, cancel_at: int | None = None):
        self.steps: list[int] = []
        self.latents = None
        self.errors: list[str] = []
        self.cancel_at = cancel_at

    def progress(self, step, steps, window, windows):
        self.steps.append(step)

    def chunk(self, latents, info):
        raise AssertionError("single-shot requests send no chunks")

    def done(self, latents, info):
        self.latents = latents

    def error(self, message):
        self.errors.append(message)

    def cancelled(self):
        return self.cancel_at is not None and len(self.steps) >= self.cancel_at


@pytest.fixture(scope="module")
def parts(nano_ckpt):
    ckpt = Checkpoint.open(nano_ckpt)
    prefill = PrefillStage(ckpt, "cpu", torch.float32, Defaults(height=32, width=32, num_frames=5), Limits())
    return ckpt, prefill


def prefilled(prefill, seed: int, steps: int = 3):
    p = prefill.validate("a prompt", {"seed": seed, "steps": steps}, None)
    return prefill.run(p, None)


def test_admission_waits_for_pages_then_rejects_past_queue_bound(parts):
    ckpt, prefill = parts
    one = prefilled(prefill, 0)
    pages_per_request = sum(-(-k.shape[1] // 16) for k in one.text_k)
    engine = DenoiseEngine(ckpt, "cpu", torch.float32, pool_pages=pages_per_request, page_size=16, max_queue=2)
    sinks = [Recorder() for _ in range(3)]
    for s in sinks[:2]:
        engine.submit(prefilled(prefill, 1), s)
    with pytest.raises(QueueFull, match="queue full"):
        engine.submit(prefilled(prefill, 2), sinks[2])
    engine.tick()  # admits only the first: the pool holds one request's pages
    assert engine.num_live == 1 and engine.num_waiting == 1 and engine.pool.pages_free == 0
    engine.run_until_idle()
    assert all(s.latents is not None and s.steps == [1, 2, 3] for s in sinks[:2])
    assert engine.pool.pages_used == 0


def test_request_larger_than_pool_is_rejected_up_front(parts):
    ckpt, prefill = parts
    engine = DenoiseEngine(ckpt, "cpu", torch.float32, pool_pages=2, page_size=4, max_queue=2)
    with pytest.raises(RequestError, match="prompt: request needs"):
        engine.submit(prefilled(prefill, 0), Recorder())
    assert engine.num_waiting == 0


def test_cancel_leaves_within_one_step_and_frees_pages(parts):
    ckpt, prefill = parts
    engine = DenoiseEngine(ckpt, "cpu", torch.float32, pool_pages=64, page_size=16, max_queue=4)
    keep, cancel = Recorder(), Recorder(cancel_at=2)
    engine.submit(prefilled(prefill, 0, steps=6), keep)
    engine.submit(prefilled(prefill, 1, steps=6), cancel)
    engine.run_until_idle()
    assert cancel.steps == [1, 2] and cancel.errors == ["cancelled"] and cancel.latents is None
    assert keep.latents is not None and engine.pool.pages_used == 0
    assert engine.stats.max_requests_in_tick == 2


def test_final_latents_stream_in_pieces(parts):
    ckpt, prefill = parts
    whole, pieces = [], []

    class Pieces(Recorder):
        def __init__(self, out):
            super().__init__()
            self.out = out

        def chunk(self, latents, info):
            self.out.append((latents, info))

        def done(self, latents, info):
            self.out.append((latents, info))

    for decode_chunk, out in ((0, whole), (2, pieces)):
        engine = DenoiseEngine(ckpt, "cpu", torch.float32, 64, 16, 4, decode_chunk=decode_chunk)
        p = prefill.validate("x", {"num_frames": 21, "steps": 2, "seed": 3}, None)  # 6 latent frames
        engine.submit(prefill.run(p, None), Pieces(out))
        engine.run_until_idle()
    assert len(whole) == 1 and len(pieces) == 3
    assert [i["latent_offset"] for _, i in pieces] == [0, 2, 4] and all(i["latent_frames"] == 2 for _, i in pieces)
    assert torch.equal(torch.cat([lat for lat, _ in pieces], dim=2), whole[0][0])


def test_sync_free_scheduler_steps_like_diffusers_unipc(nano_ckpt):
    """Our UniPC (its corrector solve without the host check) steps exactly like diffusers', and leaves
    `torch.linalg.solve` as it found it."""
    from diffusers import UniPCMultistepScheduler

    from cosmos3_core.sampling import make_scheduler

    config = Checkpoint.open(nano_ckpt).scheduler_config
    ours = make_scheduler(config, 6, 5.0, False, "cpu")
    theirs = UniPCMultistepScheduler.from_config(config, flow_shift=5.0)
    theirs.set_timesteps(6, device="cpu")
    solve = torch.linalg.solve
    g = torch.Generator().manual_seed(0)
    x = y = torch.randn(1, 4, 3, 8, 8, generator=g)
    for t in theirs.timesteps:
        v = torch.randn(x.shape, generator=g)
        x = ours.step(v, t, x, return_dict=False)[0]
        y = theirs.step(v, t, y, return_dict=False)[0]
        assert torch.equal(x, y)
    assert torch.linalg.solve is solve
    from cosmos3_core.sampling import _SolveWithoutHostCheck

    singular = torch.zeros(2, 2)
    with pytest.raises(torch.linalg.LinAlgError):  # outside the mode: the checked solve
        torch.linalg.solve(singular, torch.ones(2))
    with _SolveWithoutHostCheck():  # inside it, on this thread: solve_ex, whose error flag nobody reads
        torch.linalg.solve(singular, torch.ones(2))
