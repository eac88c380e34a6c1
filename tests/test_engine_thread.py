"""The denoise stub's engine thread (`triton/denoise.py: EngineThread`) against the supervisor's drain, on the real
engine (tiny checkpoint, CPU), without a server: the stub's module imported beside a stand-in for Triton's
`triton_python_backend_utils` (nothing of it runs here but its logger).

The drain stops tritonserver once no request is past the door (`ServerState.idle`): a request holds its admission
ticket until its first event, and its instance's busy mark from then on. The first event is sent from inside a
tick, so the mark must be up before the engine has the request, not at the engine thread's next look between ticks.
"""

from __future__ import annotations

import dataclasses
import threading
import types

import numpy as np
import torch

from cosmos3_core.deployment import Deployment
from cosmos3_core.engine import DenoiseEngine
from cosmos3_core.generate import _CollectSink
from cosmos3_core.requests import warmup_inputs
from cosmos3_core.stages import PrefillStage
from cosmos3_core.triton.state import ServerState
from cosmos3_core.wire import PrefillResult

REQUEST = {"num_frames": 1, "steps": 2}


class Holder:
    """No request is held for its frames here (`Holder.busy`)."""

    def busy(self) -> bool:
        return False


class Input:
    """A request's input tensor as the stub reads it (`io.input_array`, `io.input_torch`)."""

    def __init__(self, value: torch.Tensor | np.ndarray):
        self.value = value

    def as_numpy(self) -> np.ndarray:
        return np.asarray(self.value)

    def to_dlpack(self):
        return torch.utils.dlpack.to_dlpack(self.value)


class FirstEventSink(_CollectSink):
    """A request as `DenoiseModel._submit` takes it (its inputs and metadata, as prefill sent them) and the engine's
    sink for it. Records, at its first event (where a served request gives its admission ticket back), whether the
    drain would see the server idle without that ticket."""

    def __init__(self, state: ServerState, prefilled: PrefillResult):
        super().__init__(REQUEST["steps"], False)
        self.state = state
        self.idle_at_first_event: bool | None = None
        self.meta = types.SimpleNamespace(id="r1", params=prefilled.params)
        wire = prefilled.to_wire(torch.float32, "cpu")
        self.request = types.SimpleNamespace(inputs={name: Input(value) for name, value in wire.items()})

    def progress(self, step: int, steps: int, window: int, windows: int) -> None:
        if self.idle_at_first_event is None:
            self.idle_at_first_event = self.state.idle()


def test_a_request_submitted_between_the_busy_check_and_the_tick_is_busy_at_its_first_event(
    denoise_stub, nano_ckpt, tmp_path
):
    """The request reaches the model (`DenoiseModel._submit`, as from Triton's thread) right after the engine
    thread found it idle and before its tick (forced there): the drain must still see it from its first event on."""
    d = dataclasses.replace(Deployment.load("configs/tiny.yaml", checkpoint=str(nano_ckpt)), warmup_requests=[])
    ckpt = d.open_checkpoint()
    prefill = PrefillStage.from_deployment(ckpt, d, "cpu")
    engine = DenoiseEngine.from_deployment(ckpt, d)
    prefilled = prefill.run(prefill.validate("a red cube", REQUEST, *warmup_inputs(REQUEST, d.defaults)), None)
    state = ServerState(tmp_path / "state")
    sink = FirstEventSink(state, prefilled)
    model = denoise_stub.DenoiseModel.__new__(denoise_stub.DenoiseModel)  # the parts `_submit` uses
    model.engine, model.host_kv_warned = engine, True
    armed, submitted = threading.Event(), threading.Event()

    class Windowed(denoise_stub.EngineThread):
        def _tell_busy(self) -> None:  # the window: the engine looked, found nothing, and ticks next
            super()._tell_busy()
            if armed.is_set() and not submitted.is_set():
                submitted.set()
                model._submit(sink)

    thread = model.engine_thread = Windowed(engine, state, "cosmos3_denoise_0_0", Holder(), drain_timeout_s=30)
    armed.set()
    try:
        assert submitted.wait(10)
        for _ in range(600):
            if sink.latents is not None or sink.failure is not None:
                break
            threading.Event().wait(0.1)
        assert sink.failure is None and sink.latents is not None
        assert sink.idle_at_first_event is False, "the drain saw the server idle with a request in its tick"
    finally:
        thread.close(timeout=10)
    assert state.idle()  # and the mark is down once the request is done
