"""cosmos3_prefill: validate the request, tokenize, run the understanding tower once, VAE-encode an i2v image, the
v2v clip's conditioning frames or an action request's anchor frame (inverse dynamics: its clip).

Thin adaptor over `cosmos3_core.stages.PrefillStage`; what it sends on is typed in `cosmos3_core/wire.py`.
"""

import time
import uuid

import triton_python_backend_utils as pb_utils

from cosmos3_core.requests import RequestError, parse_parameters_json
from cosmos3_core.stages import PrefillStage
from cosmos3_core.triton.glue import (
    deployment_from_args,
    error_response,
    input_array,
    log_exception,
    output,
    text_output,
)
from cosmos3_core.wire import RequestMeta


class TritonPythonModel:
    def initialize(self, args):
        t0 = time.perf_counter()
        d, device = deployment_from_args(args)
        self.stage = PrefillStage(d.open_checkpoint(), device, d.torch_dtype, d.defaults, d.limits)
        pb_utils.Logger.log_info(f"cosmos3_prefill: ready in {time.perf_counter() - t0:.1f}s")  # startup's parts

    def execute(self, requests):
        return [self._one(r) for r in requests]

    def _one(self, request):
        t0 = time.time()
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
        except RequestError as e:
            return error_response(str(e))
        except Exception as e:  # noqa: BLE001 - one bad request never takes the instance down
            return error_response(log_exception("cosmos3_prefill", e))
        meta = RequestMeta(uuid.uuid4().hex, p, t0, time.time() - t0)
        outs = [output(name, value) for name, value in wire.items()] + [text_output("request", meta.encode())]
        return pb_utils.InferenceResponse(output_tensors=outs)
