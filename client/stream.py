"""Stream one request through the `cosmos3` ensemble and collect its responses.

Every response may carry frames (`video`, possibly empty) and an `event`; the final response can carry
the last chunk, so outputs are read from every response, the final one included.
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cosmos3_core.errors import client_text
from cosmos3_core.wire import decode_event


class ServerError(RuntimeError):
    pass


@dataclass
class StreamResult:
    frames: list[np.ndarray] = field(default_factory=list)  # one uint8 [T, H, W, 3] per chunk
    events: list[dict[str, Any]] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # seconds since send, per non-empty chunk
    audio: np.ndarray | None = None  # enable_sound: float32 [2, samples], from the done response
    actions: np.ndarray | None = None  # policy / inverse dynamics: float32 [chunk, D], from the done response
    e2e_s: float = 0.0

    @property
    def video(self) -> np.ndarray:
        return np.concatenate(self.frames) if self.frames else np.zeros((0, 0, 0, 3), np.uint8)

    @property
    def ttfc_s(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None


def wait_ready(url: str, timeout_s: float, model: str = "cosmos3") -> None:
    """Block until the server says `model` is ready (e.g. right after `make serve` started)."""
    import tritonclient.grpc as grpcclient

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with grpcclient.InferenceServerClient(url) as c:
                if c.is_server_ready() and c.is_model_ready(model):
                    return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        if time.monotonic() > deadline:
            raise ServerError(f"server at {url} not ready after {timeout_s:.0f}s")
        time.sleep(0.5)


def build_inputs(
    prompt: str | bytes,
    params: dict[str, Any] | str,
    image: np.ndarray | None,
    video: np.ndarray | None = None,
    raw_actions: np.ndarray | None = None,
):
    """`params` as a dict (sent as JSON) or as raw JSON text; `image` uint8 [H, W, 3]; `video` uint8 [T, H, W, 3];
    `raw_actions` float32 [T, D] (forward dynamics)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    def text(name: str, value: str | bytes):
        t = grpcclient.InferInput(name, [1], "BYTES")
        t.set_data_from_numpy(np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_))
        return t

    inputs = [text("prompt", prompt), text("parameters", params if isinstance(params, str) else json.dumps(params))]
    # the ensemble's name for the v2v / action clip is condition_video
    for name, value in (("image", image), ("condition_video", video), ("raw_actions", raw_actions)):
        if value is not None:
            t = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
            t.set_data_from_numpy(np.ascontiguousarray(value))
            inputs.append(t)
    return inputs


def generate(
    url: str,
    prompt: str | bytes,
    params: dict[str, Any] | str,
    image: np.ndarray | None = None,
    on_event: Callable[[dict[str, Any], np.ndarray | None], None] | None = None,
    model: str = "cosmos3",
    timeout_s: float = 3600.0,
    cancel_after: Callable[[dict[str, Any]], bool] | None = None,
    video: np.ndarray | None = None,
    raw_actions: np.ndarray | None = None,
) -> StreamResult:
    """Send one request and wait for its final response. Raises ServerError with the server's message.

    `on_event(event, frames)` sees every event with the frames that came with it (None for progress);
    `cancel_after(event)` → True cancels the stream at that event (the result then holds what came before). Any
    exception before the final response (KeyboardInterrupt included) cancels the request on the server too."""
    from tritonclient.utils import InferenceServerException

    try:
        inputs = build_inputs(prompt, params, image, video, raw_actions)
        return _generate(url, inputs, on_event, model, timeout_s, cancel_after)
    except InferenceServerException as e:  # connection-level failures (server gone, stream broken)
        raise ServerError(client_text(str(e), url)) from e
    except queue.Empty as e:
        raise ServerError(f"no response within {timeout_s:.0f}s") from e


def _generate(url, inputs, on_event, model, timeout_s, cancel_after) -> StreamResult:
    import tritonclient.grpc as grpcclient

    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error, time.perf_counter())))
    out = StreamResult()
    t0 = time.perf_counter()
    final = False
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while True:
            result, error, t = responses.get(timeout=timeout_s)
            if error is not None:  # the table's text for its cause (docs/operations.md)
                raise ServerError(client_text(str(error), url))
            video = result.as_numpy("video")
            audio = result.as_numpy("audio")
            if audio is not None and audio.size:
                out.audio = audio
            actions = result.as_numpy("actions")
            if actions is not None and actions.size:
                out.actions = actions
            event_raw = result.as_numpy("event")
            frames = video if video is not None and video.size else None
            if frames is not None:
                out.frames.append(frames)
                out.chunk_times.append(t - t0)
            if event_raw is not None and event_raw.size:
                event = decode_event(event_raw.reshape(-1)[0])
                out.events.append(event)
                if on_event is not None:
                    on_event(event, frames)
                if cancel_after is not None and cancel_after(event):
                    out.e2e_s = time.perf_counter() - t0
                    return out
            if result.get_response().parameters["triton_final_response"].bool_param:
                final = True
                break
        out.e2e_s = time.perf_counter() - t0
        return out
    finally:
        # before the final response (cancel_after, Ctrl-C, an error, a timeout) the server cancels the request;
        # waiting for the stream to drain would let it run to its last step
        client.stop_stream(cancel_requests=not final)
        client.close()
