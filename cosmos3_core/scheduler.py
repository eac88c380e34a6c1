"""Request scheduling for the denoise engine: admission, page reservation, AR windows, finish. No model.

`submit` (any thread) checks capacity and enqueues. On the engine thread, each tick `schedule()` admits waiting
requests whose pages fit (FIFO; their text K/V written to the pool), ends cancelled ones and returns the live
jobs for the tick's packed forward; the engine builds their rows, runs the step and hands the outputs to
`update`, which applies each job's: a velocity (guidance, then the request's own UniPC step) or, after a kv
window's last step, the commit pass's K/V.

AR streams (`windows.py`) run window after window: after a window's last step its new latent frames go to the
sink as a chunk; a `kv` stream then spends one tick on the commit pass (its K/V joins the pool, per latent
frame, and frames older than the context horizon are released), a `chained` stream pins the window's tail as
the next window's first frames. Pages: text at admission; a kv stream's largest context is reserved at
admission so a stream never stalls for pages mid-way.

Step caching (cache.py): `schedule()` also decides, for each live request with a cache policy, which of its CFG
branches reuse a residual this step (`Job.reuse`) — before the engine builds the rows, since a reusing branch
contributes none — reading every request's gate distance back in one transfer; `update` records the residuals of
the branches that ran. Each AR window is its own denoise loop: it starts a fresh `SeaCache` (no decision, indicator
or residual crosses windows) and a kv commit pass decides nothing. The `done` info then carries `cache_skipped`:
per branch the skipped steps of a request without windows, a list of those (one per window, in order) with windows.

Events go to the request's `Sink`: `progress` after each step, `chunk` per finished piece of a non-final window,
then exactly one of `done` (the last frames; with them the sound latents and the generated actions, when the request
has them) or `error`.

Sessions (sessions.py, docs/requests.md#sessions): a request that keeps its session ends by moving its pages (text,
kv context) and a chained stream's tail into an idle `Session` instead of freeing them (a kv stream commits its last
window first, then sends `done`); a continuation claims the session at `submit` (an error naming `session` when it
cannot) and at admission takes its pages (and, with the same prompt, its text K/V: no new pages) and runs the plan's
next windows. Idle sessions expire after `ttl_s`, are evicted least recently kept first when the queue's head needs
their pages or `max_sessions` is reached, and end when the server drains.

LoRA (lora_store.py, docs/lora.md): `submit` checks a request's adapter (an error names `lora` / `lora.name`);
admission pins it in a slot of the engine's adapter pool, loading it first if needed, and `_finish` unpins it. When
every slot is pinned by other adapters the head waits (FIFO), so no adapter is evicted under a live request.

Robot actions: a request's action band [chunk, action_dim] starts as noise drawn after the vision (and sound) noise
(policy, inverse dynamics) or as the given actions (forward dynamics: clean, never stepped); its own UniPC twin steps
it with the guided action velocity; channels at or above the domain's raw width are zeroed after every step.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from . import faults
from .cache import SeaCache, SeaGains, host_distances
from .errors import DRAINING
from .kv_pool import KVPool, PageList
from .lora_store import LoraRef, LoraStore
from .model.action import action_position_ids
from .model.config import ModelConfig
from .model.embodiments import DOMAIN_IDS, FORWARD
from .model.layers import GEN
from .model.rotary import rotary_tables, vision_position_ids
from .model.sound import SoundSpec, sound_position_ids
from .requests import GenerationParams, RequestError
from .rows import ActionBand, Branch, RowOutput
from .sampling import guided_velocity, initial_noise_bands, make_scheduler
from .sessions import Session, SessionInfo, SessionTable
from .windows import WindowPlan, continue_windows, latent_frames, plan_windows
from .wire import ChunkInfo, PrefillResult


class Sink(Protocol):
    def progress(self, step: int, steps: int, window: int, windows: int) -> None: ...
    def chunk(self, latents: torch.Tensor, info: ChunkInfo) -> None: ...
    def done(
        self,
        latents: torch.Tensor,
        info: ChunkInfo,
        sound: torch.Tensor | None = None,  # enable_sound: [sound_dim, T_s]
        actions: torch.Tensor | None = None,  # policy / inverse dynamics: [chunk, raw_action_dim] fp32
    ) -> None: ...
    def error(self, message: str) -> None: ...
    def cancelled(self) -> bool: ...


class QueueFull(RuntimeError):
    pass


@dataclass
class Job:
    id: int
    prefill: PrefillResult
    sink: Sink
    plan: WindowPlan
    reserve: int  # pages promised for this stream's AR context
    t_submit: float
    text_pages: list[PageList] = field(default_factory=list)  # per branch
    context: list[list[PageList]] = field(default_factory=list)  # per branch, per committed latent frame
    window: int = 0
    committing: bool = False
    branches: tuple[Branch, ...] = ()
    latents: torch.Tensor | None = None  # the current window [1, C, T, h, w] fp32
    noisy_frames: torch.Tensor | None = None
    scheduler: Any = None
    timesteps: list[float] = field(default_factory=list)  # the scheduler's, on the host: no sync per step
    sound: torch.Tensor | None = None  # enable_sound: [sound_dim, T_s] fp32
    sound_scheduler: Any = None  # the vision scheduler's twin (the pipeline's deepcopy): same timesteps
    cache: SeaCache | None = None  # this window's step-caching state (params.cache); None: every step in full
    cache_skipped: list[dict[str, list[int]]] = field(default_factory=list)  # per finished window, its `skipped`
    reuse: tuple[torch.Tensor | None, ...] = ()  # this tick: per branch the residual to reuse, or None; (): none
    action: ActionBand | None = None  # action requests: the band, latents [chunk, action_dim] fp32
    action_scheduler: Any = None  # another twin, stepped only when the action tokens are noisy
    lora_ref: LoraRef | None = None  # its adapter, checked at submit (None: none, or one on the UND tower only)
    lora_slot: int | None = None  # the adapter pool slot it holds (pinned) from admission to its end
    lora_error: str | None = None  # the adapter failed to load at admission: the request fails with this
    step: int = 0
    t_admit: float = 0.0
    t_last_chunk: float = 0.0
    session_id: str = ""  # the session it keeps or continues ("": none)
    session: Session | None = None  # a continuation's claimed session, until admission takes its pages
    claimed: bool = False  # it continues a session (claimed at submit): the session ends with it unless kept
    kept: bool = False  # it ended keeping its session (done carries session_id)
    vision_base: tuple[int, ...] = ()  # per branch: the text length its vision positions count from
    final: torch.Tensor | None = None  # a kept kv stream's last window's new latents, sent once it is committed

    @property
    def params(self) -> GenerationParams:
        return self.prefill.params

    def pages_held(self) -> int:
        return sum(len(p.pages) for p in self.text_pages) + sum(len(f.pages) for br in self.context for f in br)


@dataclass
class EngineStats:
    """Plain counters, bumped by the engine thread, read by metrics. The outcomes are the engine's own view (the
    offline CLI's); served, `cosmos3_requests_total` counts each request where it ended (triton/outcomes.py)."""

    ticks: int = 0
    request_steps: int = 0
    rows_last_tick: int = 0
    max_requests_in_tick: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    tick_failures: int = 0  # packed forwards that raised (their requests failed; the engine healed)
    queue_times: deque = field(default_factory=lambda: deque(maxlen=10000))


class Scheduler:
    def __init__(
        self,
        cfg: ModelConfig,
        pool: KVPool,
        sampler_config: dict[str, Any],
        native_flow_schedule: bool,
        max_queue: int,
        decode_chunk: int = 0,
        sound: SoundSpec | None = None,
        loras: LoraStore | None = None,
        max_step_rows: int = 0,
        sessions: SessionTable | None = None,
    ):
        """`max_step_rows`: packed rows a step may hold (the memory plan's, memory.py): a request waits (FIFO) until
        the live ones leave it room, and one larger than that alone is refused; 0: no bound. `sessions`: the table of
        kept AR sessions (its TTL and bound; default: 120 s, 16)."""
        self.cfg, self.pool = cfg, pool
        self.max_step_rows = max_step_rows
        self.device, self.dtype = pool.k_pages.device, pool.k_pages.dtype
        self.sampler_config, self.native_flow_schedule = sampler_config, native_flow_schedule
        self.max_queue = max_queue
        self.decode_chunk = decode_chunk  # latent frames per emitted piece; 0: a window's frames at once
        self.sound = sound  # what the checkpoint says about sound; None: it cannot make sound
        self.loras = loras  # the GEN tower's adapters (lora_store.py); None: the deployment serves none
        self.stats = EngineStats()
        self.sea_gains = SeaGains()  # SeaCache's filter gains, shared by every request of the same shape and schedule
        self.waiting: deque[Job] = deque()
        self.live: list[Job] = []
        self.reserved = 0  # context pages promised to live kv streams and not yet allocated
        self.draining = False  # shutting down: no new requests; live ones finish (or are ended by the caller)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._next_id = 0
        self.sessions = sessions if sessions is not None else SessionTable()

    # ---- sizes ----
    def plan(self, p: GenerationParams) -> WindowPlan:
        t = self.cfg.vae_scale_temporal
        return plan_windows(
            p.window_mode,
            latent_frames(p.num_frames, t),
            latent_frames(p.window_frames, t) if p.window_frames else 0,
            p.overlap_frames // t,
            latent_frames(p.context_frames, t) if p.context_frames else 0,
        )

    def _context_reserve(self, p: GenerationParams, plan: WindowPlan, branches: int, held: int = 0) -> int:
        """Pages a kv stream's commits will add to the `held` frames of context it starts with (a continuation's),
        its last window's too when it keeps its session."""
        if not plan.commits:
            return 0
        committed = sum(w.length for w in plan.windows) - (0 if p.session_keep else plan.windows[-1].length)
        frames = min(plan.context, held + committed) if plan.context else held + committed
        h, w = self.cfg.token_grid(*p.frame_size)
        return branches * max(0, frames - held) * self.pool.pages_for(h * w)

    def rows(self, p: GenerationParams, plan: WindowPlan) -> int:
        """The most packed rows a request's step takes (its largest window, every CFG branch, sound and actions)."""
        h, w = self.cfg.token_grid(*p.frame_size)
        extra = p.chunk_size if p.action_mode else 0
        if p.enable_sound and self.sound is not None:
            extra += self.sound.latent_shape(p.num_frames, p.fps)[1]
        return p.cfg_branches * (h * w * max(x.length for x in plan.windows) + extra)

    def _pages_needed(self, job_or_prefill: Job | PrefillResult, reserve: int) -> int:
        prefill = job_or_prefill.prefill if isinstance(job_or_prefill, Job) else job_or_prefill
        return sum(self.pool.pages_for(k.shape[1]) for k in prefill.text_k) + reserve

    # ---- any thread ----
    def submit(self, prefill: PrefillResult, sink: Sink) -> int:
        if self.draining:
            raise QueueFull(DRAINING)
        p = prefill.params
        if p.enable_sound and self.sound is None:
            raise RequestError("enable_sound", "this checkpoint has no sound tokenizer or sound weights")
        if p.action_mode and not self.cfg.action_gen:
            raise RequestError("action", "this checkpoint has no action weights (action_gen)")
        lora = self._check_lora(p)
        if p.session_keep and not self.sessions.max_sessions:
            raise RequestError("session", "keep: this deployment keeps no sessions (its max_sessions is 0)")
        session = None
        if p.session_continue:
            with self._lock:
                session = self.sessions.claim(p.session_continue)
        try:
            return self._enqueue(prefill, sink, lora, session)
        except Exception:
            if session is not None:  # refused: the session stays as it was
                with self._lock:
                    self.sessions.restore(session)
            raise

    def _enqueue(self, prefill: PrefillResult, sink: Sink, lora: LoraRef | None, session: Session | None) -> int:
        p = prefill.params
        if session is None:
            plan, held = self.plan(p), 0
        else:
            self._check_continuation(prefill, session)
            plan, held = self.continuation_plan(p, session), len(session.context[0]) if session.context else 0
        branches = len(prefill.text_k) or len(session.text_pages)  # type: ignore[union-attr]
        reserve = self._context_reserve(p, plan, branches, held)
        need = self._pages_needed(prefill, reserve)
        if need > self.pool.num_pages:
            raise RequestError(
                "prompt", f"request needs {need} K/V pages (text + AR context), the pool has {self.pool.num_pages}"
            )
        rows = self.rows(p, plan)
        if self.max_step_rows and rows > self.max_step_rows:
            raise RequestError("num_frames", f"{p.width}x{p.height}x{p.num_frames} is {rows} rows a step, more than "
                               f"this deployment's max_step_rows ({self.max_step_rows}); fewer frames or pixels")  # fmt: skip
        with self._lock:
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"queue full ({self.max_queue} waiting); retry later")
            self._next_id += 1
            job = Job(self._next_id, prefill, sink, plan, reserve, time.perf_counter(), lora_ref=lora)
            if session is not None:
                job.session, job.claimed, job.session_id = session, True, session.id
            elif p.session_keep:
                job.session_id = uuid.uuid4().hex
            self.waiting.append(job)
            self._wake.notify()
            return self._next_id

    def continuation_plan(self, p: GenerationParams, session: Session) -> WindowPlan:
        """The session's next windows for the continuation's `num_frames` new pixel frames."""
        t = self.cfg.vae_scale_temporal
        return continue_windows(
            p.window_mode,
            session.next_latent,
            session.next_window,
            p.num_frames // t,
            latent_frames(p.window_frames, t),
            p.overlap_frames // t,
            latent_frames(p.context_frames, t) if p.context_frames else 0,
        )

    def _check_continuation(self, prefill: PrefillResult, session: Session) -> None:
        """What prefill checked against the session's record, checked again against the session itself (it may have
        changed since: another continuation kept it with a new prompt). Errors name the field."""
        p, kept = prefill.params, session.params
        for key in ("window_mode", "height", "width", "fps", "seed", "window_frames", "overlap_frames",
                    "context_frames"):  # fmt: skip
            if getattr(p, key) != getattr(kept, key):
                raise RequestError(key, f"a continuation keeps its session's {key} ({getattr(kept, key)!r}); got "
                                   f"{getattr(p, key)!r}")  # fmt: skip
        if not prefill.text_k and p.text_digest != kept.text_digest:
            raise RequestError("session", f"{session.id} changed since this request's prefill; send it again")
        if p.window_mode == "kv" and p.cfg_branches != len(session.text_pages):
            raise RequestError("guidance_scale", "a kv session keeps its CFG branches' context: guidance_scale 1 "
                               "(one branch) cannot change to or from another value")  # fmt: skip

    def _check_lora(self, p: GenerationParams) -> LoraRef | None:
        """The request's adapter, checked (RequestError naming `lora` / `lora.name`); None when the GEN tower runs
        it as the base model (no adapter, or one whose modules are all on the UND tower: prefill applied it)."""
        if p.lora is None:
            return None
        if self.loras is None:
            raise RequestError("lora", "this deployment serves no adapters (its lora_dir is not set)")
        ref = self.loras.check(p.lora.name)
        return ref if GEN in ref.towers else None

    def has_work(self) -> bool:
        return bool(self.waiting or self.live)

    def wait_for_work(self, timeout: float) -> None:
        with self._lock:
            if not (self.waiting or self.live):
                self._wake.wait(timeout)

    def wake(self) -> None:
        with self._lock:
            self._wake.notify_all()

    # ---- engine thread ----
    def schedule(self) -> list[Job]:
        """Admit what fits, end what was cancelled → the jobs of this tick's forward (every live one)."""
        self._end_idle_sessions()
        self._admit()
        for job in [j for j in self.live if j.sink.cancelled()]:
            self.live.remove(job)
            self._finish(job, cancelled=True)
        self._decide_reuse(self.live)
        return list(self.live)

    def _decide_reuse(self, jobs: list[Job]) -> None:
        """Each cached request's per-branch decision for its step, with one host read for all of them."""
        cached = [j for j in jobs if j.cache is not None and not j.committing]
        distances = host_distances([j.cache.measure(j.latents, j.step) for j in cached])  # type: ignore[union-attr]
        for job, distance in zip(cached, distances):
            job.reuse = job.cache.decide(job.step, distance)  # type: ignore[union-attr]

    def update(self, jobs: list[Job], outputs: list[RowOutput]) -> None:
        """Apply each job's output of the forward; a failure ends that request only."""
        for job, out in zip(jobs, outputs):
            try:
                if job.committing:
                    self._commit(job, out.kv)
                    ended = job.final is not None  # a kept kv stream's last window, now committed: it ends
                    if ended:
                        self._finish(job, last=job.final)
                    else:
                        job.window += 1
                        self._start_window(job, previous=None)
                else:
                    if job.cache is not None:
                        job.cache.record(job.step, out.residual)
                    ended = self._advance(job, out)
            except Exception as e:  # noqa: BLE001 - fails this request only
                self.live.remove(job)
                self._finish(job, error=f"internal error in denoise step: {e}")
                continue
            if ended:
                self.live.remove(job)

    def _admit(self) -> None:
        while True:
            with self._lock:
                if not self.waiting:
                    return
                job = self.waiting[0]
                while self._pages_needed(job, job.reserve) > self.pool.pages_free - self.reserved:
                    if not self._evict_one(locked=True):
                        return  # FIFO: the head waits for pages; nobody overtakes it
                if (
                    self.live
                    and self.max_step_rows
                    and (
                        sum(self.rows(j.params, j.plan) for j in self.live) + self.rows(job.params, job.plan)
                        > self.max_step_rows
                    )
                ):
                    return  # the head waits for room in the step (the memory plan's bound)
                if not self._hold_lora(job):
                    return  # every adapter slot is held by live requests: the head waits for one (FIFO)
                self.waiting.popleft()
            if job.lora_error is not None:
                self._finish(job, error=job.lora_error)
                continue
            if job.sink.cancelled():
                self._finish(job, cancelled=True)
                continue
            try:
                self._start(job)
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the engine
                self._finish(job, error=f"internal error starting request: {e}")
                continue
            self.live.append(job)

    def _hold_lora(self, job: Job) -> bool:
        """Pin the job's adapter in a pool slot (loading it if needed) → False while every slot is pinned by others.
        An adapter that fails to load (changed since submit) sets `lora_error`: the job may go, and fails."""
        if job.lora_ref is None or job.lora_slot is not None:
            return True
        try:
            job.lora_slot = self.loras.acquire(job.lora_ref)  # type: ignore[union-attr]
        except RequestError as e:
            job.lora_error = str(e)
            return True
        return job.lora_slot is not None

    def _start(self, job: Job) -> None:
        job.t_admit = job.t_last_chunk = time.perf_counter()
        self.stats.queue_times.append(job.t_admit - job.t_submit)
        self.reserved += job.reserve
        session, job.session = job.session, None
        if session is not None and not job.prefill.text_k:  # the same prompt: the session's text K/V
            job.text_pages = session.text_pages
        else:
            if session is not None:  # a re-prompt: the new prompt's text K/V replaces the session's
                for pages in session.text_pages:
                    self.pool.free(pages)
            for k, v in zip(job.prefill.text_k, job.prefill.text_v):
                pages = self.pool.alloc(k.shape[1])
                job.text_pages.append(pages)
                k, v = k.to(self.device, self.dtype), v.to(self.device, self.dtype)
                if faults.CHECK_FINITE:  # the K/V as admission writes them to the pool
                    faults.report_nonfinite("admission", f"seed {job.params.seed}", text_k=k, text_v=v)
                self.pool.write(pages, k, v)
        kv = job.plan.commits
        job.context = session.context if session is not None and kv else [[] for _ in job.text_pages]
        # kv: the positions of committed frames never move, so they count from the session's first text lengths
        own = tuple(t.num_tokens for t in job.text_pages)
        job.vision_base = session.vision_base if session is not None and kv else own
        self._start_window(job, previous=None if session is None else session.tail)

    def _start_window(self, job: Job, previous: torch.Tensor | None) -> None:
        p, win, cfg = job.params, job.plan.windows[job.window], self.cfg
        h, w = cfg.token_grid(*p.frame_size)
        shape = (1, cfg.latent_channel, win.length, *cfg.latent_hw(*p.frame_size))
        # one generator: vision noise, then sound's, then action's (AR windows, one seed each, have neither)
        bands = [shape]
        if p.enable_sound:
            bands.append(self.sound.latent_shape(p.num_frames, p.fps))
        if p.action_mode:
            bands.append((p.chunk_size, cfg.action_dim))
        noise = initial_noise_bands(bands, p.seed + win.index, self.device)
        latents = noise[0]
        job.sound = noise[1] if p.enable_sound else None
        if p.action_mode:
            job.action = self._action_band(job, noise[-1])
        clean: list[int] = []
        if win.pinned:  # chained: the previous window's tail, clean
            latents[:, :, : win.pinned] = previous[:, :, -win.pinned :]
            clean = list(range(win.pinned))
        elif win.index == 0 and job.prefill.cond_latent is not None:  # i2v: latent frame 0; v2v: the listed frames
            clean = list(p.clean_frames)
            latents[:, :, clean] = job.prefill.cond_latent[:, :, clean].to(self.device)
        job.latents = latents
        # the pipeline's noisy set: every frame not clean (a gap such as v2v's [0, 2] leaves frame 1 noisy)
        noisy = [f for f in range(win.length) if f not in clean]
        job.noisy_frames = torch.tensor(noisy, dtype=torch.long).to(self.device)
        bands_len = (0 if job.sound is None else job.sound.shape[1], p.chunk_size)
        job.branches = tuple(
            Branch((text, *ctx), *self._rotary(base, (win.length, h, w), p.fps, win.rotary_offset, bands_len))
            for text, ctx, base in zip(job.text_pages, job.context, job.vision_base)
        )

        def twin() -> Any:  # the pipeline's deepcopy of the vision scheduler: its own multistep history
            return make_scheduler(self.sampler_config, p.steps, p.shift, self.native_flow_schedule, self.device)

        job.scheduler = twin()
        job.sound_scheduler = twin() if job.sound is not None else None
        job.action_scheduler = twin() if job.action is not None and job.action.noisy else None
        job.timesteps = job.scheduler.timesteps.tolist()
        job.cache, job.reuse = None, ()
        if p.cache is not None:  # per window's trajectory; the sigma at each step is what the pipeline gives SeaCache
            sigmas = job.scheduler.sigmas[: len(job.timesteps)].tolist()
            # no noisy frame (inverse dynamics): no indicator, every step in full (diffusers' fail-open)
            job.cache = SeaCache(
                p.cache, len(job.branches), sigmas, self.dtype, gated=bool(noisy), gains=self.sea_gains
            )
        job.step = 0
        job.committing = False

    def _action_band(self, job: Job, noise: torch.Tensor) -> ActionBand:
        """The request's first action band: noise (policy, inverse dynamics) or the given actions (forward dynamics:
        the pipeline's mask·x0 + (1−mask)·noise with every token clean is x0 exactly), channels at or above the
        domain's raw width zeroed (P:975-988)."""
        p = job.params
        noisy = p.action_mode != FORWARD
        latents = noise if noisy else job.prefill.cond_actions.to(self.device, torch.float32).clone()
        latents[:, p.raw_action_dim :] = 0
        return ActionBand(latents, DOMAIN_IDS[p.domain], noisy)

    def _rotary(
        self, text_len: int, grid: tuple[int, int, int], fps: float, offset: int, bands: tuple[int, int] = (0, 0)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The branch's tables over text | vision | sound | action: the sound and action ids (`bands`: their token
        counts) follow the vision ids."""
        ids = [vision_position_ids(self.cfg, grid, text_len, fps, offset)]
        sound_len, action_len = bands
        if sound_len:
            ids.append(sound_position_ids(self.cfg, sound_len, text_len, self.sound.latent_fps))
        if action_len:
            ids.append(action_position_ids(self.cfg, action_len, text_len, fps))
        return rotary_tables(
            self.cfg, torch.cat([i.to(ids[0].device, ids[0].dtype) for i in ids], dim=1), self.dtype, self.device
        )

    def _release(self, job: Job) -> None:
        if job.session is not None:  # a continuation that ended before admission took its session's pages
            job.text_pages, job.context, job.session = job.session.text_pages, job.session.context, None
        for pages in job.text_pages + [f for br in job.context for f in br]:
            self.pool.free(pages)
        if job.t_admit:  # admitted: its reservation was counted (`_start`)
            self.reserved -= job.reserve
        job.reserve = 0
        job.text_pages, job.context = [], []
        if job.lora_slot is not None:
            self.loras.release(job.lora_slot)  # type: ignore[union-attr]
            job.lora_slot = None

    def _finish(
        self, job: Job, error: str | None = None, cancelled: bool = False, last: torch.Tensor | None = None
    ) -> None:
        if error is None and not cancelled and job.session_id:
            self._keep(job)
        self._release(job)
        if job.claimed and not job.kept:
            with self._lock:
                self.sessions.release(job.session_id, "its continuation was cancelled" if cancelled else
                                      "its continuation failed" if error is not None else "not kept again")  # fmt: skip
        if cancelled:
            self.stats.cancelled += 1
            job.sink.error("cancelled")
        elif error is not None:
            self.stats.failed += 1
            job.sink.error(error)
        else:
            self.stats.completed += 1
            self._emit(job, last, final=True)

    def _emit(self, job: Job, latents: torch.Tensor, final: bool) -> None:
        """A finished window's new latent frames → the sink in pieces of at most `decode_chunk` latent frames, so
        the decode and transfer of one piece overlap the next (the stream decoder keeps the seams exact)."""
        n = latents.shape[2]
        size = self.decode_chunk or n
        for a in range(0, n, size):
            piece = latents[:, :, a : a + size]
            last = a + size >= n
            info = self._chunk_info(job, final and last, a, piece.shape[2])
            if final and last:
                extra: dict[str, torch.Tensor] = {} if job.sound is None else {"sound": job.sound}
                if job.params.returns_actions:  # the pipeline's out.action[0]: the domain's raw width
                    extra["actions"] = job.action.latents[:, : job.params.raw_action_dim].clone()  # type: ignore[union-attr]
                job.sink.done(piece, info, **extra)
            else:
                job.sink.chunk(piece, info)

    def _chunk_info(self, job: Job, final: bool, offset: int, frames: int) -> ChunkInfo:
        win = job.plan.windows[job.window]
        now = time.perf_counter()
        info: ChunkInfo = {
            "window": win.index,
            "windows": job.plan.windows[-1].index + 1,  # a continuation's windows count on from its session's
            "latent_offset": win.latent_start + offset,
            "latent_frames": frames,
            "timings": {"queue_s": job.t_admit - job.t_submit, "window_s": now - job.t_last_chunk},
        }
        if final:
            info["timings"]["denoise_s"] = now - job.t_admit
            if job.params.cache is not None:  # without windows its one trajectory's; with windows one per window
                skipped = job.cache_skipped
                info["cache_skipped"] = skipped[0] if job.plan.mode == "none" else skipped
            if job.kept:
                info["session_id"] = job.session_id
        job.t_last_chunk = now
        return info

    def _commit(self, job: Job, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append a kv window's committed K/V, one page list per latent frame. Frames past the context horizon
        are released first, so a stream never holds more than its horizon (what admission reserved)."""
        win, horizon = job.plan.windows[job.window], job.plan.context
        per_frame = kv[0][0].shape[1] // win.length
        keep = min(horizon, win.length) if horizon else win.length
        for branch, (k, v) in enumerate(kv):
            frames = job.context[branch]
            while horizon and len(frames) + keep > horizon:
                aged = frames.pop(0)
                self.reserved += len(aged.pages)  # back into this stream's reservation
                job.reserve += len(aged.pages)
                self.pool.free(aged)
            for f in range(win.length - keep, win.length):
                pages = self.pool.alloc(per_frame)
                self.reserved -= len(pages.pages)
                job.reserve -= len(pages.pages)
                rows = slice(f * per_frame, (f + 1) * per_frame)
                self.pool.write(pages, k[:, rows], v[:, rows])
                frames.append(pages)

    def _advance(self, job: Job, out: RowOutput) -> bool:
        """Scheduler step for one request; returns True when the request has ended."""
        p = job.params
        if faults.FAIL_STEP_SEED is not None and p.seed == faults.FAIL_STEP_SEED:
            raise faults.InjectedFault(f"injected fault in the denoise step (seed {p.seed})")
        v = guided_velocity(out.velocity, p.guidance_scale)
        t = job.scheduler.timesteps[job.step]
        job.latents = job.scheduler.step(v.unsqueeze(0), t, job.latents.unsqueeze(0), return_dict=False)[0].squeeze(0)
        if job.sound is not None:  # the same guidance, in fp32, and the sound scheduler's own step
            sv = guided_velocity(out.sound_velocity, p.guidance_scale)
            job.sound = job.sound_scheduler.step(sv.unsqueeze(0), t, job.sound.unsqueeze(0), return_dict=False)[0][0]
        if job.action_scheduler is not None:  # noisy actions: likewise, then the domain's width kept (P:1869-1886)
            raw = torch.arange(job.action.latents.shape[1], device=self.device) < p.raw_action_dim  # type: ignore[union-attr]
            # the pipeline zeroes each branch's prediction beyond the raw width (out of place: the step's outputs are
            # inference tensors)
            av = guided_velocity([v * raw for v in out.action_velocity], p.guidance_scale)
            a = job.action.latents.unsqueeze(0)  # type: ignore[union-attr]
            a = job.action_scheduler.step(av.unsqueeze(0), t, a, return_dict=False)[0].squeeze(0)
            a[:, p.raw_action_dim :] = 0
            job.action = dataclasses.replace(job.action, latents=a)  # type: ignore[arg-type]
        job.step += 1
        win = job.plan.windows[job.window]
        job.sink.progress(job.step, p.steps, win.index, job.plan.windows[-1].index + 1)
        if job.step < p.steps:
            return False
        if job.cache is not None:  # the window's decisions end with it (`_start_window` starts the next one's)
            job.cache_skipped.append(job.cache.skipped)
        new = job.latents[:, :, win.pinned :]
        if job.window == len(job.plan.windows) - 1:
            if job.session_id and job.plan.commits and self._may_keep(job):
                job.final, job.committing = new, True  # next tick commits it for the continuation, then done
                return False
            self._finish(job, last=new)
            return True
        self._emit(job, new, final=False)
        if job.plan.commits:
            job.committing = True  # next tick: the commit pass over this window's clean latents
        else:
            job.window += 1
            self._start_window(job, previous=job.latents)
        return False

    def pages_held(self, job_id: int) -> int:
        return next((j.pages_held() for j in self.live if j.id == job_id), 0)

    def fail_live(self, message: str) -> None:
        """End every live request with `message` (the engine cannot go on)."""
        self.fail_jobs(list(self.live), message)

    def fail_jobs(self, jobs: list[Job], message: str) -> None:
        """A tick failed as a whole (e.g. out of memory in the packed forward): end its requests, one error each,
        and keep serving."""
        for job in jobs:
            if job in self.live:
                self.live.remove(job)
                self._finish(job, error=message)

    def abort_all(self, message: str) -> None:
        """End every waiting and live request with `message` (shutdown)."""
        with self._lock:
            waiting, self.waiting = list(self.waiting), deque()
        for job in waiting:
            self.stats.failed += 1
            self._finish_waiting(job)
            job.sink.error(message)
        self.fail_live(message)

    # ---- sessions (engine thread) ----
    def _may_keep(self, job: Job) -> bool:
        """Whether a stream that asked to keep its session may (not while the server drains)."""
        return bool(job.session_id) and job.params.session_keep and not self.draining

    def _keep(self, job: Job) -> None:
        """A stream ends keeping its session: its pages and a chained stream's tail move into it (not freed). When
        `max_sessions` are live the least recently kept idle one is evicted; with none idle it is not kept."""
        if not self._may_keep(job):
            return
        with self._lock:
            others = len(self.sessions.busy - {job.session_id})
            while len(self.sessions.idle) + others + 1 > self.sessions.max_sessions and self.sessions.idle:
                self._evict_one(locked=True)
            if len(self.sessions.idle) + others + 1 > self.sessions.max_sessions:
                return
            p, win = job.params, job.plan.windows[job.window]
            t = self.cfg.vae_scale_temporal
            tail = job.latents[:, :, -(p.overlap_frames // t) :].clone() if p.window_mode == "chained" else None
            session = Session(job.session_id, p, win.index + 1, win.latent_start + win.new_frames, job.text_pages,
                              job.context if job.plan.commits else [], job.vision_base, tail)  # fmt: skip
            job.text_pages, job.context = [], []
            job.kept = True
            self.sessions.keep(session)

    def _end_idle_sessions(self) -> None:
        """Expired sessions end; while the server drains, every idle one does."""
        if not self.sessions.idle:
            return
        with self._lock:
            ending = [
                (i, f"expired: idle for session_ttl_s ({self.sessions.ttl_s:g} s)") for i in self.sessions.expired()
            ]
            if self.draining:
                ending = [(i, "ended: the server is draining") for i in self.sessions.idle]
            for ident, why in ending:
                self._free_session(self.sessions.end(ident, why))

    def _evict_one(self, locked: bool = False) -> bool:
        """End the least recently kept idle session (its pages back to the pool) → False when none is idle."""
        if not locked:
            with self._lock:
                return self._evict_one(locked=True)
        ident = self.sessions.oldest()
        if ident is None:
            return False
        self._free_session(self.sessions.end(ident, "evicted: its pages were needed (least recently kept)"))
        return True

    def _free_session(self, session: Session) -> None:
        for pages in session.pages():
            self.pool.free(pages)

    def _finish_waiting(self, job: Job) -> None:
        """A job ended before admission: a continuation gives its claimed session's pages back, and the session
        ends."""
        if job.session is not None:
            self._free_session(job.session)
            job.session = None
        if job.claimed:
            with self._lock:
                self.sessions.release(job.session_id, "its continuation failed")

    def session_info(self, ident: str) -> SessionInfo | None:
        """An idle session's record (any thread), or None."""
        with self._lock:
            session = self.sessions.idle.get(ident)
            return None if session is None else session.info

    @property
    def num_sessions(self) -> int:
        return self.sessions.live
