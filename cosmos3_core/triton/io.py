"""Tensors and responses of the Triton stubs: the deployment from the model config, inputs copied out of Triton's
buffers, outputs, the two response shapes, and `Responder`, the one send path of both decoupled models.

Only imported inside a Triton Python stub (`triton_python_backend_utils` exists there). What crosses between the
models and to the client is typed in wire.py.
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

from .. import memory
from ..deployment import Deployment, use_device
from ..wire import Event, encode_event

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


def process_age_s() -> float:
    """Seconds since this process started: at `initialize`, the stub's own start and the imports before it (a
    reload's share that no model work explains), from Linux's /proc; NaN where that cannot be read (a log figure
    never stops a part from loading)."""
    try:
        with open("/proc/self/stat") as fh:
            started_ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return uptime - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def imports_s() -> float:
    """Seconds since the package's import began (`cosmos3_core.IMPORT_STARTED`): at a model's construction, the
    imports its stub's `initialize` ran first (torch, the package, and what the stage needs of diffusers)."""
    import cosmos3_core

    return time.perf_counter() - cosmos3_core.IMPORT_STARTED


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
    crosses there: Nano's `text_kv`, on the H200 in 2026-12; `serve.cuda_pool_bytes` sizes the pool so
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
    """CUDA tensors and bfloat16 CPU ones cross by DLPack (numpy has no bfloat16); other CPU ones as numpy (the
    backend refuses an empty tensor's DLPack strides)."""
    if isinstance(value, torch.Tensor):
        if value.is_cuda or value.dtype == torch.bfloat16:
            return pb_utils.Tensor.from_dlpack(name, to_dlpack(value.contiguous()))
        value = value.numpy()
    return pb_utils.Tensor(name, np.ascontiguousarray(value))


def text_output(name: str, text: str) -> Any:
    return pb_utils.Tensor(name, np.array([text.encode()], dtype=np.object_))


def error_response(message: str):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message))


def log_exception(where: str, e: BaseException) -> str:
    """Log a request's failure with its traceback → the text its client gets. Out of GPU memory, the part gives the
    failed call's blocks back to the card first, and the text says the part serves on."""
    pb_utils.Logger.log_error(f"{where}: {e}\n{traceback.format_exc()}")
    if isinstance(e, torch.cuda.OutOfMemoryError):
        try:
            memory.release_cached()
        except Exception as pending:  # noqa: BLE001 - a CUDA error pending on the device: the part's health says
            pb_utils.Logger.log_error(f"{where}: giving memory back after running out failed: {pending}")
        return (f"{where}: out of GPU memory ({str(e).splitlines()[0]}); the part serves on; the memory plan sizes "
                "each part (`make plan`, docs/configuration.md)")  # fmt: skip
    return f"internal error in {where}: {type(e).__name__}: {e}"


class Responder:
    """The one send path of both decoupled models: a thread that runs each item's `build` (it may wait, e.g. for
    a chunk's frames on the host) and sends what it returns (None: nothing, or FINAL alone when `final`). A failed build sends
    an error, final; a final response that cannot be sent is followed by an error, final, so the ensemble request
    never stays in flight.
    `maxsize` bounds how far producers run ahead of the sends."""

    def __init__(self, device: str | None = None, maxsize: int = 0):
        self.device = device
        self.queue: queue.Queue = queue.Queue(maxsize)
        self.thread = threading.Thread(target=self._run, name="cosmos3-send", daemon=True)
        self.thread.start()

    def send(self, sender: Any, build: Callable[[], Any], final: bool, after: Callable[[], None] | None = None) -> None:
        """`after`: called once the response is out (or could not be sent)."""
        self.queue.put((sender, build, final, after))

    def _run(self) -> None:
        if self.device is not None:
            use_device(self.device)
        while (item := self.queue.get()) is not None:
            sender, build, final, after = item
            self._send(sender, build, final)
            if after is not None:
                try:
                    after()
                except Exception as e:  # noqa: BLE001 - one failed hook never stops the others
                    log_exception("cosmos3 after send", e)

    def _send(self, sender: Any, build: Callable[[], Any], final: bool) -> None:
        try:
            response = build()
        except Exception as e:  # noqa: BLE001 - one failed response never stops the others
            response, final = error_response(log_exception("cosmos3 response", e)), True
        try:
            if response is None:  # nothing to say: only, if final, that this step is done with the request
                if final:
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
