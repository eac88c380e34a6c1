"""The denoise model's `execute` answers each request on arrival (`DenoiseModel.execute`, `TritonSink.arrived`,
`lifecycle.arrival`), run as Triton calls it, without a server or an engine: the stub's module beside a stand-in for
Triton's utils (conftest.py), its sends through the real responder, its tickets in a real state folder.

A request whose vae_decode died after it began is answered at once with that part's error and counted `failed`,
its ticket given back; one that began after the death is accepted (its `accepted` step sent, not final) and goes to
the engine; one whose metadata does not decode is answered with an error naming the failure."""

from __future__ import annotations

import time
import types

import numpy as np
import pytest

from cosmos3_core.deployment import Deployment
from cosmos3_core.errors import part_died
from cosmos3_core.requests import validate
from cosmos3_core.triton.state import ServerState
from cosmos3_core.wire import RequestMeta


class Sender:
    def __init__(self):
        self.sent: list[tuple[object, int]] = []

    def send(self, response=None, flags: int = 0) -> None:
        self.sent.append((response, flags))


class Request:
    def __init__(self, text: bytes):
        self.inputs = {"request": types.SimpleNamespace(as_numpy=lambda: np.array([text], dtype=np.object_))}
        self.sender = Sender()

    def get_response_sender(self) -> Sender:
        return self.sender

    def is_cancelled(self) -> bool:
        return False


@pytest.fixture
def model(denoise_stub, tmp_path):
    """A `DenoiseModel` with what `execute` uses: a state folder, the responder, recorders for counts and submissions."""
    m = denoise_stub.DenoiseModel.__new__(denoise_stub.DenoiseModel)
    m.state = ServerState(tmp_path / "state")
    m.responder = denoise_stub.Responder()
    m.ends, m.submitted = [], []
    m.metrics = types.SimpleNamespace(outcomes=None, publish_end=m.ends.append)
    m.holder = types.SimpleNamespace(hold=lambda sink: None)
    m.gpu_memory = types.SimpleNamespace(publish=lambda: None)
    m._submit = m.submitted.append
    yield m
    m.responder.close(5)


def request(model, t0: float) -> Request:
    d = Deployment.load("configs/tiny.yaml")
    params = validate("a red cube", {}, None, d.defaults, d.limits, 16, 4, 3.0)
    ((ident, _),) = model.state.take(limit=1)  # its admission ticket, as the door took it
    return Request(RequestMeta(ident, params, t0, 0.0).encode().encode())


def sent(model, req: Request) -> list[tuple[object, int]]:
    model.responder.close(5)  # every queued send is out
    return req.sender.sent


def test_a_request_that_began_before_its_vae_decode_died_is_refused_with_that_error(model):
    req = request(model, t0=time.time())
    model.state.mark_down("vae_decode")
    model.execute([req])
    (response, flags), *rest = sent(model, req)
    assert not rest and flags == 1 and response.error == part_died("vae_decode")
    assert model.ends == ["failed"] and model.submitted == [] and model.state.held() == 0


def test_a_request_that_began_after_its_vae_decode_died_is_accepted(model):
    model.state.mark_down("vae_decode")
    req = request(model, t0=time.time() + 1)
    model.execute([req])
    (response, flags), *rest = sent(model, req)
    assert not rest and flags == 0 and response.error is None and b'"accepted"' in response.outputs["event"][0]
    assert model.ends == [] and [s.request for s in model.submitted] == [req] and model.state.held() == 1


def test_a_request_whose_metadata_does_not_decode_is_answered_with_its_failure(model):
    req = Request(b"not json")
    model.execute([req])
    (response, flags), *rest = sent(model, req)
    assert not rest and flags == 1 and "JSONDecodeError" in response.error and model.ends == ["failed"]
