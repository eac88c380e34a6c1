"""The Triton Python models of the repository: each `model_repository/<name>/1/model.py` is a shim whose
`TritonPythonModel.initialize` imports this module and builds one of these, then forwards `execute` / `finalize`.

Why the shim imports here and not at its top: Triton's Python backend first loads every model.py in a stub process
of its own to auto-complete the model config, then again in the instance's stub. Top-level imports of torch and
this package made that first stub cost ~12 s of every server start (on the critical path of the cold start).

- `PrefillModel` (cosmos3_prefill): validate the request, tokenize, run the understanding tower once, VAE-encode an
  i2v image, the v2v clip's conditioning frames or an action request's anchor frame (inverse dynamics: its clip);
  over `stages.PrefillStage`. What it sends on is typed in `wire.py`.
- `DenoiseModel` (cosmos3_denoise, decoupled): hands each request to the denoise engine and returns at once; the
  engine thread packs every live request into one GEN forward per tick, the response thread sends progress events
  and, in the final response, the finished latents (threads and metrics: glue.py).
- `DecodeModel` (cosmos3_vae_decode, decoupled, one response per request): latents → uint8 frames; progress events
  pass through with an empty video. `execute` only queues; the decode loop (`glue.DecodeLoop`) launches each chunk
  on the GPU in arrival order and its responder waits for the chunk's frames on the host and sends them, while the
  GPU decodes the next chunk.
"""

import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from .. import faults
from ..engine import DenoiseEngine, QueueFull
from ..model.checkpoint import Checkpoint
from ..requests import RequestError, parse_parameters_json, validate, warmup_inputs
from ..safety import Refused
from ..sampling import checkpoint_shift
from ..stages import DecodeStage, PrefillStage
from ..wire import PrefillResult, RequestMeta
from .admission import Ticket, Tickets, tickets_dir
from .cancel import CancelMarks
from .glue import (
    DecodeLoop,
    DecodeMetrics,
    EngineMetrics,
    EngineThread,
    RefusalMetric,
    Responder,
    TritonSink,
    deployment_from_args,
    down_refusal,
    error_response,
    input_array,
    input_torch,
    log_exception,
    output,
    text_output,
)
from .outcomes import AT_PREFILL, Outcomes


class PrefillModel:
    """`cosmos3_prefill`'s model.py, as its `TritonPythonModel` calls it."""

    def __init__(self, args):
        t0 = time.perf_counter()
        d, device = deployment_from_args(args)
        self.stage = PrefillStage.from_deployment(d.open_checkpoint(), d, device)  # with its text guardrail
        self.refusals = RefusalMetric({"model": args["model_name"], "instance": args["model_instance_name"]})
        self.tickets = Tickets(tickets_dir(d.cancel_dir))
        self.marks = CancelMarks(d.cancel_dir)  # a later part marked down by the supervisor (glue.down_refusal)
        # how requests ended here: one count each, the only one (outcomes.py)
        self.outcomes = Outcomes({"model": args["model_name"], "instance": args["model_instance_name"]}, AT_PREFILL)
        pb_utils.Logger.log_info(f"cosmos3_prefill: ready in {time.perf_counter() - t0:.1f}s")  # startup's parts

    def execute(self, requests):
        return [self._one(r) for r in requests]

    def _one(self, request):
        raw = input_array(request, "ticket")  # the door's; absent when prefill is called on its own
        try:
            ticket = Ticket(uuid.uuid4().hex, time.time()) if raw is None else Ticket.decode(raw.reshape(-1)[0])
        except (ValueError, IndexError) as e:
            self.outcomes.count_now("bad_input")
            return error_response(f"ticket: the door's '<id> <arrival>' ({e})")
        response = self._run(request, ticket)
        if response.has_error():  # the request ends here: it no longer waits (admission.py)
            self.tickets.release(ticket.id)
        return response

    def _run(self, request, ticket: Ticket):
        t_start = time.time()
        if (why := down_refusal(self.marks)) is not None:
            self.outcomes.count_now("rejected")
            return error_response(why)
        try:
            prompt = input_array(request, "prompt")
            if prompt is None or prompt.size != 1:
                raise RequestError("prompt", "expected exactly one string")
            raw_params = input_array(request, "parameters")
            if raw_params is not None and raw_params.size != 1:
                raise RequestError("parameters", "expected exactly one JSON string")
            params = parse_parameters_json(None if raw_params is None else raw_params.reshape(-1)[0])
            image, video = input_array(request, "image"), input_array(request, "condition_video")
            raw_actions = input_array(request, "raw_actions")
            p = self.stage.validate(prompt.reshape(-1)[0], params, image, video, raw_actions)
            wire = self.stage.run(p, image, video, raw_actions).to_wire()
            if faults.CHECK_FINITE:
                faults.report_nonfinite("prefill output", f"{ticket.id} seed {p.seed}", text_kv=wire["text_kv"],
                                        cond_latent=wire["cond_latent"])  # fmt: skip
        except Refused as e:  # the guardrail's: counted, and its text names the guardrail, not the prompt
            self.refusals.refused()
            return error_response(str(e))
        except RequestError as e:
            self.outcomes.count_now("bad_input")
            return error_response(str(e))
        except Exception as e:  # noqa: BLE001 - one bad request never takes the instance down
            self.outcomes.count_now("failed")
            return error_response(log_exception("cosmos3_prefill", e))
        meta = RequestMeta(ticket.id, p, ticket.t0, time.time() - t_start)  # t0: arrival at the door
        outs = [output(name, value) for name, value in wire.items()] + [text_output("request", meta.encode())]
        return pb_utils.InferenceResponse(output_tensors=outs)


class DenoiseModel:
    """`cosmos3_denoise`'s model.py, as its `TritonPythonModel` calls it."""

    def __init__(self, args):
        t0 = time.perf_counter()
        d, device = deployment_from_args(args)
        ckpt = d.open_checkpoint()
        self.engine = DenoiseEngine.from_deployment(ckpt, d, device)
        pb_utils.Logger.log_info(f"cosmos3_denoise: engine built in {time.perf_counter() - t0:.1f}s")  # startup's parts
        cfg, shift = ckpt.config, checkpoint_shift(ckpt.scheduler_config)
        sizes = (d.defaults, d.limits, cfg.pixel_alignment, cfg.vae_scale_temporal, shift)
        warmup = []
        for r in d.warmup_requests:  # an action request: a blank image (clip) at the default size (warmup_inputs)
            image, video, raw = warmup_inputs(r, d.defaults)
            warmup.append(validate("warmup", r, image, *sizes, video, raw))
        took = self.engine.warmup(warmup)
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in self.engine.warmup_parts.items())
        pb_utils.Logger.log_info(f"cosmos3_denoise: warmup of {len(warmup)} shapes took {took:.1f}s ({parts})")
        self.metrics = EngineMetrics(
            self.engine, {"model": args["model_name"], "instance": args["model_instance_name"]}
        )
        self.marks = CancelMarks(d.cancel_dir)
        self.tickets = Tickets(tickets_dir(d.cancel_dir))
        self.tickets.clear("engine")  # a previous incarnation's waiting requests are never answered (admission.py)
        self.responder = Responder(device)
        self.engine_thread = EngineThread(self.engine, self.marks, d.drain_timeout_s, self._flush)
        self.host_kv_warned = not str(device).startswith("cuda")  # said once: K/V that crossed through the host

    def execute(self, requests):
        for request in requests:
            sink = None
            try:
                meta = RequestMeta.decode(input_array(request, "request").reshape(-1)[0])
                self.tickets.claim(meta.id)
                sink = TritonSink(request, self.responder, meta, self.marks, self.tickets, self.metrics.outcomes)
                text_kv, cond = input_torch(request, "text_kv"), input_torch(request, "cond_latent")
                if not text_kv.is_cuda and not self.host_kv_warned:
                    self.host_kv_warned = True
                    pb_utils.Logger.log_warn(
                        f"cosmos3_denoise: a {text_kv.nbytes >> 20} MiB text_kv crossed through host memory (Triton's "
                        "CUDA pool was full or too small: slower; raise --cuda-memory-pool-byte-size, docs/gpu.md)"
                    )
                if faults.CHECK_FINITE:  # how the K/V crossed (on the device, or on the host: a pool too small)
                    faults.say(
                        "wire", f"text_kv {tuple(text_kv.shape)} reaches the denoise model on {text_kv.device}", 1
                    )
                    faults.report_nonfinite("denoise input", f"{meta.id} seed {meta.params.seed} ({text_kv.device})",
                                            text_kv=text_kv, cond_latent=cond)  # fmt: skip
                result = PrefillResult.from_wire(
                    meta.params,
                    text_kv,
                    input_array(request, "text_lens").astype(np.int64),
                    cond,
                    input_torch(request, "cond_actions"),
                )
                sink.accepted()  # before the engine may send: vae_decode holds a step of it from now on
                self.engine.submit(result, sink)
            except QueueFull as e:
                self._reject(request, sink, str(e), "rejected")
            except RequestError as e:  # what only the engine checks (e.g. the pool's size)
                self._reject(request, sink, str(e), "bad_input")
            except Exception as e:  # noqa: BLE001
                self._reject(request, sink, log_exception("cosmos3_denoise", e), "failed")
        return None

    def _reject(self, request, sink, message, outcome):
        sink = sink or TritonSink(request, self.responder, None, self.marks, outcomes=self.metrics.outcomes)
        sink.error(message, outcome)

    def _flush(self) -> None:
        """The engine is broken and the process exits next: send what is queued (each request's error), publish."""
        self.metrics.close()
        self.responder.close(timeout=5)

    def finalize(self):
        self.engine_thread.close(timeout=30)
        self.metrics.close()
        self.responder.close(timeout=30)


class DecodeModel:
    """`cosmos3_vae_decode`'s model.py, as its `TritonPythonModel` calls it."""

    def __init__(self, args):
        t0 = time.perf_counter()
        d, device = deployment_from_args(args)
        stage = DecodeStage.from_deployment(Checkpoint.open(d.checkpoint), d, device)  # parallel.vae: over a group
        metrics = DecodeMetrics({"model": args["model_name"], "instance": args["model_instance_name"]})
        self.loop = DecodeLoop(stage, CancelMarks(d.cancel_dir), metrics, device)
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in stage.startup.items())
        pb_utils.Logger.log_info(f"cosmos3_vae_decode: ready in {time.perf_counter() - t0:.1f}s ({parts})")

    def execute(self, requests):
        for request in requests:
            self.loop.put(request)
        return None

    def finalize(self):
        self.loop.close(timeout=30)
