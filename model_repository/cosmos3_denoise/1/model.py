"""cosmos3_denoise (decoupled): hand each request to the denoise engine and return at once.

The engine thread packs every live request into one GEN forward per tick; the response thread sends
progress events and, in the final response, the finished latents. Thin adaptor over
`cosmos3_core.engine.DenoiseEngine`; threads and metrics live in `cosmos3_core/triton/glue.py`.
"""

import time

import numpy as np
import triton_python_backend_utils as pb_utils

from cosmos3_core.engine import DenoiseEngine, QueueFull
from cosmos3_core.requests import RequestError, validate, warmup_inputs
from cosmos3_core.sampling import checkpoint_shift
from cosmos3_core.triton.cancel import CancelMarks
from cosmos3_core.triton.glue import (
    EngineMetrics,
    EngineThread,
    Responder,
    TritonSink,
    deployment_from_args,
    input_array,
    input_torch,
    log_exception,
)
from cosmos3_core.wire import PrefillResult, RequestMeta


class TritonPythonModel:
    def initialize(self, args):
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
        self.responder = Responder(device)
        self.engine_thread = EngineThread(self.engine, self.marks, d.drain_timeout_s)

    def execute(self, requests):
        for request in requests:
            sink = None
            try:
                meta = RequestMeta.decode(input_array(request, "request").reshape(-1)[0])
                sink = TritonSink(request, self.responder, meta, self.marks)
                result = PrefillResult.from_wire(
                    meta.params,
                    input_torch(request, "text_kv"),
                    input_array(request, "text_lens").astype(np.int64),
                    input_torch(request, "cond_latent"),
                    input_torch(request, "cond_actions"),
                )
                self.engine.submit(result, sink)
            except (RequestError, QueueFull) as e:
                self.metrics.rejected()
                self._reject(request, sink, str(e))
            except Exception as e:  # noqa: BLE001
                self.metrics.rejected()
                self._reject(request, sink, log_exception("cosmos3_denoise", e))
        return None

    def _reject(self, request, sink, message):
        (sink or TritonSink(request, self.responder, None, self.marks)).error(message)

    def finalize(self):
        self.engine_thread.close(timeout=30)
        self.metrics.close()
        self.responder.close(timeout=30)
