"""The denoise stub's engine thread (`triton/denoise.py: EngineThread`) against the supervisor's drain, on the real
engine (tiny checkpoint, CPU), without a server: the stub's module imported beside a stand-in for Triton's
`triton_python_backend_utils` (nothing of it runs here but its logger).

The drain stops tritonserver once no request is past the door (`ServerState.idle`): a request holds its admission
ticket until its first event, and its instance's busy mark from then on. The first event is sent from inside a
tick, so the mark must be up before the engine has the request, not at the engine thread's next look between ticks.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import threading
import types

import pytest

from cosmos3_core.deployment import Deployment
from cosmos3_core.engine import DenoiseEngine
from cosmos3_core.generate import _CollectSink
from cosmos3_core.requests import warmup_inputs
from cosmos3_core.stages import PrefillStage
from cosmos3_core.triton.state import ServerState

REQUEST = {"num_frames": 1, "steps": 2}


@pytest.fixture
def denoise_stub(monkeypatch):
    """`cosmos3_core.triton.denoise`, imported as a stub imports it, beside a stand-in for Triton's utils; the modules
    imported so are gone again after the test (the package's attributes too), so no other test meets the stand-in."""
    utils = types.ModuleType("triton_python_backend_utils")
    utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    utils.Logger = types.SimpleNamespace(log_info=print, log_warn=print, log_error=print)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", utils)
    before = set(sys.modules)
    yield importlib.import_module("cosmos3_core.triton.denoise")
    package = sys.modules["cosmos3_core.triton"]
    for name in set(sys.modules) - before:
        del sys.modules[name]
        if name.startswith("cosmos3_core.triton.") and hasattr(package, name.rsplit(".", 1)[1]):
            delattr(package, name.rsplit(".", 1)[1])


class Holder:
    """No request is held for its frames here (`Holder.busy`)."""

    def busy(self) -> bool:
        return False


class FirstEventSink(_CollectSink):
    """Records, at the request's first event (where a served request gives its admission ticket back), whether the
    drain would see the server idle without that ticket."""

    def __init__(self, state: ServerState):
        super().__init__(REQUEST["steps"], False)
        self.state = state
        self.idle_at_first_event: bool | None = None

    def progress(self, step: int, steps: int, window: int, windows: int) -> None:
        if self.idle_at_first_event is None:
            self.idle_at_first_event = self.state.idle()


def test_a_request_submitted_between_the_busy_check_and_the_tick_is_busy_at_its_first_event(
    denoise_stub, nano_ckpt, tmp_path
):
    """The request reaches the engine right after the engine thread found it idle and before its tick (forced
    there): the drain must still see it from its first event on."""
    d = dataclasses.replace(Deployment.load("configs/tiny.yaml", checkpoint=str(nano_ckpt)), warmup_requests=[])
    ckpt = d.open_checkpoint()
    prefill = PrefillStage.from_deployment(ckpt, d, "cpu")
    engine = DenoiseEngine.from_deployment(ckpt, d)
    request = prefill.run(prefill.validate("a red cube", REQUEST, *warmup_inputs(REQUEST, d.defaults)), None)
    state = ServerState(tmp_path / "state")
    sink = FirstEventSink(state)
    submitted = threading.Event()

    class Windowed(denoise_stub.EngineThread):
        def _tell_busy(self) -> None:  # the window: the engine looked, found nothing, and ticks next
            super()._tell_busy()
            if not submitted.is_set():
                submitted.set()
                self.submit(request, sink)

    thread = Windowed(engine, state, "cosmos3_denoise_0_0", Holder(), drain_timeout_s=30)
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
