"""The denoise engine: the GEN tower, the paged K/V pool, and the step loop over every live request.

Each `tick` is schedule → rows → run → update: the `Scheduler` (scheduler.py, no model) admits and returns the
live jobs, having decided which CFG branches of cached requests reuse a residual this step (cache.py); the row
builder (`step.denoise_step_row`) turns each into its row (both CFG branches, any size, any step index, AR commit
passes too); `DenoiseStep` runs them all — but the reusing branches — as ONE packed GEN forward; the scheduler
applies each job's output. Requests join and leave between ticks. Served in FP8 (`ckpt.fp8`), each row carries
the step policy's precision for its own step (W8A16 or W8A8; an AR commit pass as its window's last step).
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch

from . import faults, memory
from .caches import precompiled_dir
from .deployment import Deployment
from .kv_pool import KVPool
from .lora_store import LoraSettings, open_store
from .memory import MemoryPlan
from .model.checkpoint import Checkpoint
from .model.layers import GEN
from .model.sound import SoundSpec
from .model.towers import EAGER, GenKernels
from .parallel.denoise import DenoiseParallel
from .parallel.group import Group
from .requests import GenerationParams
from .rows import Row, RowOutput, denoise_step_row
from .scheduler import EngineStats, Job, QueueFull, Scheduler, Sink
from .sessions import SessionTable
from .step import DenoiseStep, bucket_padding, derive_buckets
from .wire import PrefillResult

__all__ = ["DenoiseEngine", "EngineBroken", "QueueFull", "Sink"]

MAX_FAILED_TICKS = 3  # packed forwards in a row that may fail (and heal) before the engine gives up
# a given bucket list that pads a warmup request's pack by more is warned about at load; derived buckets take a pack
# only if they pad it by at most this (smaller requests keep exact layouts)
BUCKET_PAD_WARN = 0.10


class EngineBroken(RuntimeError):
    """The engine cannot serve any more requests in this process (its device is in a sticky error state): the
    host restarts it."""


class _NullSink:
    def progress(self, step: int, steps: int, window: int, windows: int) -> None: ...
    def chunk(self, latents: torch.Tensor, info: dict) -> None: ...
    def done(
        self, latents: torch.Tensor, info: dict, sound: torch.Tensor | None = None, actions: torch.Tensor | None = None
    ) -> None: ...
    def cancelled(self) -> bool:
        return False

    def error(self, message: str) -> None:
        raise RuntimeError(f"warmup request failed: {message}")


def sound_spec(ckpt: Checkpoint) -> SoundSpec | None:
    """The checkpoint's sound, or None when it cannot make sound (a request asking for it is then refused)."""
    try:
        return SoundSpec.open(ckpt.root)
    except (ValueError, OSError):
        return None


def job_lora(job: Job) -> tuple[int, float] | None:
    """The row's adapter: the slot the job holds and its request's scale (None: the base model)."""
    return None if job.lora_slot is None else (job.lora_slot, job.params.lora.scale)  # type: ignore[union-attr]


class DenoiseEngine:
    def __init__(
        self,
        ckpt: Checkpoint,
        device: str,
        dtype: torch.dtype,
        pool_pages: int,
        page_size: int,
        max_queue: int,
        compile: bool = False,
        decode_chunk: int = 0,
        attention: str = "auto",
        cuda_graphs: bool = True,
        parallel: DenoiseParallel | None = None,
        graph_buckets: tuple[int, ...] | None = (),
        max_captures: int = 16,
        fp8_attention: bool = False,
        lora: LoraSettings | None = None,
        max_step_rows: int = 0,
        max_capture_rows: int = 0,
    ):
        """`graph_buckets` None: derived by the warmup from its requests' packs (a bucketable backend only). `lora`:
        the adapters requests may choose (lora_store.py), in a pool of device slots on the GEN tower's linears."""
        cfg = self.cfg = ckpt.config
        self.derive_buckets = graph_buckets is None
        self.failed_ticks = 0  # packed forwards that raised since the last one that ran (`_heal`)
        graph_buckets = graph_buckets or ()
        self.device, self.dtype = device, dtype
        self.warmup_parts: dict[str, float] = {}  # seconds per part of the last warmup (the server logs them)
        self.model = ckpt.load_transformer({GEN}, device, dtype)
        self.fp8_policy = ckpt.fp8.policy if ckpt.fp8 is not None else None
        if lora is not None and parallel is not None:
            raise ValueError("lora_dir: adapters need a single-GPU denoise (parallel cfg and ulysses must be 1)")
        self.loras = open_store(lora, ckpt, self.model)
        kernels = GenKernels.compiled(self.model, precompiled_dir()) if compile else EAGER
        if self.fp8_policy is not None and not compile and str(device).startswith("cuda"):
            print("cosmos3: warning: FP8 linears with compile: false quantize activations and dequantize W8A16 weights "
                  "in unfused kernels: slower than the 16-bit model on the H200 (BENCHMARKS.md); set "
                  "compile: true", file=sys.stderr)  # fmt: skip
        if parallel is None:
            self.pool = KVPool(
                pool_pages, page_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype, device
            )
            self.step = DenoiseStep(self.model, self.pool, kernels, attention, cuda_graphs, graph_buckets, max_captures,
                                    fp8_attention, max_capture_rows)  # fmt: skip
        elif fp8_attention:
            raise ValueError("fp8_attention: a single-GPU denoise only (parallel splits it over ranks)")
        else:  # several ranks per request (parallel/denoise.py): the same interfaces over a group
            self.pool = parallel.pool(self.model, pool_pages, page_size, dtype, device)
            self.step = parallel.step(self.model, self.pool, kernels, attention, cuda_graphs, max_captures)
        self.scheduler = Scheduler(
            cfg, self.pool, ckpt.scheduler_config, ckpt.use_native_flow_schedule, max_queue, decode_chunk,
            sound_spec(ckpt), self.loras, max_step_rows,
        )  # fmt: skip
        self.plan: MemoryPlan | None = None  # the deployment's memory plan (from_deployment), logged and exported

    @classmethod
    def from_deployment(
        cls, ckpt: Checkpoint, d: Deployment, device: str | None = None, group: Group | None = None
    ) -> DenoiseEngine:
        """`group`: a running group to use (the CLI shares one with its decode); else one is started when the
        deployment's `parallel` splits the denoise."""
        d, plan = d.planned(ckpt)  # pool_pages and max_step_rows resolved; refuses a plan that does not fit
        if group is None and d.parallel.denoise_ranks > 1:
            group = Group(d.worker_spec(ckpt.root, ("denoise",)))
        engine = cls(
            ckpt,
            device or d.torch_device,
            d.torch_dtype,
            d.pool_pages,
            d.page_size,
            d.max_queue,
            compile=d.compile,
            decode_chunk=d.decode_chunk_frames,
            attention=d.attention,
            cuda_graphs=d.cuda_graphs,
            parallel=DenoiseParallel(group) if group is not None and d.parallel.denoise_ranks > 1 else None,
            # without graphs (or captures), padding only costs; None (not given): the warmup derives them
            graph_buckets=(None if d.graph_buckets is None else tuple(d.graph_buckets))
            if d.cuda_graphs and d.max_captures
            else (),
            max_captures=d.max_captures,
            fp8_attention=d.fp8_attention,
            lora=d.lora,
            max_step_rows=int(d.max_step_rows),
            max_capture_rows=d.max_capture_rows,
        )
        engine.plan = plan
        engine.scheduler.sessions = SessionTable(d.session_ttl_s, d.max_sessions)  # kept AR sessions (sessions.py)
        return engine

    def tick(self) -> int:
        """Advance every live request one step (or commit pass). Returns the number of requests in the forward."""
        if faults.STEP_DELAY_S:
            time.sleep(faults.STEP_DELAY_S)
        jobs = self.scheduler.schedule()
        if not jobs:
            return 0
        try:
            rows = [self._row(j) for j in jobs]
            outputs = self.step(rows)
        except Exception as e:  # noqa: BLE001 - a fault of the tick: its requests end, the engine heals
            self._heal(jobs, e)
            return 0
        if faults.CHECK_FINITE:
            try:  # a diagnostic never takes the engine down
                self._check_finite(jobs, rows, outputs)
            except Exception as e:  # noqa: BLE001
                faults.say("check_finite failed", f"{type(e).__name__}: {e}")
        self.failed_ticks = 0
        stats = self.scheduler.stats
        stats.ticks += 1
        stats.request_steps += len(jobs)
        stats.rows_last_tick = sum(r.tokens.shape[0] * sum(x is None for x in r.reuse) for r in rows)
        stats.max_requests_in_tick = max(stats.max_requests_in_tick, len(jobs))
        self.scheduler.update(jobs, outputs)
        return len(jobs)

    def _heal(self, jobs: list[Job], error: Exception) -> None:
        """A packed forward raised (out of memory, a CUDA or kernel error, an injected fault): each of its requests
        ends with one error, the step drops every layout and graph (nothing the failed pass touched is reused), and
        the next tick runs eagerly into fresh layouts. `EngineBroken` instead (the host restarts the engine, and
        ends every request with its cause) when the device is left unusable (a sticky CUDA error) or when
        MAX_FAILED_TICKS ticks in a row failed: an engine that fails every request must not stay up."""
        first = str(error).splitlines()[0] if str(error) else ""
        cause = f"{type(error).__name__}: {first}"
        self.failed_ticks += 1
        try:
            self.step.reset()
            if self.device.startswith("cuda"):  # a sticky error shows on any later work
                torch.ones(1, device=self.device).add_(1).item()
        except Exception as e:  # noqa: BLE001
            raise EngineBroken(f"the denoise device is unusable after a failed step ({cause}; then "
                               f"{type(e).__name__}: {e})") from e  # fmt: skip
        if self.failed_ticks >= MAX_FAILED_TICKS:
            raise EngineBroken(f"{self.failed_ticks} denoise steps in a row failed (the last: {cause})") from error
        self.scheduler.fail_jobs(jobs, f"denoise step failed ({cause}); the request was ended, the engine "
                                       "recovered and serves new requests; retry")  # fmt: skip
        self.scheduler.stats.tick_failures += 1
        print(f"cosmos3: a denoise step failed and the engine recovered ({len(jobs)} requests ended): {cause}",
              file=sys.stderr)  # fmt: skip

    def _check_finite(self, jobs: list[Job], rows: list[Row], outputs: list[RowOutput]) -> None:
        """`check_finite=1` (faults.py): the tick's requests whose outputs are not finite, with the layout the tick
        ran in (kind, rows, its run count, whether it holds a graph) — a host sync per tick."""
        bad = [j.params.seed for j, o in zip(jobs, outputs)
               if faults.nonfinite(*o.velocity, *o.sound_velocity, *o.action_velocity, *(t for kv in o.kv for t in kv))]  # fmt: skip
        if not bad:
            return
        step, where = self.step, ""
        if isinstance(step, DenoiseStep) and step.layouts:
            key, layout = next(reversed(step.layouts.items()))
            graph = "capture failed" if layout.capture_failed else "graph" if layout.graph is not None else "eager"
            held = sum(v.graph is not None for v in step.layouts.values())
            where = (f"; layout {'bucket' if key[0][0] == 'bucket' else 'exact'} {layout.packed.tokens.shape[0]} "
                     f"rows, run {layout.runs}, {graph}; {held} graphs held, {step.captures} captured")  # fmt: skip
        sizes = [(r.tokens.shape[0], sum(x is None for x in r.reuse), r.commit) for r in rows]
        faults.say("tick", f"{self.scheduler.stats.ticks + 1}: non-finite outputs for seeds {bad} of "
                   f"{[j.params.seed for j in jobs]} (rows, running branches, commit: {sizes}){where}")  # fmt: skip
        if faults.said("tick") == 1:  # the first such tick: were its inputs already bad, or the weights?
            faults.say("tick inputs", self._nonfinite_state(jobs), 1)

    def _nonfinite_state(self, jobs: list[Job]) -> str:
        """What the forward read that is not finite: the jobs' latents and text K/V pages, the GEN weights."""
        latents = [j.params.seed for j in jobs if faults.nonfinite(j.latents, j.sound)]
        pages = []
        if isinstance(self.pool, KVPool):
            for j in jobs:
                for pl in j.text_pages:
                    kv = [
                        x[:, pl.index].flatten(1, 2)[:, : pl.num_tokens] for x in (self.pool.k_pages, self.pool.v_pages)
                    ]
                    if faults.nonfinite(*kv):
                        pages.append(j.params.seed)
        weights = [n for n, w in self.model.named_parameters() if faults.nonfinite(w.float() if w.itemsize == 1 else w)]
        return (f"latents non-finite for seeds {latents}; text K/V pages for seeds {sorted(set(pages))}; "
                f"{len(weights)} non-finite GEN weights {weights[:5]}")  # fmt: skip

    def _row(self, job: Job) -> Row:
        patch, steps = self.cfg.latent_patch_size, len(job.timesteps)
        if job.committing:
            a16, lora = self._a16(steps - 1, steps), job_lora(job)
            return denoise_step_row(
                job.latents, 0.0, job.noisy_frames[:0], job.branches, patch, self.dtype, True, a16=a16, lora=lora
            )
        t = job.timesteps[job.step]
        return denoise_step_row(
            job.latents, t, job.noisy_frames, job.branches, patch, self.dtype, sound_latents=job.sound,
            action=job.action, a16=self._a16(job.step, steps), reuse=job.reuse,
            record=job.cache is not None and job.cache.gated, lora=job_lora(job),
        )  # fmt: skip

    def _a16(self, step: int, steps: int) -> bool:
        """FP8 layer linears: W8A16 for this step (the policy's choice); 16-bit models: True, and ignored."""
        return self.fp8_policy is None or self.fp8_policy.use_high_precision(step, steps)

    # ---- the scheduler's, for the Triton glue and the CLI ----
    def submit(self, prefill: PrefillResult, sink: Sink) -> int:
        return self.scheduler.submit(prefill, sink)

    @property
    def stats(self) -> EngineStats:
        return self.scheduler.stats

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_live(self) -> int:
        return len(self.scheduler.live)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def wait_for_work(self, timeout: float) -> None:
        self.scheduler.wait_for_work(timeout)

    def wake(self) -> None:
        self.scheduler.wake()

    def fail_live(self, message: str) -> None:
        self.scheduler.fail_live(message)

    def abort_all(self, message: str) -> None:
        self.scheduler.abort_all(message)

    def pages_held(self, job_id: int) -> int:
        return self.scheduler.pages_held(job_id)

    def warmup(self, requests: list[GenerationParams], text_tokens: int = 96, capture_buckets: bool = True) -> float:
        """Capture every `graph_buckets` layout (W8A16, and served in FP8, W8A8 too: `DenoiseStep.capture_buckets`;
        said on stderr when `max_captures` holds fewer), and run each request shape for two steps through the real
        step (rows from the row builder), so compiles, allocator growth and kernel autotuning happen before serving;
        an action request with zero clean latents (forward dynamics: zero actions). Served in FP8, a 1-step request
        (W8A8 by the policy's 1-step rule) runs beside the first one's W8A16 step, then alone: the W8A16, W8A8 and
        mixed paths of the linears are all compiled before serving. A request with an adapter also runs beside
        itself without one: the merged and the dense adapter paths (model/lora.py) both compile here.

        Buckets (a bucketable backend only): given ones are captured first, so the requests' layouts cannot use up
        `max_captures`, and each is checked against the requests' packs (a warning when one pads a pack by more than
        BUCKET_PAD_WARN); none given (`graph_buckets` None) derives them from the rows the requests' steps packed
        (`step.derive_buckets`: each shape alone, with each count of its CFG branches running), then captures them.
        `capture_buckets` False (a reload): only the buckets the requests' steps run are captured; each other one at
        its second step served, on the serving thread.

        Returns seconds spent; `warmup_parts`: the bucket captures' and the requests'."""
        t0 = time.perf_counter()
        step = self.step if isinstance(self.step, DenoiseStep) else None  # parallel groups keep exact layouts
        bucketed = step is not None and step.attention.bucketable
        capture = bucketed and capture_buckets
        t_captures = self._capture_buckets() if capture and step.buckets else 0.0  # type: ignore[union-attr]
        if step is not None:
            step.row_shapes = set()
        cfg = self.cfg
        g = torch.Generator().manual_seed(0)
        for p in requests:
            shape = (cfg.num_hidden_layers, text_tokens, cfg.num_key_value_heads, cfg.head_dim)
            kv = [torch.randn(shape, generator=g).to(self.dtype) * 0.1 for _ in range(2 * p.cfg_branches)]
            cond = actions = None
            if p.action_mode:  # zero clean latents (and given actions): the served request's clean/noisy split
                frames = (p.num_frames - 1) // cfg.vae_scale_temporal + 1
                cond = torch.zeros(1, cfg.latent_channel, frames, *cfg.latent_hw(*p.frame_size))
                if not p.returns_actions:  # forward dynamics
                    actions = torch.zeros(p.chunk_size, cfg.action_dim)
            runs = [[(2, p), (1, p)], [(1, p)]] if self.fp8_policy is not None else [[(2, p)]]
            gen_adapter = p.lora is not None and self.loras is not None and GEN in self.loras.check(p.lora.name).towers
            if gen_adapter:  # alone, its adapter merges into the weights; beside a request without it, the dense
                runs.append([(2, p), (2, dataclasses.replace(p, lora=None))])  # delta: compile both now
            for run in runs:  # the requests of a run share ticks
                for n, q in run:
                    pre = PrefillResult(
                        dataclasses.replace(q, steps=n), kv[: q.cfg_branches], kv[q.cfg_branches :], cond, actions
                    )
                    self.submit(pre, _NullSink())
                self.run_until_idle()
        if step is not None:
            shapes, step.row_shapes = step.row_shapes or set(), None
            if bucketed and self.derive_buckets:
                cap = step.max_capture_rows  # a larger bucket would only pad: it runs eagerly anyway
                step.buckets = tuple(b for b in derive_buckets(shapes) if not cap or b <= cap)
                step.pad_limit = BUCKET_PAD_WARN
                print(f"cosmos3: graph_buckets derived from warmup_requests: {list(step.buckets)}", file=sys.stderr)
                t_captures += self._capture_buckets() if capture else 0.0
            elif bucketed and step.buckets:
                for rows, bucket, pad in bucket_padding(step.buckets, shapes):
                    if pad > BUCKET_PAD_WARN:
                        print(f"cosmos3: warning: graph_buckets pads a warmup request's {rows}-row pack to {bucket} "
                              f"rows (+{pad:.0%} padding computed every step); leave graph_buckets out to derive "
                              "buckets from warmup_requests", file=sys.stderr)  # fmt: skip
        if self.device.startswith("cuda"):
            memory.release_cached()
        self.scheduler.stats = EngineStats()  # serving counts start after warmup
        faults.restart_counts()
        total = time.perf_counter() - t0
        self.warmup_parts = {"bucket captures": t_captures, "requests": total - t_captures}
        return total

    def _capture_buckets(self) -> float:
        """Capture the step's buckets (W8A16; served in FP8, all-W8A8 too) → seconds spent."""
        t0 = time.perf_counter()
        step = self.step
        assert isinstance(step, DenoiseStep)
        a16 = (True, False) if self.fp8_policy is not None else (True,)
        want = len(step.buckets) * len(a16) if step.cuda_graphs else 0
        step.capture_buckets(a16)
        held = sum(v.graph is not None for v in step.layouts.values())
        if held < want:
            print(f"cosmos3: warmup holds {held} of {want} graph buckets' captures (max_captures "
                  f"{step.max_captures})", file=sys.stderr)  # fmt: skip
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def run_until_idle(self) -> None:
        while self.has_work():
            self.tick()
