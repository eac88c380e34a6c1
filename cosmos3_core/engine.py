"""The denoise engine: owns the GEN tower, the text K/V pool and every live request.

`submit` (any thread) validates capacity and enqueues; `tick` (the engine thread, or the CLI inline)
admits waiting requests whose pages fit, drops cancelled ones, packs every live request's row (both
CFG branches, any sizes, any step index) into ONE GEN forward via the row builder, then applies each
request's guidance and its own scheduler. Requests join and leave between ticks.

Events go to the request's `Sink`: progress after each step, `done` with the final latents
[1, C, T, h, w] fp32, or one `error`. Exactly one of done/error ends every submitted request.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .checkpoint import Checkpoint
from .kv_pool import KVPool, PageList, PoolExhausted
from .layers import GEN
from .requests import GenerationParams, RequestError
from .rotary import rotary_tables, vision_position_ids
from .sampling import guided_velocity, initial_noise, make_scheduler
from .stages import PrefillResult
from .step import Branch, denoise_step, denoise_step_row


class Sink(Protocol):
    def progress(self, step: int, steps: int) -> None: ...
    def done(self, latents: torch.Tensor, timings: dict[str, float]) -> None: ...
    def error(self, message: str) -> None: ...
    def cancelled(self) -> bool: ...


class QueueFull(RuntimeError):
    pass


@dataclass
class Job:
    id: int
    prefill: PrefillResult
    sink: Sink
    t_submit: float
    pages: list[PageList] = field(default_factory=list)
    branches: tuple[Branch, ...] = ()
    latents: torch.Tensor | None = None
    noisy_frames: torch.Tensor | None = None
    scheduler: object = None
    step: int = 0
    t_admit: float = 0.0

    @property
    def params(self) -> GenerationParams:
        return self.prefill.params


@dataclass
class EngineStats:
    ticks: int = 0
    rows_last_tick: int = 0
    max_requests_in_tick: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0


class DenoiseEngine:
    def __init__(
        self, ckpt: Checkpoint, device: str, dtype: torch.dtype, pool_pages: int, page_size: int, max_queue: int
    ):
        self.ckpt = ckpt
        self.cfg = ckpt.config
        self.device, self.dtype = device, dtype
        self.model = ckpt.load_transformer({GEN}, device, dtype)
        self.pool = KVPool(
            pool_pages,
            page_size,
            self.cfg.num_hidden_layers,
            self.cfg.num_key_value_heads,
            self.cfg.head_dim,
            dtype,
            device,
        )
        self.max_queue = max_queue
        self.stats = EngineStats()
        self._waiting: deque[Job] = deque()
        self._live: list[Job] = []
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._next_id = 0

    # ---- any thread ----
    def submit(self, prefill: PrefillResult, sink: Sink) -> int:
        need = sum(self.pool.pages_for(k.shape[1]) for k in prefill.text_k)
        if need > self.pool.num_pages:
            raise RequestError("prompt", f"text needs {need} K/V pages, the pool has {self.pool.num_pages}")
        with self._lock:
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"queue full ({self.max_queue} waiting); retry later")
            self._next_id += 1
            self._waiting.append(Job(self._next_id, prefill, sink, time.perf_counter()))
            self._wake.notify()
            return self._next_id

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_live(self) -> int:
        return len(self._live)

    def has_work(self) -> bool:
        return bool(self._waiting or self._live)

    def wait_for_work(self, timeout: float) -> None:
        with self._lock:
            if not (self._waiting or self._live):
                self._wake.wait(timeout)

    def wake(self) -> None:
        with self._lock:
            self._wake.notify_all()

    # ---- engine thread ----
    def _admit(self) -> None:
        while True:
            with self._lock:
                if not self._waiting:
                    return
                job = self._waiting[0]
                need = sum(self.pool.pages_for(k.shape[1]) for k in job.prefill.text_k)
                if need > self.pool.pages_free:
                    return  # FIFO: the head waits for pages; nobody overtakes it
                self._waiting.popleft()
            try:
                self._start(job)
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the engine
                self._finish(job, error=f"internal error starting request: {e}")
                continue
            self._live.append(job)

    def _start(self, job: Job) -> None:
        p = job.params
        job.t_admit = time.perf_counter()
        latent_t = 1 + (p.num_frames - 1) // self.cfg.vae_scale_temporal
        h, w = p.height // self.cfg.vae_scale_spatial, p.width // self.cfg.vae_scale_spatial
        patch = self.cfg.latent_patch_size
        grid = (latent_t, h // patch, w // patch)
        branches = []
        for k, v in zip(job.prefill.text_k, job.prefill.text_v):
            pages = self.pool.alloc(k.shape[1])
            job.pages.append(pages)
            self.pool.write(pages, k.to(self.device, self.dtype), v.to(self.device, self.dtype))
            pos = vision_position_ids(self.cfg, grid, k.shape[1], p.fps)
            cos, sin = rotary_tables(self.cfg, pos, self.dtype, self.device)
            branches.append(Branch(pages, cos, sin))
        job.branches = tuple(branches)
        latents = initial_noise((1, self.cfg.latent_channel, latent_t, h, w), p.seed, self.device)
        first_noisy = 0
        if job.prefill.cond_latent is not None:  # i2v: latent frame 0 is the clean conditioning frame
            latents[:, :, :1] = job.prefill.cond_latent.to(self.device)
            first_noisy = 1
        job.latents = latents
        job.noisy_frames = torch.arange(first_noisy, latent_t, device=self.device)
        job.scheduler = make_scheduler(
            self.ckpt.scheduler_config, p.steps, p.shift, self.ckpt.use_native_flow_schedule, self.device
        )

    def _finish(self, job: Job, error: str | None = None, cancelled: bool = False) -> None:
        for pages in job.pages:
            self.pool.free(pages)
        job.pages = []
        if cancelled:
            self.stats.cancelled += 1
            job.sink.error("cancelled")
        elif error is not None:
            self.stats.failed += 1
            job.sink.error(error)
        else:
            self.stats.completed += 1
            now = time.perf_counter()
            job.sink.done(job.latents, {"queue_s": job.t_admit - job.t_submit, "denoise_s": now - job.t_admit})

    def tick(self) -> int:
        """Advance every live request one step. Returns the number of requests stepped."""
        self._admit()
        for job in [j for j in self._live if j.sink.cancelled()]:
            self._live.remove(job)
            self._finish(job, cancelled=True)
        if not self._live:
            return 0
        jobs = list(self._live)
        rows = [
            denoise_step_row(
                j.latents,
                float(j.scheduler.timesteps[j.step]),
                j.noisy_frames,
                j.branches,
                self.cfg.latent_patch_size,
                self.dtype,
            )
            for j in jobs
        ]
        velocities = denoise_step(self.model, self.pool, rows)
        self.stats.ticks += 1
        self.stats.rows_last_tick = sum(r.tokens.shape[0] * len(r.branches) for r in rows)
        self.stats.max_requests_in_tick = max(self.stats.max_requests_in_tick, len(jobs))
        for job, branch_v in zip(jobs, velocities):
            try:
                v = guided_velocity(branch_v, job.params.guidance_scale)
                t = job.scheduler.timesteps[job.step]
                job.latents = job.scheduler.step(v.unsqueeze(0), t, job.latents.unsqueeze(0), return_dict=False)[
                    0
                ].squeeze(0)
                job.step += 1
            except Exception as e:  # noqa: BLE001
                self._live.remove(job)
                self._finish(job, error=f"internal error in denoise step: {e}")
                continue
            job.sink.progress(job.step, job.params.steps)
            if job.step == job.params.steps:
                self._live.remove(job)
                self._finish(job)
        return len(jobs)

    def abort_all(self, message: str) -> None:
        """End every waiting and live request with `message` (shutdown)."""
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
        for job in waiting + self._live:
            self._finish(job, error=message)
        self._live = []

    def fail_live(self, message: str) -> None:
        """A tick failed as a whole (e.g. out of memory in the packed forward): end its requests, keep serving."""
        live, self._live = self._live, []
        for job in live:
            self._finish(job, error=message)

    def run_until_idle(self) -> None:
        while self.has_work():
            self.tick()


__all__ = ["DenoiseEngine", "QueueFull", "Sink", "PoolExhausted"]
