"""`cosmos3_denoise` (decoupled), its stub process: `DenoiseModel` hands each request to the denoise engine and
returns at once; the engine thread (`EngineThread`) packs every live request into one forward per tick; each
request's `TritonSink` (sink.py) turns its engine events into responses; `Holder` keeps each finished request's
FINAL until vae_decode is done with its frames, polling through the ensemble meanwhile so that a client's cancel
still reaches vae_decode (lifecycle.py says who sends, holds and counts what); `EngineMetrics` publishes the
engine's gauges.

Only imported inside a Triton Python stub.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from .. import faults
from ..deployment import use_device
from ..engine import DenoiseEngine, EngineBroken, QueueFull
from ..errors import drain_timeout, part_died, part_stopped
from ..requests import RequestError, validate, warmup_inputs
from ..sampling import checkpoint_shift, scheduler_class
from ..step import DenoiseStep
from ..wire import PrefillResult, RequestMeta
from . import lifecycle
from .gpu_memory import GpuMemoryMetric
from .io import (
    EMPTY_LATENTS,
    Responder,
    deployment_from_args,
    error_response,
    imports_s,
    input_array,
    input_torch,
    latents_response,
    log_exception,
    process_age_s,
)
from .outcomes import AT_DENOISE, Outcomes
from .sink import TritonSink
from .state import ServerState


class Holder:
    """The requests whose engine part ended with `done`: each one's FINAL is held until vae_decode reports it done
    with the frames (`state.finished`), then sent with an `end` step; meanwhile a `poll` step every POLL_S carries a
    client's cancel to vae_decode; the streams of a dead vae_decode are answered with its error (lifecycle.held_tick)."""

    TICK_S = 0.01  # how soon a finished stream's FINAL follows its last frames

    def __init__(self, responder: Responder, state: ServerState, outcomes: Outcomes):
        self.responder, self.state, self.outcomes = responder, state, outcomes
        self.streams: dict[str, tuple[TritonSink, lifecycle.HeldStream]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cosmos3-hold", daemon=True)
        self.thread.start()

    def hold(self, sink: TritonSink) -> None:
        with self._lock:
            self.streams[sink.id] = (sink, lifecycle.HeldStream(last_poll=time.monotonic(), t0=sink.t0))

    def busy(self) -> bool:
        return bool(self.streams)

    def _run(self) -> None:
        while not self._stop.wait(self.TICK_S):
            if self.streams:
                self.tick()

    def tick(self) -> None:
        now, died = time.monotonic(), self.state.died_at("vae_decode")
        with self._lock:
            held = list(self.streams.items())
        for ident, (sink, h) in held:
            do = lifecycle.held_tick(h, now, self.state.finished(ident), lifecycle.gone(h.t0, died))
            if do.send == "nothing":
                continue
            if do.count:  # published now, not with the engine's next metrics (a kill meanwhile would lose it)
                self.outcomes.count_now(do.count)
            if do.send == "error":
                self.responder.send(sink.sender, lambda m=do.message: error_response(m), final=True)
            else:  # poll or end: an event vae_decode answers with nothing
                event = {"type": do.send, "id": ident}
                self.responder.send(sink.sender, lambda e=event: latents_response(EMPTY_LATENTS, e), do.final)
            if do.final:
                with self._lock:
                    self.streams.pop(ident, None)
            if do.forget:
                self.state.forget(ident)

    def close(self, timeout: float) -> None:
        """The model is unloading: the streams still held end with that error."""
        self._stop.set()
        self.thread.join(timeout)
        for sink, _ in self.streams.values():
            self.responder.send(sink.sender, lambda: error_response(part_stopped("denoise")), final=True)
        self.streams.clear()


class EngineMetrics:
    """The engine's gauges, counters and queue-time histogram, published by a thread of their own every
    `interval` seconds: the engine thread only bumps plain counters and never talks to the server."""

    QUEUE_BUCKETS = [0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300]

    def __init__(self, engine: DenoiseEngine, labels: dict[str, str], interval: float = 0.2):
        self.engine, self.interval = engine, interval
        self._families: list[Any] = []  # a MetricFamily must outlive its Metrics
        G, C, H = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.HISTOGRAM

        def family(name: str, desc: str, kind: Any, **kw: Any) -> Any:
            self._families.append(pb_utils.MetricFamily(name=name, description=desc, kind=kind))
            return self._families[-1].Metric(labels=labels, **kw)

        self.gauges = {
            "pages_used": family("cosmos3_kv_pages_used", "K/V pages held by requests", G),
            "pages_free": family("cosmos3_kv_pages_free", "K/V pages free", G),
            "num_waiting": family("cosmos3_queue_depth", "Requests waiting for admission", G),
            "num_live": family("cosmos3_live_requests", "Requests being denoised", G),
            "max_requests_in_tick": family("cosmos3_max_requests_per_tick", "Most requests packed into one forward", G),
            "rows_last_tick": family("cosmos3_rows_last_tick", "Token rows (both CFG branches) in the last forward", G),
        }
        self.steps_per_s = family("cosmos3_request_steps_per_second", "Request-steps per second, last interval", G)
        self.counters = {
            "ticks": family("cosmos3_engine_ticks_total", "Packed denoise forwards run", C),
            "request_steps": family("cosmos3_request_steps_total", "Request-steps advanced (> ticks when shared)", C),
            "tick_failures": family("cosmos3_tick_failures_total", "Packed forwards that raised (requests ended)", C),
        }
        self.queue_time = family("cosmos3_queue_seconds", "Submit to admission", H, buckets=self.QUEUE_BUCKETS)
        # AR sessions (sessions.py): kept and not ended (idle, or being continued); idle ones evicted for their pages
        self.sessions = family("cosmos3_sessions", "AR sessions live (kept, idle or being continued)", G)
        self.evictions = family("cosmos3_session_evictions_total", "Idle AR sessions evicted", C)
        self._evicted = 0
        # how requests ended in the engine (its sinks count them; completed is decode's: outcomes.py)
        self.outcomes = Outcomes(labels, AT_DENOISE)
        self._last = dict.fromkeys(self.counters, 0)
        self._last_t = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cosmos3-metrics", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.publish()

    def _set_gauges(self) -> None:
        e, stats = self.engine, self.engine.stats
        values = {"pages_used": e.pool.pages_used, "pages_free": e.pool.pages_free, "num_waiting": e.num_waiting,
                  "num_live": e.num_live, "max_requests_in_tick": stats.max_requests_in_tick,
                  "rows_last_tick": stats.rows_last_tick}  # fmt: skip
        for k, metric in self.gauges.items():
            metric.set(values[k])

    def publish_end(self, outcome: str) -> None:
        """A request the engine ended, once its end is out (the responder's thread): counted and published with the
        gauges it moved (its pages freed), so that a scrape that shows the count shows them too, and a kill loses
        neither."""
        self.outcomes.count(outcome)
        with self._lock:
            self._set_gauges()
        self.outcomes.publish()

    def publish(self) -> None:
        e, stats = self.engine, self.engine.stats
        with self._lock:
            self._set_gauges()
            now = time.monotonic()
            steps = stats.request_steps - self._last["request_steps"]
            self.steps_per_s.set(steps / max(now - self._last_t, 1e-6))
            self._last_t = now
            for k, metric in self.counters.items():
                value = getattr(stats, k)
                if value != self._last[k]:
                    metric.increment(value - self._last[k])
                    self._last[k] = value
            while stats.queue_times:
                self.queue_time.observe(stats.queue_times.popleft())
        self.outcomes.publish()
        table = e.scheduler.sessions
        self.sessions.set(table.live)
        if table.evictions != self._evicted:
            self.evictions.increment(table.evictions - self._evicted)
            self._evicted = table.evictions

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.publish()


class EngineThread:
    """Runs `engine.tick()` until stopped; a failing tick fails the requests in it, never the thread. Between ticks it
    reads the server's state: a drain, a dead vae_decode, and tells whether this instance holds any request."""

    def __init__(
        self,
        engine: DenoiseEngine,
        state: ServerState,
        instance: str,
        holder: Holder,
        drain_timeout_s: float,
        on_broken: Callable[[], None] | None = None,
    ):
        """`on_broken`: called after an `EngineBroken` ended every request and before the process exits (the model
        flushes its responses and metrics there: an exit drops what is still queued)."""
        self.engine, self.state, self.instance, self.holder = engine, state, instance, holder
        self.drain_timeout_s = drain_timeout_s
        self.on_broken = on_broken
        self.drain_since: float | None = None
        self.decode_down = False
        self.busy = False
        self.busy_lock = threading.Lock()  # `submit` (execute's thread) and `_tell_busy` (this one) mark in turn
        self.submitting = 0  # requests `submit` is handing to the engine (under busy_lock)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cosmos3-engine", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        use_device(self.engine.device)
        while not self.stop.is_set():
            self.engine.wait_for_work(0.05)
            self._check_drain()
            self._check_decode()
            self._tell_busy()
            try:
                self.engine.tick()
            except EngineBroken as e:  # the device is gone: end everything and let Triton restart this model
                message = log_exception("denoise engine", e)
                self.engine.abort_all(f"{message}; the denoise model restarts, retry")
                if self.on_broken is not None:
                    self.on_broken()
                os._exit(1)  # the stub's death is what Triton (and the supervisor) act on
            except Exception as e:  # noqa: BLE001
                self.engine.fail_live(log_exception("denoise tick", e))

    def submit(self, prefill: PrefillResult, sink: TritonSink) -> None:
        """Hand a request to the engine (from `execute`'s thread), the instance marked busy first: its first event,
        sent from inside a tick, gives its admission ticket back, and a mark set only at this thread's next look
        would leave the drain a tick's time in which nothing holds the request."""
        with self.busy_lock:
            self.submitting += 1
            self._mark_busy(True)
        try:  # outside the lock: a submit may read a LoRA adapter from disk, and the ticks must not wait for it
            self.engine.submit(prefill, sink)
        finally:
            with self.busy_lock:
                self.submitting -= 1

    def _tell_busy(self) -> None:
        """The supervisor's drain waits until no instance holds a request (its pieces still decoding included)."""
        with self.busy_lock:
            self._mark_busy(self.submitting > 0 or self.engine.has_work() or self.holder.busy())

    def _mark_busy(self, busy: bool) -> None:
        if busy != self.busy:
            self.state.set_busy(self.instance, busy)
            self.busy = busy

    def _check_drain(self) -> None:
        """Draining: admit nothing new; requests still live after the drain timeout end with one error each."""
        if self.drain_since is None:
            if self.state.draining():
                self.drain_since = time.monotonic()
                self.engine.scheduler.draining = True
        elif time.monotonic() - self.drain_since > self.drain_timeout_s and self.engine.has_work():
            self.engine.abort_all(drain_timeout(self.drain_timeout_s))

    def _check_decode(self) -> None:
        """vae_decode's stub died: every request here would send its next event to the dead instance (an ensemble
        request keeps the models it started with), so end them now rather than denoise them for nothing."""
        down = self.state.is_down("vae_decode")
        if down and not self.decode_down and self.engine.has_work():
            self.engine.abort_all(part_died("vae_decode"))
        self.decode_down = down

    def close(self, timeout: float) -> None:
        self.stop.set()
        self.engine.wake()
        self.thread.join(timeout)
        self.engine.abort_all(part_stopped("denoise"))
        with self.busy_lock:
            self._mark_busy(False)


class DenoiseModel:
    """`cosmos3_denoise`'s model.py, as its `TritonPythonModel` calls it: `initialize` builds and warms the engine, then
    its metrics and threads."""

    def __init__(self, args):
        t0, booted, imported = time.perf_counter(), process_age_s(), imports_s()
        d, device = deployment_from_args(args)
        state = ServerState(d.state_dir)
        ckpt = d.open_checkpoint()
        # diffusers' import for the sampler's class (2-2.5 s in-process on H100 hosts) runs beside the plan and the
        # engine's load instead of in the warmup: a little faster, or the same, on one host (docs/operations.md)
        scheduler_import = threading.Thread(target=scheduler_class, name="cosmos3-scheduler-import", daemon=True)
        scheduler_import.start()
        # a reload: this instance's first load in this server's life reached the largest admitted request's peak on
        # this card, so the warmup leaves that request out and captures only its requests' layouts (the other
        # buckets capture when first served), and the engine takes the step layouts it settled on then
        # (its graph buckets, derived from the warmup's packs, and how far a pack may be padded into one)
        instance = args["model_instance_name"]
        proven = state.proven_peak(instance)
        layouts = json.loads(proven) if proven else None
        if layouts is not None:
            d = dataclasses.replace(d, graph_buckets=layouts["buckets"])
        t_plan = time.perf_counter()
        d, plan = d.planned(ckpt, peak_warmup=proven is None)  # refused here when it does not fit the card
        t_plan = time.perf_counter() - t_plan
        if plan.card_bytes:  # on the CPU no card to plan for (`make plan GPU_MEMORY=GIB` sizes one)
            pb_utils.Logger.log_info(f"cosmos3: GPU memory plan\n{plan.table()}\n{plan.verdict()}")
        self.engine = DenoiseEngine.from_deployment(ckpt, d, device)
        step = self.engine.step if isinstance(self.engine.step, DenoiseStep) else None
        if layouts is not None and step is not None:
            step.pad_limit = layouts["pad_limit"]
        pb_utils.Logger.log_info(  # startup's parts
            f"cosmos3_denoise: engine built in {time.perf_counter() - t0:.1f}s (plan {t_plan:.1f}s; "
            f"process start to initialize {booted:.1f}s, its imports {imported:.1f}s)"
        )
        scheduler_import.join()
        scheduler_class()  # made by the thread (cached): its error, if it failed, is raised here
        cfg, shift = ckpt.config, checkpoint_shift(ckpt.scheduler_config)
        sizes = (d.defaults, d.limits, cfg.pixel_alignment, cfg.vae_scale_temporal, shift)
        warmup = []
        for r in d.warmup_requests:  # an action request: a blank image (clip) at the default size (warmup_inputs)
            image, video, raw = warmup_inputs(r, d.defaults)
            warmup.append(validate("warmup", r, image, *sizes, video, raw))
        with state.warmup_turn():  # the parts reach their peaks one at a time
            took = self.engine.warmup(warmup, capture_buckets=proven is None)
        settled = {"buckets": list(step.buckets), "pad_limit": step.pad_limit} if step is not None else None
        state.prove_peak(instance, json.dumps(settled) if settled else "")
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in self.engine.warmup_parts.items())
        pb_utils.Logger.log_info(f"cosmos3_denoise: warmup of {len(warmup)} shapes took {took:.1f}s ({parts})")
        self.metrics = EngineMetrics(
            self.engine, {"model": args["model_name"], "instance": args["model_instance_name"]}
        )
        labels = {"model": args["model_name"], "instance": args["model_instance_name"]}
        self.gpu_memory = GpuMemoryMetric(plan, ("denoise", "server"), labels)
        self.state = ServerState(d.state_dir)
        self.state.clear_sessions()  # a previous incarnation's sessions went with its pages
        self.engine.scheduler.sessions.on_record = self.state.set_session  # prefill and vae_decode read them
        self.state.clear_tickets("engine")  # a previous incarnation's waiting requests are never answered
        self.state.set_busy(args["model_instance_name"], False)  # nor its held ones
        self.responder = Responder(device)
        self.holder = Holder(self.responder, self.state, self.metrics.outcomes)
        self.engine_thread = EngineThread(self.engine, self.state, args["model_instance_name"], self.holder,
                                          d.drain_timeout_s, self._flush)  # fmt: skip
        self.host_kv_warned = not str(device).startswith("cuda")  # said once: K/V that crossed through the host

    def execute(self, requests):
        """Every request's answer on arrival first (`accepted`, so that vae_decode holds a step of each before this
        returns, or its refusal: lifecycle.arrival), then each accepted one's inputs and its submission to the
        engine."""
        died, sinks = self.state.died_at("vae_decode"), []
        for request in requests:
            outcome = None
            try:
                meta = RequestMeta.decode(input_array(request, "request").reshape(-1)[0])
                refusal = lifecycle.arrival(meta.t0, died)
                if refusal is None:  # a refused one's ticket goes back with its error (TritonSink._send)
                    self.state.claim(meta.id)
            except Exception as e:  # noqa: BLE001
                meta, refusal, outcome = None, log_exception("cosmos3_denoise", e), "failed"
            sink = TritonSink(request, self.responder, meta, self.state, self.metrics.outcomes, self.holder.hold,
                              self.metrics.publish_end)  # fmt: skip
            if sink.arrived(refusal, outcome):
                sinks.append(sink)
        for sink in sinks:
            try:
                self._submit(sink)
            except QueueFull as e:
                sink.error(str(e), "rejected")
            except RequestError as e:  # what only the engine checks (e.g. the pool's size)
                sink.error(str(e), "bad_input")
            except Exception as e:  # noqa: BLE001
                sink.error(log_exception("cosmos3_denoise", e), "failed")
        if sinks:
            self.gpu_memory.publish()
        return None

    def _submit(self, sink: TritonSink) -> None:
        request, meta = sink.request, sink.meta
        text_kv, cond = input_torch(request, "text_kv"), input_torch(request, "cond_latent")
        if not text_kv.is_cuda and not self.host_kv_warned:
            self.host_kv_warned = True
            pb_utils.Logger.log_warn(
                f"cosmos3_denoise: a {text_kv.nbytes >> 20} MiB text_kv crossed through host memory (Triton's "
                "CUDA pool was full or too small: slower; raise --cuda-memory-pool-byte-size, docs/gpu.md)"
            )
        if faults.CHECK_FINITE:  # how the K/V crossed (on the device, or on the host: a pool too small)
            faults.say("wire", f"text_kv {tuple(text_kv.shape)} reaches the denoise model on {text_kv.device}", 1)
            faults.report_nonfinite("denoise input", f"{meta.id} seed {meta.params.seed} ({text_kv.device})",
                                    text_kv=text_kv, cond_latent=cond)  # fmt: skip
        result = PrefillResult.from_wire(
            meta.params,
            text_kv,
            input_array(request, "text_lens").astype(np.int64),
            cond,
            input_torch(request, "cond_actions"),
        )
        self.engine_thread.submit(result, sink)

    def _flush(self) -> None:
        """The engine is broken and the process exits next: send what is queued (each request's error), publish."""
        self.metrics.close()
        self.responder.close(timeout=5)

    def finalize(self):
        self.engine_thread.close(timeout=30)
        self.holder.close(timeout=5)
        self.metrics.close()
        self.responder.close(timeout=30)
