"""cosmos3_vae_decode (decoupled, one response per request): latents → uint8 frames; progress events pass through
with an empty video.

Thin adaptor over `cosmos3_core.stages.DecodeStage`. `execute` only queues; the decode loop
(`cosmos3_core.triton.glue.DecodeLoop`) launches each chunk on the GPU in arrival order and its responder waits for
the chunk's frames on the host and sends them, while the GPU decodes the next chunk.
"""

import time

import triton_python_backend_utils as pb_utils

from cosmos3_core.model.checkpoint import Checkpoint
from cosmos3_core.stages import DecodeStage
from cosmos3_core.triton.cancel import CancelMarks
from cosmos3_core.triton.glue import DecodeLoop, DecodeMetrics, deployment_from_args


class TritonPythonModel:
    def initialize(self, args):
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
