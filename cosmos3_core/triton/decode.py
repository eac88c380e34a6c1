"""`cosmos3_vae_decode` (decoupled, one instance), its stub process: `DecodeModel` queues each step; `DecodeLoop`
launches each piece's decode in arrival order and hands it to the responder, which waits for its frames on the host
and sends them while the next piece decodes. What each step of a stream is answered with, whether its FINAL is held
back, and which outcome is counted: lifecycle.py (this file only executes it). `DecodeMetrics`: the latency
histograms measured where frames leave the server.

Only imported inside a Triton Python stub.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import triton_python_backend_utils as pb_utils

from .. import faults
from ..model.checkpoint import Checkpoint
from ..requests import RequestError
from ..sessions import record_live
from ..stages import DecodeStage
from ..wire import ChunkEvent, decode_event
from . import lifecycle
from .gpu_memory import GpuMemoryMetric
from .io import (
    EMPTY_VIDEO,
    FINAL,
    Responder,
    deployment_from_args,
    error_response,
    imports_s,
    input_array,
    input_torch,
    log_exception,
    process_age_s,
    video_response,
)
from .outcomes import AT_DECODE, Outcomes
from .state import ServerState


def to_decode_s(done: ChunkEvent) -> float:
    """The engine's done → its decode starting now: the latents' hand-off and the decode loop's queue (earlier
    pieces). The engine ended it `queue_s + denoise_s` after it reached the denoise model, `prefill_s +
    to_denoise_s` after arrival (`t0`), so the parts and this add up to the time since arrival."""
    t = done["timings"]
    return time.time() - done["t0"] - sum(t.get(k, 0.0) for k in ("prefill_s", "to_denoise_s", "queue_s", "denoise_s"))


class DecodeLoop:
    """vae_decode's threads. `put` (Triton's execute thread) reads each step's event and sees a cancel at once, so
    that the piece decoding now is the stream's last; it answers a `poll` at once, and a stream's last step (`end`, or
    the engine's `error` event) too, once every earlier step of that stream is answered: inside `execute`, so that a
    vae_decode dying then leaves the step to Triton, which answers it. The loop thread answers the other steps in
    order as `lifecycle.decode_step` says, holding each stream's latest step (a step of a dead denoise's stream that
    comes late: `lifecycle.denoise_died`); the watcher answers a dead denoise's streams on those held steps within a
    fraction of a second, whatever piece the loop is decoding."""

    WATCH_S = 0.1
    LAST_WAIT_S = 120.0  # the most a last step waits in `execute` for the stream's earlier steps (their pieces)

    def __init__(self, stage: DecodeStage, state: ServerState, metrics: DecodeMetrics, device: str):
        self.stage, self.state, self.metrics, self.device = stage, state, metrics, device
        # at most 2 pieces launched ahead of the sends: little pinned host memory held
        self.responder = Responder(device, maxsize=2)
        self.inbox: queue.Queue = queue.Queue()
        self.streams: dict[str, lifecycle.DecodeStream] = {}
        self.held: dict[str, Any] = {}  # stream id → the sender of its latest step, FINAL held back
        self.pending: dict[str, int] = {}  # stream id → its steps in the inbox or the responder, not yet answered
        self.lock = threading.Lock()  # streams, held and pending: the four threads
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cosmos3-decode", daemon=True)
        self.thread.start()
        self.watcher = threading.Thread(target=self._watch, name="cosmos3-decode-watch", daemon=True)
        self.watcher.start()

    def put(self, request: Any) -> None:
        try:
            event = decode_event(input_array(request, "event").reshape(-1)[0])
        except Exception as e:  # noqa: BLE001 - answered by the loop, in order
            event = {"type": "error", "id": "", "message": log_exception("cosmos3_vae_decode", e)}
        ident, kind = event["id"], event["type"]
        if request.is_cancelled():  # seen now, not after the pieces queued ahead of this step
            with self.lock:
                s = self.streams.get(ident)
                do = lifecycle.decode_cancelled(s) if s is not None else None
            if do is not None and do.stop:
                self.state.stop(ident, do.stop)
        if kind == "poll" or (kind in lifecycle.LAST_EVENTS and ident):
            return self._answer_now(request, event)
        with self.lock:
            self.pending[ident] = self.pending.get(ident, 0) + 1
        self.inbox.put((request, event))

    def _answer_now(self, request: Any, event: dict) -> None:
        """A poll, or a stream's last step: answered here, in `execute` (the last one once the stream's earlier steps
        are answered: its frames out)."""
        ident, kind = event["id"], event["type"]
        if kind in lifecycle.LAST_EVENTS:
            deadline = time.monotonic() + self.LAST_WAIT_S
            while self.pending.get(ident, 0) and time.monotonic() < deadline:
                time.sleep(0.005)
        died = self.state.died_at("denoise")
        with self.lock:
            s = self.streams.get(ident)
            if s is not None and kind == "poll" and lifecycle.gone(s.t0, died):
                do = lifecycle.denoise_died(s)
            else:  # a last step came with denoise's FINAL: the stream no longer needs denoise
                do = lifecycle.decode_step(s, kind, request.is_cancelled(), event.get("message", ""))
            previous = self.held.pop(ident, None) if do.forget else None
            if do.forget:
                self.streams.pop(ident, None)
                self.pending.pop(ident, None)
        if previous is not None:
            _final(previous, None)
        _final(request.get_response_sender(), do)
        self._apply(ident, s, do)

    def _run(self) -> None:
        while (item := self.inbox.get()) is not None:
            request, event = item
            ident, kind, sender = event["id"], event["type"], request.get_response_sender()
            died = self.state.died_at("denoise")
            with self.lock:
                if kind == "accepted":
                    self.streams.setdefault(ident, lifecycle.DecodeStream(t0=event.get("t0", 0.0)))
                s = self.streams.get(ident)
                if s is not None and lifecycle.gone(s.t0, died):  # a step of a dead denoise's stream, come late
                    do = lifecycle.denoise_died(s)
                else:
                    do = lifecycle.decode_step(s, kind, request.is_cancelled(), event.get("message", ""))
                previous = self.held.pop(ident, None)
                if not do.final:
                    self.held[ident] = sender
            if previous is not None:
                self.responder.send(previous, lambda: None, final=True)  # its previous step is done now
            self._apply(ident, s, do)
            if do.send == "frames":
                build = self._launch(request, event, s)
            elif do.send == "error":
                build = lambda m=do.message: error_response(m)  # noqa: E731
            else:
                build = lambda: None  # noqa: E731
            self.responder.send(sender, build, final=do.final, after=lambda i=ident, f=do.finish: self._sent(i, f))

    def _sent(self, ident: str, finish: bool) -> None:
        """A step's response is out: the stream's last piece's frames (`finish`: denoise may send its `end` now)."""
        if finish:
            self.state.finish(ident)
        with self.lock:
            left = self.pending.get(ident, 1) - 1
            if left > 0:
                self.pending[ident] = left
            else:
                self.pending.pop(ident, None)

    def _apply(self, ident: str, s: lifecycle.DecodeStream | None, do: lifecycle.Do) -> None:
        """The facts and counts of a `Do` (its sends are the caller's)."""
        if do.stop:
            self.state.stop(ident, do.stop)
        if do.count:
            self.metrics.outcomes.count_now(do.count)
        if do.forget:
            with self.lock:
                self.streams.pop(ident, None)
            self.stage.drop(ident)
            self.metrics.forget(ident)
            self.state.forget(ident)

    def _watch(self) -> None:
        """A dead denoise: the streams held now that arrived before its death were its instance's (vae_decode is
        never reloaded with them); those whose steps come later are answered by the loop as they come."""
        while not self._stop.wait(self.WATCH_S):
            died = self.state.died_at("denoise")
            if died is None:
                continue
            with self.lock:
                dead = [i for i in self.held if lifecycle.gone(getattr(self.streams.get(i), "t0", 0.0), died)]
                held = {i: self.held.pop(i) for i in dead}
                # dropped here, under the lock: a step of the stream that the loop takes next finds nothing to answer
                dos = {i: lifecycle.denoise_died(self.streams.pop(i, None) or lifecycle.DecodeStream()) for i in held}
            for ident, sender in held.items():
                _final(sender, dos[ident])  # directly: the responder may be waiting seconds for a piece's frames
                self._apply(ident, None, dos[ident])

    def _launch(self, request: Any, event: ChunkEvent, s: lifecycle.DecodeStream) -> Callable[[], Any]:
        """Start decoding a piece (a progress event passes through) → the build that sends it."""
        ident = event["id"]
        try:
            latents = input_torch(request, "latents")
            if not latents.numel():  # a progress event passes through
                return lambda: video_response(EMPTY_VIDEO, event)
            if faults.CHECK_FINITE:
                faults.report_nonfinite("decode input", f"{ident} ({event['type']})", latents=latents)
            sound = input_torch(request, "sound_latents")
            # passed through (on the host): FP32 [chunk, D] on an action request's done, else [0, 0]
            actions = input_torch(request, "actions").cpu().numpy()
            if event["type"] == "done":
                event["timings"]["to_decode_s"] = to_decode_s(event)
            finish = self.stage.launch(event, latents, sound if sound.numel() else None)
        except Exception as e:  # noqa: BLE001
            return self._failed(s, ident, e)

        def build(_inputs: Any = (request, latents)) -> Any:  # the inputs outlive the GPU work that reads them
            try:
                video, out, audio = finish()
            except Exception as e:  # noqa: BLE001
                return self._failed(s, ident, e)()
            with self.lock:
                go = lifecycle.frames_go(s)
            if not go:  # cancelled (or an earlier piece failed) while this one decoded
                return None
            out["timings"].update(self.metrics.frames_out(out))
            del out["t0"]
            return video_response(video, out, audio, actions)

        return build

    def _failed(self, s: lifecycle.DecodeStream, ident: str, e: Exception) -> Callable[[], Any]:
        """A piece that did not decode: the stream ends with its text (lifecycle.decode_failed)."""
        # the guardrail's refusal (a RequestError) is the client's error as it stands, never an internal one
        message = str(e) if isinstance(e, RequestError) else log_exception("cosmos3_vae_decode", e)
        with self.lock:
            do = lifecycle.decode_failed(s, message, "refused" if isinstance(e, RequestError) else "failed")
        self._apply(ident, s, do)
        return lambda: None

    def close(self, timeout: float) -> None:
        self._stop.set()
        self.inbox.put(None)
        self.thread.join(timeout)
        for sender in self.held.values():
            self.responder.send(sender, lambda: None, final=True)
        self.responder.close(timeout)


class DecodeModel:
    """`cosmos3_vae_decode`'s model.py, as its `TritonPythonModel` calls it: `initialize` builds the decode stage,
    then its metrics and threads."""

    def __init__(self, args):
        t0, booted, imported = time.perf_counter(), process_age_s(), imports_s()
        d, device = deployment_from_args(args)
        state, instance = ServerState(d.state_dir), args["model_instance_name"]
        # parallel.vae: over a group; its memory warmup takes its turn among the parts'
        stage = DecodeStage.from_deployment(Checkpoint.open(d.checkpoint), d, device, turn=state.warmup_turn(),
                                            peak_warmup=state.proven_peak(instance) is None)  # fmt: skip
        state.prove_peak(instance)  # this instance's reloads skip the decoder's peak warmup
        stage.session_live = lambda ident: record_live(state.session(ident))  # an ended session's decoder goes
        metrics = DecodeMetrics({"model": args["model_name"], "instance": args["model_instance_name"]})
        labels = {"model": args["model_name"], "instance": args["model_instance_name"]}
        self.gpu_memory = GpuMemoryMetric(stage.plan, ("vae_decode",), labels)
        self.loop = DecodeLoop(stage, ServerState(d.state_dir), metrics, device)
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in stage.startup.items())
        pb_utils.Logger.log_info(f"cosmos3_vae_decode: ready in {time.perf_counter() - t0:.1f}s ({parts}; "
                                 f"process start to initialize {booted:.1f}s, its imports {imported:.1f}s)")  # fmt: skip

    def execute(self, requests):
        for request in requests:
            self.loop.put(request)
        self.gpu_memory.publish()
        return None

    def finalize(self):
        self.loop.close(timeout=30)


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


def _final(sender: Any, do: Any) -> None:
    """A held step's FINAL: the `lifecycle` decision's error, or empty (`do` None: empty). A sender whose request
    is already gone is logged, not raised."""
    try:
        if do is not None and do.send == "error":
            sender.send(error_response(do.message), flags=FINAL)
        else:
            sender.send(flags=FINAL)
    except Exception as e:  # noqa: BLE001 - the request is already gone
        log_exception("cosmos3_vae_decode", e)
