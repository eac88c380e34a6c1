"""Faults through `python -m cosmos3_core.triton.serve` (the supervised server): a killed stub, SIGTERM in flight."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from client.stream import ServerError, generate, wait_ready
from cosmos3_core.triton.launcher import free_ports

pytestmark = pytest.mark.served

LONG = {"steps": 40, "num_frames": 17, "height": 64, "width": 64}


@pytest.fixture
def supervised(served_deployment, tmp_path, request):
    """The supervised server; `faults`: its COSMOS3_FAULTS (indirect parametrization), engine steps of 0.05 s by
    default."""
    path, _ = served_deployment
    ports = free_ports(3)
    env = {**os.environ, "COSMOS3_FAULTS": getattr(request, "param", "step_delay_s=0.05")}
    cmd = [sys.executable, "-m", "cosmos3_core.triton.serve", "--config", str(path), "--workdir", str(tmp_path / "serve"),
           "--grpc-port", str(ports[0]), "--http-port", str(ports[1]), "--metrics-port", str(ports[2])]  # fmt: skip
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"127.0.0.1:{ports[0]}"
    wait_ready(url, 300)
    yield proc, url, tmp_path / "serve"
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    log.close()


def run_async(url: str, n: int) -> tuple[list[threading.Thread], dict[int, object]]:
    out: dict[int, object] = {}

    def run(i: int) -> None:
        try:
            out[i] = generate(url, f"request {i}", {**LONG, "seed": i}, timeout_s=120)
        except ServerError as e:
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, out


def stub_of(workdir, model: str) -> int:
    pattern = f"triton_python_backend_stub {workdir}/model_repository/{model}/"
    pids = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    assert len(pids) == 1, pids
    return int(pids[0])


def test_killed_denoise_stub_errors_in_flight_then_serves(supervised):
    proc, url, workdir = supervised
    threads, out = run_async(url, 2)
    time.sleep(1.5)  # both requests are denoising
    os.kill(stub_of(workdir, "cosmos3_denoise"), signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert all(isinstance(out[i], ServerError) for i in range(2)), out  # errors, not silence
    deadline = time.monotonic() + 300
    while True:  # the supervisor reloads denoise alone (gRPC readiness stays true): refused until it is back
        try:
            assert generate(url, "after the fault", {"steps": 2}).video.shape == (9, 32, 64, 3)
            break
        except ServerError:
            assert time.monotonic() < deadline
            time.sleep(0.5)


def test_sigterm_with_requests_in_flight(supervised):
    proc, url, _ = supervised
    threads, out = run_async(url, 2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(120)
    assert proc.wait(60) == 0
    for i in range(2):  # each ended with its result or one clear error
        r = out[i]
        assert isinstance(r, ServerError) or (r.video.shape == (17, 64, 64, 3) and r.events[-1]["type"] == "done"), r


@pytest.mark.parametrize("supervised", ["step_delay_s=0.05,prefill_delay_s=1.5"], indirect=True)
def test_sigterm_while_requests_are_in_prefill_waits_for_them(supervised):
    """The drain waits for requests past the door that no engine holds yet: prefill refuses each with the drain's
    text, and tritonserver then stops with nothing in flight (stopped with them in prefill, it refused them in its
    own words, or never answered them, waited out its exit timeout and was killed)."""
    proc, url, workdir = supervised
    threads, out = run_async(url, 2)
    deadline = time.monotonic() + 30
    while len(list(workdir.glob("state/tickets/*.door"))) < 2:  # both past the door, in or queued for prefill
        assert time.monotonic() < deadline, "the requests never passed the door"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert proc.wait(60) == 0
    for i in range(2):
        assert isinstance(out[i], ServerError) and "shutting down" in str(out[i]), out[i]


def test_model_that_fails_to_load_says_why(tmp_path):
    """A bad checkpoint path: the server never reports ready, and its log names the missing directory."""
    import dataclasses

    from cosmos3_core.deployment import Deployment
    from cosmos3_core.triton.launcher import stop_server, wait_until_ready
    from cosmos3_core.triton.serve import start

    deployment = dataclasses.replace(Deployment.load("configs/tiny.yaml"), checkpoint=str(tmp_path / "missing"))
    proc, ports, _ = start(deployment, tmp_path / "serve")
    try:
        with pytest.raises(RuntimeError, match="checkpoint directory not found"):
            wait_until_ready(ports[1], proc=proc, timeout_s=120)
    finally:
        stop_server(proc)
