"""cosmos3_vae_decode: latents → uint8 frames; progress events pass through with an empty video.

Thin adaptor over `cosmos3_core.stages.DecodeStage`.
"""

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from cosmos3_core.cancel import CancelMarks
from cosmos3_core.checkpoint import Checkpoint
from cosmos3_core.deployment import resolve_checkpoint
from cosmos3_core.serving import (
    DecodeMetrics,
    deployment_from_args,
    error_response,
    input_array,
    input_torch,
    log_exception,
    output,
    text_output,
)
from cosmos3_core.stages import DecodeStage
from cosmos3_core.windows import pixel_frames_of_chunk

EMPTY_VIDEO = np.zeros((0, 0, 0, 3), dtype=np.uint8)


class TritonPythonModel:
    def initialize(self, args):
        d, device = deployment_from_args(args)
        self.stage = DecodeStage(Checkpoint.open(resolve_checkpoint(d.checkpoint)), device, d.torch_dtype, d.compile)
        self.marks = CancelMarks(d.cancel_dir)
        self.temporal = self.stage.codec.vae.config.scale_factor_temporal
        self.metrics = DecodeMetrics({"model": args["model_name"], "instance": args["model_instance_name"]})

    def execute(self, requests):
        return [self._one(r) for r in requests]

    def _one(self, request):
        try:
            event = json.loads(input_array(request, "event").reshape(-1)[0])
            if request.is_cancelled():  # the client cancelled: tell the engine (see cosmos3_core/cancel.py)
                if event.get("id"):
                    self.marks.mark(event["id"])
                    self.stage.drop(event["id"])
                    self.metrics.forget(event["id"])
                return error_response("cancelled")
            latents = input_torch(request, "latents")
            video = EMPTY_VIDEO
            if latents.numel():  # chunk (AR window) or done: AR chunks share the decoder cache of their stream
                t = time.time()
                video = self.stage.run_chunk(event["id"], latents, last=event["type"] == "done")
                event["frames"] = int(video.shape[0])
                event["frame_offset"] = pixel_frames_of_chunk(
                    event["latent_offset"], event["latent_frames"], self.temporal
                )[0]
                event.setdefault("timings", {})["decode_s"] = time.time() - t
                event["timings"].update(self.metrics.frames_out(event))
                del event["t0"]
        except Exception as e:  # noqa: BLE001
            return error_response(log_exception("cosmos3_vae_decode", e))
        return pb_utils.InferenceResponse(
            output_tensors=[output("video", video), text_output("event_out", json.dumps(event))]
        )
