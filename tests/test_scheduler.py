"""The scheduler without a model or checkpoint: admission by pages, the queue bound, page accounting, AR windows
(chunks, commits, the context horizon's release), cancel, drain. Outputs are made by hand."""

from __future__ import annotations

import pytest
import torch

from cosmos3_core.kv_pool import KVPool
from cosmos3_core.model.config import ModelConfig
from cosmos3_core.requests import GenerationParams, RequestError
from cosmos3_core.rows import RowOutput
from cosmos3_core.scheduler import QueueFull, Scheduler
from cosmos3_core.wire import PrefillResult

CFG = ModelConfig(
    hidden_size=8, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=8,
    intermediate_size=8, vocab_size=8, hidden_act="silu", qk_norm_for_text=True, use_und_k_norm_for_gen=False,
    attention_bias=False, rms_norm_eps=1e-6, rope_theta=1e4, rope_axes_dim=(2, 1, 1), latent_channel=2,
    latent_patch_size=2, patch_latent_dim=8, timestep_scale=1e-3, base_fps=24, enable_fps_modulation=True,
    temporal_modality_margin=15000, reset_spatial_ids=True, vae_scale_spatial=16, vae_scale_temporal=4,
)  # fmt: skip
SAMPLER = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0, "solver_order": 2}
PAGE = 4


class Recorder:
    def __init__(self, cancel_at: int | None = None):
        self.steps: list[tuple[int, int]] = []  # (window, step)
        self.chunks: list[dict] = []
        self.final: dict | None = None  # the done event's info
        self.errors: list[str] = []
        self.cancel_at = cancel_at

    def progress(self, step, steps, window, windows):
        self.steps.append((window, step))

    def chunk(self, latents, info):
        self.chunks.append(info)

    def done(self, latents, info):
        self.final = info

    def error(self, message):
        self.errors.append(message)

    def cancelled(self):
        return self.cancel_at is not None and len(self.steps) >= self.cancel_at


def request(text_tokens: int = 8, steps: int = 2, guidance: float = 2.0, **windows) -> PrefillResult:
    p = GenerationParams(
        prompt="x", negative_prompt="", height=32, width=32, num_frames=windows.pop("num_frames", 5), fps=24.0,
        steps=steps, guidance_scale=guidance, shift=3.0, seed=0, use_system_prompt=None, add_templates=True,
        has_image=False, **windows,
    )  # fmt: skip
    kv = [torch.zeros(1, text_tokens, 1, 8) for _ in range(p.cfg_branches)]
    return PrefillResult(p, kv, kv, None)


def scheduler(pages: int = 64, max_queue: int = 4) -> Scheduler:
    pool = KVPool(pages, PAGE, 1, 1, 8, torch.float32, "cpu")
    return Scheduler(CFG, pool, SAMPLER, False, max_queue)


def output(job) -> RowOutput:
    """What the step would return: a zero velocity per branch, or a commit pass's K/V (one token per patch)."""
    if job.committing:
        n = job.branches[0].cos.shape[0]
        return RowOutput([], [(torch.zeros(1, n, 1, 8), torch.zeros(1, n, 1, 8))] * len(job.branches))
    return RowOutput([torch.zeros_like(job.latents)] * len(job.branches), [])


def run(s: Scheduler, max_ticks: int = 100) -> None:
    for _ in range(max_ticks):
        if not s.has_work():
            return
        jobs = s.schedule()
        s.update(jobs, [output(j) for j in jobs])
    raise AssertionError("not idle")


def test_admission_is_fifo_by_pages_and_the_queue_is_bounded():
    s = scheduler(pages=4, max_queue=2)  # one request's text: 2 branches × 2 pages
    sinks = [Recorder() for _ in range(3)]
    for sink in sinks[:2]:
        s.submit(request(), sink)
    with pytest.raises(QueueFull, match="queue full"):
        s.submit(request(), sinks[2])
    assert len(s.schedule()) == 1 and len(s.waiting) == 1 and s.pool.pages_free == 0
    run(s)
    assert all(r.final is not None and r.steps == [(0, 1), (0, 2)] for r in sinks[:2])
    assert s.pool.pages_used == 0 and s.stats.completed == 2


def test_a_request_larger_than_the_pool_is_refused_up_front():
    s = scheduler(pages=3)
    with pytest.raises(RequestError, match="prompt: request needs 4 K/V pages"):
        s.submit(request(), Recorder())
    assert not s.waiting


def test_cancel_in_the_queue_and_while_live_frees_pages():
    s = scheduler()
    keep, live_cancel = Recorder(), Recorder(cancel_at=2)
    queued = Recorder(cancel_at=0)
    s.submit(request(steps=5), keep)
    s.submit(request(steps=5), live_cancel)
    s.submit(request(steps=5), queued)
    run(s)
    assert queued.errors == ["cancelled"] and queued.steps == []
    assert live_cancel.errors == ["cancelled"] and len(live_cancel.steps) == 2 and live_cancel.final is None
    assert keep.final is not None and s.pool.pages_used == 0 and s.stats.cancelled == 2


def test_drain_refuses_new_requests_and_abort_ends_the_rest():
    s = scheduler()
    live, waiting = Recorder(), Recorder()
    s.submit(request(steps=9), live)
    s.schedule()
    s.submit(request(steps=9), waiting)
    s.draining = True
    with pytest.raises(QueueFull, match="shutting down"):
        s.submit(request(), Recorder())
    s.abort_all("server stopped")
    assert live.errors == waiting.errors == ["server stopped"]
    assert s.pool.pages_used == 0 and not s.has_work()


def test_chained_windows_pin_the_tail_and_stream_each_window():
    s = scheduler()
    sink = Recorder()
    # 9 latent frames in windows of 4 with 2 pinned: new frames [0,4), [4,6), [6,8), then [8,9)
    s.submit(request(num_frames=33, window_mode="chained", window_frames=13, overlap_frames=8), sink)
    run(s)
    assert [c["latent_offset"] for c in sink.chunks] == [0, 4, 6] and sink.final["latent_offset"] == 8
    assert sink.final["latent_frames"] == 1 and sink.final["windows"] == 4
    assert [w for w, step in sink.steps if step == 2] == [0, 1, 2, 3]
    assert s.pool.pages_used == 0 and s.reserved == 0


def test_kv_windows_commit_reserve_and_release_past_the_horizon():
    s = scheduler(pages=64)
    sink = Recorder()
    # 6 latent frames in kv windows of 2, context 2 latent frames: 2×2 patches a frame = 1 page a frame and branch
    pre = request(num_frames=21, window_mode="kv", window_frames=5, context_frames=5)
    s.submit(pre, sink)
    job = s.schedule()[0]
    text_pages = 2 * 2
    assert job.reserve == 2 * 2 and s.reserved == 4 and s.pool.pages_used == text_pages
    held = []
    while s.has_work():
        jobs = s.schedule()
        committing = jobs[0].committing
        s.update(jobs, [output(j) for j in jobs])
        if committing:
            held.append((s.pool.pages_used, s.reserved, len(job.context[0])))
    # each commit keeps at most the horizon (2 frames a branch); used + reserved never exceeds text + reserve
    assert held == [(4 + 4, 0, 2), (4 + 4, 0, 2)]
    assert [c["latent_offset"] for c in sink.chunks] == [0, 2] and sink.final["latent_offset"] == 4
    assert s.pool.pages_used == 0 and s.reserved == 0


def test_a_failing_update_ends_that_request_only():
    s = scheduler()
    good, bad = Recorder(), Recorder()
    s.submit(request(), good)
    s.submit(request(), bad)
    jobs = s.schedule()
    outputs = [RowOutput([torch.zeros_like(jobs[0].latents)] * 2, []), RowOutput([], [])]  # bad: no velocity
    s.update(jobs, outputs)
    assert bad.errors and "internal error in denoise step" in bad.errors[0]
    run(s)
    assert good.final is not None and s.pool.pages_used == 0 and s.stats.failed == 1


def test_guidance_one_runs_one_branch():
    s = scheduler(pages=2)  # 2 pages: a cond-only request fits, a two-branch one would not
    sink = Recorder()
    s.submit(request(guidance=1.0), sink)
    run(s)
    assert sink.final is not None
