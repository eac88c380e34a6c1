"""`cosmos3_prefill`, its stub process: validate the request, tokenize, run the understanding tower once, VAE-encode an
i2v image, the v2v clip's conditioning frames or an action request's anchor frame (inverse dynamics: its clip); over
`stages.PrefillStage`. A session's continuation is checked against its session's record (state.py, sessions.py) and,
with its session's prompt, sends no text K/V. What it sends on is typed in wire.py. `RefusalMetric` counts the text guardrail's refusals.

Only imported inside a Triton Python stub.
"""

from __future__ import annotations

import time
import uuid

import triton_python_backend_utils as pb_utils

from .. import faults
from ..errors import DRAINING, part_restarting
from ..requests import RequestError, continued_session, parse_parameters_json
from ..safety import Refused
from ..sessions import kept_params
from ..stages import PrefillStage
from ..wire import RequestMeta
from .admission import Ticket
from .gpu_memory import GpuMemoryMetric
from .io import (
    deployment_from_args,
    error_response,
    imports_s,
    input_array,
    log_exception,
    output,
    process_age_s,
    text_output,
)
from .outcomes import AT_PREFILL, Outcomes
from .state import ServerState


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


class PrefillModel:
    """`cosmos3_prefill`'s model.py, as its `TritonPythonModel` calls it."""

    def __init__(self, args):
        t0, booted, imported = time.perf_counter(), process_age_s(), imports_s()
        d, device = deployment_from_args(args)
        self.state, instance = ServerState(d.state_dir), args["model_instance_name"]
        # with its text guardrail; its warmup takes its turn among the parts'
        self.stage = PrefillStage.from_deployment(
            d.open_checkpoint(), d, device, self.state.warmup_turn(), self.state.proven_peak(instance) is None
        )
        self.state.prove_peak(instance)  # this instance's reloads skip the encoder's peak warmup
        self.refusals = RefusalMetric({"model": args["model_name"], "instance": args["model_instance_name"]})
        labels = {"model": args["model_name"], "instance": args["model_instance_name"]}
        self.gpu_memory = GpuMemoryMetric(self.stage.plan, ("prefill",), labels)
        # how requests ended here: one count each, the only one (outcomes.py)
        self.outcomes = Outcomes({"model": args["model_name"], "instance": args["model_instance_name"]}, AT_PREFILL)
        pb_utils.Logger.log_info(  # startup's parts
            f"cosmos3_prefill: ready in {time.perf_counter() - t0:.1f}s ("
            + "".join(f"{k} {v:.1f}s, " for k, v in self.stage.startup.items())
            + f"process start to initialize {booted:.1f}s, its imports {imported:.1f}s)"
        )

    def execute(self, requests):
        responses = [self._one(r) for r in requests]
        self.gpu_memory.publish()
        return responses

    def _one(self, request):
        raw = input_array(request, "ticket")  # the door's; absent when prefill is called on its own
        try:
            ticket = Ticket(uuid.uuid4().hex, time.time()) if raw is None else Ticket.decode(raw.reshape(-1)[0])
        except (ValueError, IndexError) as e:
            self.outcomes.count_now("bad_input")
            return error_response(f"ticket: the door's '<id> <arrival>' ({e})")
        response = self._run(request, ticket)
        if response.has_error():  # the request ends here: it no longer waits (admission.py)
            self.state.release(ticket.id)
        return response

    def _run(self, request, ticket: Ticket):
        t_start = time.time()
        if faults.PREFILL_DELAY_S:
            time.sleep(faults.PREFILL_DELAY_S)
        if (why := self._refusal()) is not None:
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
            ident = continued_session(params)
            kept = kept_params(ident, self.state.session(ident)) if ident else None
            p = self.stage.validate(prompt.reshape(-1)[0], params, image, video, raw_actions,
                                    None if kept is None else kept.params)  # fmt: skip
            result = self.stage.run(p, image, video, raw_actions, "" if kept is None else kept.params.text_digest)
            p, wire = result.params, result.to_wire(self.stage.dtype, self.stage.device)
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

    def _refusal(self) -> str | None:
        """A request's refusal while the server drains (the engine would refuse it: no prefill for nothing, and its
        ticket goes back at once, which the drain waits for), or while a later part is down: until its reload is
        done, Triton sends it to the dead instance (the supervisor marks the part: state.py)."""
        if self.state.draining():
            return DRAINING
        return next((part_restarting(p) for p in ("denoise", "vae_decode") if self.state.is_down(p)), None)
