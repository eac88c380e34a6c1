"""Triton glue shared by the three `model.py` adaptors: deployment from the model config, tensors in and out,
the engine thread, the decode loop, the one send path (`Responder`) of both decoupled models, and metrics.

Only imported inside a Triton Python stub (`triton_python_backend_utils` exists there). What crosses between
the models and to the client is typed in wire.py; errors travel as Triton errors whose text is
"<field>: <what is allowed>".
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import to_dlpack

from .. import faults
from ..deployment import Deployment
from ..engine import DenoiseEngine, EngineBroken
from ..errors import down_mark, drain_timeout, part_died, part_restarting, part_stopped
from ..requests import RequestError
from ..stages import DecodeStage
from ..wire import AcceptedEvent, ChunkEvent, ChunkInfo, ErrorEvent, Event, RequestMeta, decode_event, encode_event
from .admission import Tickets
from .cancel import CancelMarks
from .outcomes import AT_DECODE, AT_DENOISE, Outcomes, decode_failures

EMPTY_LATENTS = np.zeros((0, 0, 0, 0, 0), dtype=np.float32)
EMPTY_VIDEO = np.zeros((0, 0, 0, 3), dtype=np.uint8)
EMPTY_SOUND = np.zeros((0, 0), dtype=np.float32)  # sound latents / audio of a response that has none
EMPTY_ACTIONS = np.zeros((0, 0), dtype=np.float32)  # actions of a response that has none
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def deployment_from_args(args: dict[str, Any]) -> tuple[Deployment, str]:
    """The deployment this instance serves and its device (`cuda:<instance device id>` on GPU)."""
    model_config = json.loads(args["model_config"])
    path = model_config["parameters"]["deployment"]["string_value"]
    d = Deployment.load(path)
    device = d.torch_device
    if device.startswith("cuda"):
        device = f"cuda:{args.get('model_instance_device_id', 0) or 0}"
    use_device(device)
    return d, device


def use_device(device: str | torch.device) -> None:
    """Make the instance's GPU current in the calling thread (current devices are per thread: a worker thread
    starts on GPU 0, whose streams its events and graph captures would otherwise use)."""
    if str(device).startswith("cuda"):
        torch.cuda.set_device(device)


def input_array(request, name: str) -> np.ndarray | None:
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def input_torch(request, name: str) -> torch.Tensor:
    """An input as a tensor that outlives `execute`. Triton frees a request's input buffers when `execute` returns
    (python_backend's README: "all tensor data associated with the InferenceRequest objects passed to the function
    are deleted"), decoupled models included, while the denoise engine reads `text_kv` at admission (a tick or more
    later) and the decoder reads `latents` after the launch returns. So every input is copied here, and a GPU
    copy finished: a DLPack view would read freed memory — on the host too, where an input lives in the stub's
    shared-memory region, which the model's own responses reuse (a GPU tensor larger than Triton's CUDA pool
    crosses there: Nano's `text_kv`, BENCHMARKS.md 14th/15th sessions; `serve.cuda_pool_bytes` sizes the pool so
    that it does not)."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    value = torch.utils.dlpack.from_dlpack(t.to_dlpack())
    if not value.is_cuda:
        return value.clone()
    # on a stream of its own: a sync of the default stream would wait for the engine's tick or the decoder's last
    # chunk, which run there
    copier = _COPY_STREAMS.get(value.device)
    if copier is None:
        copier = _COPY_STREAMS[value.device] = torch.cuda.Stream(value.device)
    with torch.cuda.stream(copier):
        owned = value.clone()
    copier.synchronize()
    owned.record_stream(torch.cuda.default_stream(value.device))  # read there: its block waits for those reads
    return owned


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # input_torch's, one per device


def output(name: str, value: torch.Tensor | np.ndarray) -> Any:
    """CUDA tensors cross by DLPack (bf16 included); CPU ones as numpy (DLPack rejects empty tensors' strides)."""
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            return pb_utils.Tensor.from_dlpack(name, to_dlpack(value.contiguous()))
        value = value.numpy()
    return pb_utils.Tensor(name, np.ascontiguousarray(value))


def text_output(name: str, text: str) -> Any:
    return pb_utils.Tensor(name, np.array([text.encode()], dtype=np.object_))


def error_response(message: str):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))


def log_exception(where: str, e: BaseException) -> str:
    pb_utils.Logger.log_error(f"{where}: {e}\n{traceback.format_exc()}")
    return f"internal error in {where}: {type(e).__name__}: {e}"


class Responder:
    """The one send path of both decoupled models: a thread that runs each item's `build` (it may wait, e.g. for
    a chunk's frames on the host) and sends what it returns (None: FINAL with no response). A failed build sends
    an error, final; a final response that cannot be sent is followed by an error, final, so the ensemble request
    never stays in flight.
    `maxsize` bounds how far producers run ahead of the sends."""

    def __init__(self, device: str | None = None, maxsize: int = 0):
        self.device = device
        self.queue: queue.Queue = queue.Queue(maxsize)
        self.thread = threading.Thread(target=self._run, name="cosmos3-send", daemon=True)
        self.thread.start()

    def send(self, sender: Any, build: Callable[[], Any], final: bool) -> None:
        self.queue.put((sender, build, final))

    def _run(self) -> None:
        if self.device is not None:
            use_device(self.device)
        while (item := self.queue.get()) is not None:
            sender, build, final = item
            try:
                response = build()
            except Exception as e:  # noqa: BLE001 - one failed response never stops the others
                response, final = error_response(log_exception("cosmos3 response", e)), True
            try:
                if response is None:  # nothing to say, only that this step is done with the request
                    sender.send(flags=FINAL)
                else:
                    sender.send(response, flags=FINAL if final else 0)
            except Exception as e:  # noqa: BLE001 - a client that went away must not stop the others
                message = log_exception("cosmos3 send", e)
                if final:
                    try:
                        sender.send(error_response(message), flags=FINAL)
                    except Exception:  # noqa: BLE001, S110 - the request is already gone
                        pass

    def close(self, timeout: float) -> None:
        self.queue.put(None)
        self.thread.join(timeout)


class TritonSink:
    """Engine events of one request → responses through the responder. The first event releases the request's
    admission ticket: it no longer waits (admission.py). A request the engine ends early (cancelled, failed,
    rejected) is counted here; a finished one by decode (outcomes.py)."""

    def __init__(
        self,
        request: Any,
        responder: Responder,
        meta: RequestMeta | None,
        marks: CancelMarks,
        tickets: Tickets | None = None,
        outcomes: Outcomes | None = None,
    ):
        """`outcomes`: the engine's counters of how requests ended (None: uncounted)."""
        self.request = request
        self.sender = request.get_response_sender()
        self.responder = responder
        self.meta = meta
        self.marks = marks
        self.tickets = tickets if meta is not None else None
        self.outcomes = outcomes
        self.t_arrive = time.time()  # reached the denoise model (epoch s, as meta.t0)
        self.cancel_seen = False

    def _send(
        self,
        latents: torch.Tensor | np.ndarray,
        event: Event,
        final: bool,
        sound: Any = EMPTY_SOUND,
        actions: Any = EMPTY_ACTIONS,
        as_error: str | None = None,
    ) -> None:
        """`as_error`: send this Triton error instead of the event."""
        if self.tickets is not None:
            self.tickets.release(self.meta.id)
            self.tickets = None
        if as_error is not None:
            self.responder.send(self.sender, lambda: error_response(as_error), final)
            return
        self.responder.send(self.sender, lambda: latents_response(latents, event, sound, actions), final)

    def accepted(self) -> None:
        """Before the engine may send anything: vae_decode holds this step (wire.AcceptedEvent). Not the request's
        first word: it still waits, its ticket is kept."""
        event: AcceptedEvent = {"type": "accepted", "id": self.meta.id}
        self.responder.send(self.sender, lambda: latents_response(EMPTY_LATENTS, event), final=False)

    def progress(self, step: int, steps: int, window: int, windows: int) -> None:
        self._send(EMPTY_LATENTS, self.meta.progress(step, steps, window, windows), final=False)

    def chunk(self, latents: torch.Tensor, info: ChunkInfo) -> None:
        self._send(latents.float().cpu(), self.meta.chunk(info, final=False), final=False)

    def done(
        self,
        latents: torch.Tensor,
        info: ChunkInfo,
        sound: torch.Tensor | None = None,
        actions: torch.Tensor | None = None,
    ) -> None:
        # sound latents [sound_dim, T_s] and actions [chunk, D] ride with done, as does the last chunk
        s = EMPTY_SOUND if sound is None else sound.float().cpu()
        a = EMPTY_ACTIONS if actions is None else actions.float().cpu()
        # arrival → here, less prefill's own time: prefill's Triton queue and the hand-off of its outputs
        info["timings"]["to_denoise_s"] = self.t_arrive - self.meta.t0 - self.meta.prefill_s
        self._send(latents.float().cpu(), self.meta.chunk(info, final=True), True, s, a)
        self._forget()

    def error(self, message: str, outcome: str | None = None) -> None:
        """Sent as data, an `error` event in a normal FINAL response, never as a Triton error: the decode step of
        this request may still be in flight (see cancel.py). Counted as `outcome` (the owner's rejections), else
        cancelled when `cancelled()` said so, else failed; not at all when decode counted it (outcomes.py)."""
        event: ErrorEvent = {"type": "error", "id": self.meta.id if self.meta else "", "message": message}
        if self.outcomes is not None and not (self.meta and decode_failures(self.marks).is_marked(self.meta.id)):
            self.outcomes.count(outcome or ("cancelled" if self.cancel_seen else "failed"))
        # while vae_decode is down the event's decode step would reach the dead instance, which Triton answers in its
        # own words, a second later: say it here (the request's decode step died with the instance: it is lost anyway)
        direct = message if self.marks.is_marked(down_mark("vae_decode")) else None
        self._send(EMPTY_LATENTS, event, final=True, as_error=direct)
        self._forget()

    def cancelled(self) -> bool:
        if self.request.is_cancelled() or (self.meta is not None and self.marks.is_marked(self.meta.id)):
            self.cancel_seen = True  # the engine ends the request now, as cancelled
        return self.cancel_seen

    def _forget(self) -> None:
        if self.meta is not None:
            self.marks.clear(self.meta.id)


def latents_response(
    latents: torch.Tensor | np.ndarray, event: Event, sound: Any = EMPTY_SOUND, actions: Any = EMPTY_ACTIONS
) -> Any:
    return pb_utils.InferenceResponse(
        output_tensors=[output("latents", latents), text_output("event", encode_event(event)),
                        output("sound_latents", sound), output("actions", actions)]
    )  # fmt: skip


def video_response(
    video: np.ndarray, event: Event, audio: np.ndarray = EMPTY_SOUND, actions: np.ndarray = EMPTY_ACTIONS
) -> Any:
    return pb_utils.InferenceResponse(
        output_tensors=[output("video", video), text_output("event_out", encode_event(event)), output("audio", audio),
                        output("actions_out", actions)]
    )  # fmt: skip


def down_refusal(marks: CancelMarks) -> str | None:
    """A new request's refusal while a later part is down: until its reload is done, Triton sends it to the dead
    instance (the supervisor marks the part, errors.py)."""
    return next((part_restarting(p) for p in ("denoise", "vae_decode") if marks.is_marked(down_mark(p))), None)


def to_decode_s(done: ChunkEvent) -> float:
    """The engine's done → its decode starting now: the latents' hand-off and the decode loop's queue (earlier
    pieces). The engine ended it `queue_s + denoise_s` after it reached the denoise model, `prefill_s +
    to_denoise_s` after arrival (`t0`), so the parts and this add up to the time since arrival."""
    t = done["timings"]
    return time.time() - done["t0"] - sum(t.get(k, 0.0) for k in ("prefill_s", "to_denoise_s", "queue_s", "denoise_s"))


class DecodeLoop:
    """vae_decode's thread: takes requests in arrival order, launches each chunk's decode on the GPU and hands it
    to the responder, which waits for its frames on the host and sends them while the GPU decodes the next one.
    A cancelled request marks its id for the engine (cancel.py) and drops its decoder cache. It counts the requests
    that end here: completed, a piece that did not decode, a client gone after the engine's last step (outcomes.py).

    A stream's latest step keeps its FINAL back until the stream's next event (from the engine's `accepted`, which
    is answered with nothing, then each progress or mid-stream chunk): while denoise holds a request, this process
    holds one of its steps too, so that when the denoise stub dies (the
    supervisor marks it down) the request still gets an error, from here. Triton 2.51 answers nothing for a dead
    decoupled stub's requests."""

    def __init__(self, stage: DecodeStage, marks: CancelMarks, metrics: DecodeMetrics, device: str):
        self.stage, self.marks, self.metrics, self.device = stage, marks, metrics, device
        # at most 2 chunks launched ahead of the sends: little pinned host memory held
        self.responder = Responder(device, maxsize=2)
        self.inbox: queue.Queue = queue.Queue()
        self.failed: dict[str, str] = {}  # stream id → why its chunk failed, reported with the engine's end of it
        self.held: dict[str, Any] = {}  # stream id → the sender of its latest pass-through step, FINAL held back
        self.denoise_down = False
        self.thread = threading.Thread(target=self._run, name="cosmos3-decode", daemon=True)
        self.thread.start()

    def put(self, request: Any) -> None:
        self.inbox.put((request, request.get_response_sender()))

    def _run(self) -> None:
        use_device(self.device)
        while (item := self._next()) is not None:
            request, sender = item
            try:
                stream = decode_event(input_array(request, "event").reshape(-1)[0])
            except Exception:  # noqa: BLE001 - `_launch` answers it
                stream = None
            if stream is not None and (held := self.held.pop(stream["id"], None)) is not None:
                self.responder.send(held, lambda: None, final=True)  # its previous step is done now
            if stream is not None and stream["type"] == "accepted":  # held, answered with nothing
                self.held[stream["id"]] = sender
                continue
            build = self._launch(request)
            keep = stream is not None and stream["type"] in ("progress", "chunk") and stream["id"] not in self.failed
            keep = keep and not request.is_cancelled()
            self.responder.send(sender, build, final=not keep)
            if keep:
                self.held[stream["id"]] = sender

    def _next(self) -> Any:
        """The next request; meanwhile (and before each) the streams held for a dead denoise get its error."""
        while True:
            self._check_denoise()
            try:
                return self.inbox.get(timeout=0.2)
            except queue.Empty:
                pass

    def _check_denoise(self) -> None:
        down = self.marks.is_marked(down_mark("denoise"))
        if down and not self.denoise_down:  # every stream held now was the dead instance's
            for stream, sender in self.held.items():
                self.responder.send(sender, lambda: error_response(part_died("denoise")), final=True)
                self._forget(stream)
                self.metrics.outcomes.count_now("failed")  # its engine, which would have counted it, is gone
            self.held.clear()
        self.denoise_down = down

    def _launch(self, request: Any) -> Callable[[], Any]:
        try:
            event = decode_event(input_array(request, "event").reshape(-1)[0])
        except Exception as e:  # noqa: BLE001
            message = log_exception("cosmos3_vae_decode", e)
            return lambda: error_response(message)
        if event["type"] == "error":  # the engine's last word on this request: the error the client sees
            self._forget(event["id"])
            return lambda: error_response(self._first_failure(event["id"]) or event["message"])
        if request.is_cancelled():  # the client cancelled: tell the engine, answer nothing (see cancel.py)
            if event["type"] != "done":
                self.marks.mark(event["id"])
            elif self._first_failure(event["id"]) is None:  # after the engine's last step, which counted nothing
                self.metrics.outcomes.count_now("cancelled")
            self._forget(event["id"])
            return lambda: None
        try:
            latents = input_torch(request, "latents")
            if not latents.numel():  # a progress event passes through
                return lambda: video_response(EMPTY_VIDEO, event)
            if faults.CHECK_FINITE:
                faults.report_nonfinite("decode input", f"{event['id']} ({event['type']})", latents=latents)
            sound = input_torch(request, "sound_latents")
            # passed through (on the host): FP32 [chunk, D] on an action request's done, else [0, 0]
            actions = input_torch(request, "actions").cpu().numpy()
            if event["type"] == "done":
                event["timings"]["to_decode_s"] = to_decode_s(event)
            finish = self.stage.launch(event, latents, sound if sound.numel() else None)
        except Exception as e:  # noqa: BLE001
            return self._failed(event, e)

        def build(_inputs: Any = (request, latents)) -> Any:  # the inputs outlive the GPU work that reads them
            try:
                video, out, audio = finish()
            except Exception as e:  # noqa: BLE001
                return self._failed(event, e)()
            out["timings"].update(self.metrics.frames_out(out))
            del out["t0"]
            if out["type"] == "done":
                self.metrics.outcomes.count_now("completed")
            return video_response(video, out, audio, actions)

        return build

    def _failed(self, event: ChunkEvent, e: Exception) -> Callable[[], Any]:
        """A chunk that failed to decode. After `done` (the request's last step) the error goes out now; before
        it the engine still runs the request, so it is ended there and its error event carries this message."""
        # the guardrail's refusal (a RequestError) is the client's error as it stands, never an internal one
        message = str(e) if isinstance(e, RequestError) else log_exception("cosmos3_vae_decode", e)
        outcome = "refused" if isinstance(e, RequestError) else "failed"
        if event["type"] == "done":
            first = self._first_failure(event["id"])  # the first failure of the stream, if there was one
            if first is None:
                self.metrics.outcomes.count_now(outcome)
            return lambda: error_response(first or message)
        if event["id"] not in self.failed:  # counted here, once; the engine, seeing why it is marked, counts nothing
            self.failed[event["id"]] = message
            decode_failures(self.marks).mark(event["id"])
            self.metrics.outcomes.count_now(outcome)
        self.marks.mark(event["id"])
        return lambda: None

    def _first_failure(self, stream_id: str) -> str | None:
        """The message of the stream's piece that failed to decode (already counted), forgotten now; None if none."""
        decode_failures(self.marks).clear(stream_id)
        return self.failed.pop(stream_id, None)

    def _forget(self, stream_id: str) -> None:
        self.stage.drop(stream_id)
        self.metrics.forget(stream_id)

    def close(self, timeout: float) -> None:
        self.inbox.put(None)
        self.thread.join(timeout)
        for sender in self.held.values():
            self.responder.send(sender, lambda: None, final=True)
        self.responder.close(timeout)


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

    def publish(self) -> None:
        e, stats = self.engine, self.engine.stats
        with self._lock:
            values = {"pages_used": e.pool.pages_used, "pages_free": e.pool.pages_free, "num_waiting": e.num_waiting,
                      "num_live": e.num_live, "max_requests_in_tick": stats.max_requests_in_tick,
                      "rows_last_tick": stats.rows_last_tick}  # fmt: skip
            for k, metric in self.gauges.items():
                metric.set(values[k])
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

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        self.publish()


class RefusalMetric:
    """Prefill's share of `cosmos3_requests_total`: prompts the guardrail refused (outcome "refused"). The same
    family (name, description, kind) as the engine's, which the server merges into one."""

    def __init__(self, labels: dict[str, str]):
        self._family = pb_utils.MetricFamily(
            name="cosmos3_requests_total", description="Requests ended, by outcome", kind=pb_utils.MetricFamily.COUNTER
        )
        self._metric = self._family.Metric(labels={**labels, "outcome": "refused"})

    def refused(self) -> None:
        self._metric.increment(1)


class DecodeMetrics:
    """Latency histograms measured where frames leave the server (after decode): time to first chunk (the
    whole video for single-shot requests), gaps between an AR stream's chunks, end-to-end time."""

    BUCKETS = [0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512]

    def __init__(self, labels: dict[str, str]):
        H = pb_utils.MetricFamily.HISTOGRAM
        self._families = [
            pb_utils.MetricFamily(name=n, description=d, kind=H)
            for n, d in (
                ("cosmos3_ttfc_seconds", "Request arrival to its first frames out"),
                ("cosmos3_chunk_gap_seconds", "Between consecutive chunks of one AR stream"),
                ("cosmos3_e2e_seconds", "Request arrival to its last frames out"),
            )
        ]
        self.ttfc, self.gap, self.e2e = (f.Metric(labels=labels, buckets=self.BUCKETS) for f in self._families)
        self.outcomes = Outcomes(labels, AT_DECODE)  # how requests ended here (outcomes.py)
        self.last_chunk: dict[str, float] = {}  # stream id → when its previous chunk left

    def frames_out(self, event: ChunkEvent) -> dict[str, float]:
        """Record a chunk/done event leaving; returns the timings to add to it."""
        now = time.time()
        prev = self.last_chunk.pop(event["id"], None)
        timings: dict[str, float] = {}
        if prev is None:
            timings["ttfc_s"] = now - event["t0"]
            self.ttfc.observe(timings["ttfc_s"])
        else:
            timings["chunk_gap_s"] = now - prev
            self.gap.observe(timings["chunk_gap_s"])
        if event["type"] == "done":
            timings["server_e2e_s"] = now - event["t0"]
            self.e2e.observe(timings["server_e2e_s"])
        else:
            self.last_chunk[event["id"]] = now
        return timings

    def forget(self, stream_id: str) -> None:
        self.last_chunk.pop(stream_id, None)


class EngineThread:
    """Runs `engine.tick()` until stopped; a failing tick fails the requests in it, never the thread."""

    def __init__(
        self,
        engine: DenoiseEngine,
        marks: CancelMarks,
        drain_timeout_s: float,
        on_broken: Callable[[], None] | None = None,
    ):
        """`on_broken`: called after an `EngineBroken` ended every request and before the process exits (the model
        flushes its responses and metrics there: an exit drops what is still queued)."""
        self.engine, self.marks, self.drain_timeout_s = engine, marks, drain_timeout_s
        self.on_broken = on_broken
        self.drain_since: float | None = None
        self.decode_down = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cosmos3-engine", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        use_device(self.engine.device)
        while not self.stop.is_set():
            self.engine.wait_for_work(0.05)
            self._check_drain()
            self._check_decode()
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

    def _check_drain(self) -> None:
        """Draining: admit nothing new; requests still live after the drain timeout end with one error each."""
        if self.drain_since is None:
            if self.marks.is_draining():
                self.drain_since = time.monotonic()
                self.engine.scheduler.draining = True
        elif time.monotonic() - self.drain_since > self.drain_timeout_s and self.engine.has_work():
            self.engine.abort_all(drain_timeout(self.drain_timeout_s))

    def _check_decode(self) -> None:
        """vae_decode's stub died: every request here would send its next event to the dead instance (an ensemble
        request keeps the models it started with), so end them now rather than denoise them for nothing."""
        down = self.marks.is_marked(down_mark("vae_decode"))
        if down and not self.decode_down and self.engine.has_work():
            self.engine.abort_all(part_died("vae_decode"))
        self.decode_down = down

    def close(self, timeout: float) -> None:
        self.stop.set()
        self.engine.wake()
        self.thread.join(timeout)
        self.engine.abort_all(part_stopped("denoise"))
