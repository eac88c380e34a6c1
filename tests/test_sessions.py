"""AR sessions (cosmos3_core/sessions.py): a kept stream and its continuation equal one long stream bit for bit
(chained and kv, fp32 on the CPU); a re-prompt changes the new windows only; the bounds (expiry, eviction,
max_sessions, a double continuation, a drain) refuse by name and give every page back."""

from __future__ import annotations

import pytest
import torch

from cosmos3_core.engine import DenoiseEngine
from cosmos3_core.kv_pool import KVPool
from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.requests import Defaults, GenerationParams, Limits, RequestError
from cosmos3_core.rows import RowOutput
from cosmos3_core.scheduler import Scheduler
from cosmos3_core.sessions import SessionTable
from cosmos3_core.stages import PrefillStage
from cosmos3_core.windows import continue_windows, plan_windows
from cosmos3_core.wire import PrefillResult

H, W, FPS = 64, 96, 16.0


class Sink:
    def __init__(self):
        self.chunks: list[torch.Tensor] = []
        self.infos: list[dict] = []
        self.errors: list[str] = []
        self.final: dict | None = None

    def progress(self, step, steps, window, windows):
        pass

    def chunk(self, latents, info):
        self.chunks.append(latents.clone())
        self.infos.append(info)

    def done(self, latents, info, sound=None, actions=None):
        self.chunk(latents, info)
        self.final = info

    def error(self, message):
        self.errors.append(message)

    def cancelled(self):
        return False


@pytest.fixture(scope="module")
def setup(nano_ckpt):
    ckpt = Checkpoint.open(nano_ckpt)
    prefill = PrefillStage(ckpt, "cpu", torch.float32, Defaults(height=H, width=W, fps=FPS), Limits())
    return ckpt, prefill


def engine_of(ckpt, pages: int = 512) -> DenoiseEngine:
    return DenoiseEngine(ckpt, "cpu", torch.float32, pool_pages=pages, page_size=4, max_queue=4)


def run(engine, prefill, prompt, params, kept=None) -> Sink:
    """One request through prefill and the engine (a continuation's `kept`: its session's record)."""
    info = None if kept is None else engine.scheduler.sessions.idle[kept].info
    p = prefill.validate(prompt, params, None, kept=None if info is None else info.params)
    sink = Sink()
    engine.submit(prefill.run(p, None, reuse="" if info is None else info.params.text_digest), sink)
    engine.run_until_idle()
    assert not sink.errors, sink.errors
    return sink


CASES = {  # (the whole stream, the kept part, the continuation's new frames): the kept part is whole windows
    "chained": ({"window_mode": "chained", "window_frames": 17, "overlap_frames": 8}, 41, 17, 24),  # 5 | 3 3
    "kv": ({"window_mode": "kv", "window_frames": 9, "context_frames": 17}, 41, 21, 20),  # 3 3 | 3 2, horizon 5
}
COMMON = {"steps": 3, "seed": 11, "guidance_scale": 4.0}


@pytest.mark.parametrize("mode", list(CASES))
def test_kept_stream_and_continuation_equal_one_long_stream(setup, mode):
    ckpt, prefill = setup
    windows, total, kept_frames, new_frames = CASES[mode]
    prompt = "a train crosses a bridge"
    engine = engine_of(ckpt)
    whole = run(engine, prefill, prompt, {**COMMON, **windows, "num_frames": total})
    first = run(engine, prefill, prompt, {**COMMON, **windows, "num_frames": kept_frames, "session": {"keep": True}})
    ident = first.final["session_id"]
    assert engine.scheduler.num_sessions == 1 and engine.pool.pages_used > 0  # its pages stay held
    # the continuation repeats nothing of the kept request but the prompt (sending a size it keeps is allowed)
    then = run(engine, prefill, prompt, {"num_frames": new_frames, "height": H, "session": {"continue": ident}}, ident)
    assert "session_id" not in then.final and engine.scheduler.num_sessions == 0
    joined = torch.cat(first.chunks + then.chunks, dim=2)
    assert torch.equal(joined, torch.cat(whole.chunks, dim=2))  # bit for bit
    assert [i["window"] for i in then.infos] == [i["window"] for i in whole.infos][-len(then.infos) :]
    assert [i["latent_offset"] for i in then.infos] == [i["latent_offset"] for i in whole.infos][-len(then.infos) :]
    assert engine.pool.pages_used == 0 and engine.scheduler.reserved == 0


@pytest.mark.parametrize("mode", list(CASES))
def test_a_reprompt_changes_the_new_windows_only_and_reuses_no_old_prompt(setup, mode):
    ckpt, prefill = setup
    windows, _, kept_frames, new_frames = CASES[mode]
    outs = {}
    for second in ("a train crosses a bridge", "the train enters a tunnel"):
        engine = engine_of(ckpt)
        first = run(
            engine, prefill, "a train crosses a bridge",
            {**COMMON, **windows, "num_frames": kept_frames, "session": {"keep": True}},
        )  # fmt: skip
        ident = first.final["session_id"]
        info = engine.scheduler.sessions.idle[ident].info
        p = prefill.validate(second, {"num_frames": new_frames, "session": {"continue": ident}}, None, kept=info.params)
        pre = prefill.run(p, None, reuse=info.params.text_digest)
        assert (pre.text_k == []) == (second == "a train crosses a bridge")  # the same prompt: no prefill at all
        sink = Sink()
        engine.submit(pre, sink)
        engine.run_until_idle()
        assert not sink.errors
        outs[second] = (first.chunks, sink.chunks)
        assert engine.pool.pages_used == 0
    (kept_a, new_a), (kept_b, new_b) = outs.values()
    assert all(torch.equal(a, b) for a, b in zip(kept_a, kept_b))
    assert len(new_a) == len(new_b) and all(not torch.equal(a, b) for a, b in zip(new_a, new_b))


def test_a_continuation_keeps_its_session_settings_and_errors_name_the_field(setup):
    ckpt, prefill = setup
    engine = engine_of(ckpt)
    windows = CASES["kv"][0]
    first = run(engine, prefill, "x", {**COMMON, **windows, "num_frames": 9, "session": {"keep": True}})
    kept = engine.scheduler.sessions.idle[first.final["session_id"]].info.params
    cont = {"session": {"continue": first.final["session_id"]}}
    for bad, field in (
        ({"width": 128}, "width"),
        ({"window_mode": "chained"}, "window_mode"),
        ({"window_frames": 13}, "window_frames"),
        ({"seed": 1}, "seed"),
        ({"num_frames": 9}, "num_frames"),  # new frames: whole latent frames
        ({"session": {"continue": "nope"}}, "session"),
    ):
        with pytest.raises(RequestError) as e:
            prefill.validate("x", {**cont, **bad}, None, kept=kept)
        assert e.value.field == field, (bad, e.value)
    with pytest.raises(RequestError, match="session: .* unknown"):
        prefill.validate("x", cont, None, kept=None)
    p = prefill.validate("y", {**cont, "steps": 2, "guidance_scale": 3.0}, None, kept=kept)  # these may change
    assert (p.steps, p.guidance_scale, p.num_frames, p.window_frames) == (2, 3.0, 12, 9)
    with pytest.raises(RequestError, match="guidance_scale"):  # kv: the branches' context is kept
        engine.submit(
            prefill.run(prefill.validate("x", {**cont, "guidance_scale": 1.0}, None, kept=kept), None), Sink()
        )
    with pytest.raises(RequestError, match="session"):
        prefill.validate("x", {"num_frames": 9, "session": {"keep": True}}, None)  # not an AR stream
    assert engine.scheduler.num_sessions == 1  # the refused continuation left it as it was


def test_continue_windows_are_the_long_plans_next_windows():
    for mode, window, overlap, context in (("chained", 5, 2, 0), ("kv", 3, 0, 5)):
        whole = plan_windows(mode, 14, window, overlap, context).windows
        for k in range(1, len(whole)):
            start = whole[k].latent_start
            rest = continue_windows(mode, start, k, 14 - start, window, overlap, context).windows
            if all(w.length == window for w in whole[:k]):
                assert rest == whole[k:]


# ---- the bounds, on the scheduler alone (hand-made outputs, a clock the test moves) ----
from tests.test_scheduler import CFG, SAMPLER  # noqa: E402


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def params(**kw) -> GenerationParams:
    base = dict(prompt="x", negative_prompt="", height=32, width=32, num_frames=21, fps=24.0, steps=2,
                guidance_scale=2.0, shift=3.0, seed=0, use_system_prompt=None, add_templates=True, has_image=False,
                window_mode="kv", window_frames=9, context_frames=0, text_digest="d")  # fmt: skip
    return GenerationParams(**{**base, **kw})


def prefilled(p: GenerationParams, reuse: bool = False) -> PrefillResult:
    kv = [] if reuse else [torch.zeros(1, 8, 1, 8) for _ in range(p.cfg_branches)]
    return PrefillResult(p, kv, kv, None)


def output(job) -> RowOutput:
    if job.committing:
        n = job.branches[0].cos.shape[0]
        return RowOutput([], [(torch.zeros(1, n, 1, 8), torch.zeros(1, n, 1, 8))] * len(job.branches))
    return RowOutput([torch.zeros_like(job.latents)] * len(job.branches), [])


def drive(s: Scheduler) -> None:
    for _ in range(200):
        jobs = s.schedule()
        if not jobs and not s.waiting:
            return
        s.update(jobs, [output(j) for j in jobs])
    raise AssertionError("not idle")


def sched(pages: int = 64, max_sessions: int = 4, clock=None) -> Scheduler:
    pool = KVPool(pages, 4, 1, 1, 8, torch.float32, "cpu")
    table = SessionTable(ttl_s=10.0, max_sessions=max_sessions, clock=clock or Clock())
    return Scheduler(CFG, pool, SAMPLER, False, 8, sessions=table)


def keep(s: Scheduler, **kw) -> str:
    sink = Sink()
    s.submit(prefilled(params(session_keep=True, **kw)), sink)
    drive(s)
    assert not sink.errors and sink.final is not None
    return sink.final["session_id"]


def cont(s: Scheduler, ident: str, **kw) -> Sink:
    sink = Sink()
    s.submit(prefilled(params(session_continue=ident, num_frames=12, **kw), reuse=True), sink)
    return sink


def test_expiry_refuses_by_name_and_frees_every_page():
    clock = Clock()
    s = sched(clock=clock)
    ident = keep(s)
    assert s.pool.pages_used > 0 and s.num_sessions == 1
    clock.t = 9.9
    drive(s)
    assert s.num_sessions == 1
    clock.t = 10.0
    s.schedule()  # the engine's idle tick
    assert s.num_sessions == 0 and s.pool.pages_used == 0 and s.reserved == 0
    with pytest.raises(RequestError, match=f"session: {ident} has ended \\(expired"):
        cont(s, ident)


def test_a_request_that_needs_pages_evicts_the_least_recently_kept():
    s = sched(pages=24)
    first, second = keep(s), keep(s)
    held = s.pool.pages_used
    assert held > 12  # two sessions' text and context pages: a third request needs one of them gone
    sink = Sink()
    s.submit(prefilled(params(num_frames=9)), sink)
    drive(s)
    assert sink.final is not None and s.sessions.evictions == 1 and s.num_sessions == 1
    with pytest.raises(RequestError, match=f"session: {first} has ended \\(evicted"):
        cont(s, first)
    done = cont(s, second)
    drive(s)
    assert done.final is not None and s.pool.pages_used == 0


def test_max_sessions_evicts_the_least_recently_kept():
    s = sched(max_sessions=2)
    a, b, c = keep(s), keep(s), keep(s)
    assert list(s.sessions.idle) == [b, c] and s.sessions.evictions == 1
    with pytest.raises(RequestError, match="evicted"):
        cont(s, a)
    with pytest.raises(RequestError, match="session: keep: this deployment keeps no sessions"):
        sched(max_sessions=0).submit(prefilled(params(session_keep=True)), Sink())


def test_a_double_continuation_is_refused_and_a_kept_again_session_goes_on():
    s = sched()
    ident = keep(s)
    first = Sink()
    s.submit(prefilled(params(session_continue=ident, session_keep=True, num_frames=12), reuse=True), first)
    with pytest.raises(RequestError, match=f"session: {ident} is already being continued"):
        cont(s, ident)
    drive(s)
    assert first.final["session_id"] == ident and first.final["window"] == 2  # windows 0, 1 kept; 2 new
    last = cont(s, ident)
    drive(s)
    assert last.final["window"] == 3 and s.pool.pages_used == 0 and s.num_sessions == 0
    with pytest.raises(RequestError, match="has ended"):
        cont(s, ident)


def test_a_drain_ends_the_sessions_and_keeps_none():
    s = sched()
    ident = keep(s)
    live = Sink()
    s.submit(prefilled(params(session_keep=True)), live)
    s.draining = True
    drive(s)  # the live one finishes, and is not kept
    assert live.final is not None and "session_id" not in live.final
    assert s.num_sessions == 0 and s.pool.pages_used == 0 and "draining" in s.sessions.ended[ident]


def test_a_failed_continuation_ends_its_session_and_frees_its_pages():
    s = sched()
    ident = keep(s)
    sink = cont(s, ident)
    s.abort_all("stopping")
    assert sink.errors == ["stopping"] and s.num_sessions == 0 and s.pool.pages_used == 0
    with pytest.raises(RequestError, match="failed"):
        cont(s, ident)


def test_a_continuations_pieces_decode_on_from_the_kept_streams_decoder(setup):
    """vae_decode keeps a kept stream's decoder for its session: the continuation's frames join the kept stream's as
    one stream's would, exactly."""
    from cosmos3_core.stages import DecodeStage

    ckpt, _ = setup
    decode = DecodeStage(ckpt, "cpu", torch.float32)
    latents = torch.randn(
        1, ckpt.config.latent_channel, 6, H // 16, W // 16, generator=torch.Generator().manual_seed(0)
    )
    one = [decode.start_chunk("a", latents[:, :, x:y], last=y == 6)().numpy() for x, y in ((0, 2), (2, 4), (4, 6))]
    kept = [decode.start_chunk("b", latents[:, :, :2], last=False)(), decode.start_chunk("b", latents[:, :, 2:4],
            last=True, keep="s" * 32)()]  # fmt: skip
    then = decode.start_chunk("c", latents[:, :, 4:], last=True, resume="s" * 32)()
    assert all((x == y.numpy()).all() for x, y in zip(one, [*kept, then]))
    assert not decode.sessions and not decode.streams
    with pytest.raises(RuntimeError, match="decoder state is gone"):
        decode.start_chunk("d", latents[:, :, 4:], last=True, resume="s" * 32)


def test_the_records_prefill_reads_name_why_a_session_cannot_be_continued():
    from cosmos3_core.sessions import kept_params

    records: dict[str, str | None] = {}
    s = sched()
    s.sessions.on_record = records.__setitem__
    ident = keep(s)
    assert kept_params(ident, records[ident]).params.window_mode == "kv"  # idle: its parameters
    sink = cont(s, ident)
    with pytest.raises(RequestError, match="already being continued"):
        kept_params(ident, records[ident])
    drive(s)
    assert sink.final is not None
    with pytest.raises(RequestError, match="has ended"):
        kept_params(ident, records[ident])
    with pytest.raises(RequestError, match="is unknown"):
        kept_params("0" * 32, None)
