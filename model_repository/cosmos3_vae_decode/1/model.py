"""cosmos3_vae_decode (decoupled, one response per request): latents → uint8 frames; progress events pass through
with an empty video.

Thin adaptor over `cosmos3_core.stages.DecodeStage`. `execute` only queues; a decode thread launches each chunk
on the GPU in arrival order and hands it to a send thread, which waits for the chunk's frames on the host and
sends them. The GPU then decodes the next chunk while this one is copied out and sent.
"""

import json
import queue
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from cosmos3_core import faults
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
    use_device,
)
from cosmos3_core.stages import DecodeStage
from cosmos3_core.windows import pixel_frames_of_chunk

EMPTY_VIDEO = np.zeros((0, 0, 0, 3), dtype=np.uint8)
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        d, self.device = deployment_from_args(args)
        ckpt = Checkpoint.open(resolve_checkpoint(d.checkpoint))
        self.stage = DecodeStage(ckpt, self.device, d.torch_dtype, d.compile)
        self.marks = CancelMarks(d.cancel_dir)
        self.temporal = self.stage.codec.vae.config.scale_factor_temporal
        self.metrics = DecodeMetrics({"model": args["model_name"], "instance": args["model_instance_name"]})
        self.inbox: queue.Queue = queue.Queue()  # (request, sender); None stops
        # (sender, finish() → response); None stops. Bounded: the decode thread runs at most 2 chunks ahead of
        # the sends, so launched chunks hold little pinned host memory
        self.outbox: queue.Queue = queue.Queue(maxsize=2)
        self.decoding = threading.Thread(target=self._decode_loop, name="cosmos3-decode", daemon=True)
        self.sending = threading.Thread(target=self._send_loop, name="cosmos3-decode-send", daemon=True)
        self.decoding.start()
        self.sending.start()

    def execute(self, requests):
        for request in requests:
            self.inbox.put((request, request.get_response_sender()))
        return None

    def _decode_loop(self):
        use_device(self.device)
        while (item := self.inbox.get()) is not None:
            request, sender = item
            self.outbox.put((sender, self._start(request)))
        self.outbox.put(None)

    def _start(self, request):
        """Parse the request and launch its decode → a function that waits for the frames and builds the
        response (on the send thread)."""
        try:
            event = json.loads(input_array(request, "event").reshape(-1)[0])
            if request.is_cancelled():  # the client cancelled: tell the engine (see cosmos3_core/cancel.py)
                if event.get("id"):
                    self.marks.mark(event["id"])
                    self.stage.drop(event["id"])
                return lambda: self._cancelled(event.get("id"))
            latents = input_torch(request, "latents")
            if not latents.numel():
                return lambda: self._response(EMPTY_VIDEO, event)
            t = time.time()  # chunk (AR window) or done: AR chunks share the decoder cache of their stream
            frames = self.stage.start_chunk(event["id"], latents, last=event["type"] == "done")
        except Exception as e:  # noqa: BLE001
            message = log_exception("cosmos3_vae_decode", e)
            return lambda: error_response(message)

        def finish(_inputs=(request, latents)):  # the inputs outlive the GPU work that reads them
            video = frames().numpy()
            if faults.FAIL_DECODE_SEED is not None and event.get("seed") == faults.FAIL_DECODE_SEED:
                raise faults.InjectedFault(f"injected fault in the decode (seed {event['seed']})")
            event["frames"] = int(video.shape[0])
            event["frame_offset"] = pixel_frames_of_chunk(
                event["latent_offset"], event["latent_frames"], self.temporal
            )[0]
            event.setdefault("timings", {})["decode_s"] = time.time() - t
            event["timings"].update(self.metrics.frames_out(event))
            del event["t0"]
            return self._response(video, event)

        return finish

    def _cancelled(self, stream_id):
        if stream_id:
            self.metrics.forget(stream_id)
        return error_response("cancelled")

    @staticmethod
    def _response(video, event):
        return pb_utils.InferenceResponse(
            output_tensors=[output("video", video), text_output("event_out", json.dumps(event))]
        )

    def _send_loop(self):
        use_device(self.device)
        while (item := self.outbox.get()) is not None:
            sender, finish = item
            try:
                response = finish()
            except Exception as e:  # noqa: BLE001 - one failed chunk never stops the others
                response = error_response(log_exception("cosmos3_vae_decode", e))
            try:
                sender.send(response, flags=FINAL)
            except Exception as e:  # noqa: BLE001 - a client that went away must not stop the others
                message = log_exception("cosmos3_vae_decode: send", e)
                try:  # without a FINAL response the ensemble request would stay in flight forever
                    sender.send(error_response(message), flags=FINAL)
                except Exception:  # noqa: BLE001, S110 - the request is already gone
                    pass

    def finalize(self):
        self.inbox.put(None)
        self.decoding.join(timeout=30)
        self.sending.join(timeout=30)
