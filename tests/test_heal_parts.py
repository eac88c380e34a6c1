"""A dead part heals alone (docs/operations.md), through the supervised server (`python -m cosmos3_core.triton.serve`:
its front, a real tritonserver, real stubs). One server: each part's stub is SIGKILLed in turn while a request is
being denoised, then the server drains.

- readiness (the front's `/v2/health/ready`) answers 503 within 2 s of the kill, naming the part;
- the request in flight gets the one text of that cause (errors.part_died) within 5 s when it needs the dead part
  (denoise, vae_decode) and finishes when it does not (prefill: it is past it);
- a new request is served within 90 s (the goal is 10 s on an idle machine: docs/operations.md), only the dead part
  was reloaded (tritonserver kept its pid), and `cosmos3_restarts_total{part}` counted it;
- tritonserver dying while a part loads again (Triton 2.51's Python backend crashed it so in CI) fails that reload
  at once (the load's answer would never come: the new stub holds its connection) and restarts it whole;
- a tritonserver that runs but no longer answers (SIGSTOPped here; seen: Triton 2.51's handler of a fatal signal
  hanging in exit) is killed by the supervisor's watchdog after serve.UNANSWERED_S and restarted whole: readiness
  says so, `cosmos3_restarts_total{part="tritonserver"}` counts it, a request is served again;
- a drain answers 503 from its first moment while the request in flight finishes.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from bench.faults_part import Supervised, drain, kill_part
from client.stream import generate
from cosmos3_core import errors
from cosmos3_core.triton.serve import UNANSWERED_S

pytestmark = pytest.mark.served

STEPS = 40  # x step_delay_s 0.05: ~2 s of denoising, enough to kill it mid-way


@pytest.fixture(scope="module")
def healing(served_deployment, tmp_path_factory):
    server = Supervised(
        str(served_deployment[0]), tmp_path_factory.mktemp("heal"), {"COSMOS3_FAULTS": "step_delay_s=0.05"}
    )
    try:
        server.wait_ready(600)
        yield server
    finally:
        server.stop()


def tritonserver_pid(server: Supervised) -> int:
    import subprocess

    out = subprocess.run(["pgrep", "-P", str(server.proc.pid), "-x", "tritonserver"], capture_output=True, text=True)
    return int(out.stdout.split()[0])


@pytest.mark.parametrize("part", ["denoise", "vae_decode", "prefill"])
def test_dead_part_is_seen_answered_and_reloaded(healing, part):
    pid = tritonserver_pid(healing)
    # denoise: a second request waits in the engine's queue (two of these prompts overrun the 64-page pool)
    queued = "x " + "word " * 45 if part == "denoise" else None
    r = kill_part(healing, part, STEPS, seed=7, back_timeout_s=90, queued_prompt=queued)
    print(r)
    assert r["readiness_false_s"] < 2.0 and r["readiness"] == f"503 {errors.part_restarting(part)}", r
    if part == "prefill":  # the request was past prefill: its remaining steps are alive
        assert r["in_flight"] == "finished", r
    else:
        assert r["in_flight"] == f"error: {errors.part_died(part)}" and r["in_flight_end_s"] < 5.0, r
    if queued:  # it had sent nothing yet: vae_decode held its `accepted` step
        assert r["queued"] == f"error: {errors.part_died(part)}" and r["queued_end_s"] < 5.0, r
    assert r["served_again_s"] is not None, r
    assert r["restarts_total"] == 1 and tritonserver_pid(healing) == pid, r  # the part alone, not the server


def test_tritonserver_dying_while_a_part_loads_again_is_restarted_whole(healing):
    life, before = healing.tritonserver(), healing.restarts()
    old = healing.stub("vae_decode")
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not set(healing.stubs("cosmos3_vae_decode")) - {old}:  # the reload's load has started its new stub
        assert time.monotonic() < deadline, "no reload"
        time.sleep(0.02)
    t0 = time.monotonic()
    os.kill(life[0], signal.SIGKILL)
    restarting = (503, json.dumps({"error": errors.SERVER_RESTARTING}))
    while healing.ready() != restarting:
        assert time.monotonic() - t0 < 10, healing.ready()
        time.sleep(0.05)
    seen_s = time.monotonic() - t0
    healing.wait_ready(300)
    served = generate(healing.url, "after the crash", {"steps": 2, "seed": 12}, timeout_s=120)
    assert served.events[-1]["type"] == "done"
    print({"restarting_after_s": round(seen_s, 2), "ready_again_s": round(time.monotonic() - t0, 2)})
    assert seen_s < 2.0, seen_s  # not UNANSWERED_S: the reload saw the exit
    assert healing.tritonserver() not in (None, life), "not restarted whole"
    after = healing.restarts()
    assert after.get("vae_decode", 0) == before.get("vae_decode", 0) + 1
    assert after.get("tritonserver", 0) == before.get("tritonserver", 0) + 1
    assert "while cosmos3_vae_decode loaded" in (healing.workdir / "serve.log").read_text()


def test_a_hung_tritonserver_is_killed_and_restarted_whole(healing):
    life = healing.tritonserver()
    before = healing.restarts().get("tritonserver", 0.0)
    t0 = time.monotonic()
    os.kill(life[0], signal.SIGSTOP)  # alive, answering nothing
    restarting = (503, json.dumps({"error": errors.SERVER_RESTARTING}))
    while healing.ready() != restarting:  # the front knows once the watchdog has killed it
        assert time.monotonic() - t0 < UNANSWERED_S + 30, healing.ready()
        time.sleep(0.1)
    killed_s = time.monotonic() - t0
    healing.wait_ready(300)
    back_s = time.monotonic() - t0
    assert generate(healing.url, "after the hang", {"steps": 2, "seed": 11}, timeout_s=120).events[-1]["type"] == "done"
    print({"killed_s": round(killed_s, 2), "ready_again_s": round(back_s, 2)})
    assert UNANSWERED_S <= killed_s < UNANSWERED_S + 15, killed_s
    assert healing.tritonserver() not in (None, life), "not restarted whole"
    assert healing.restarts().get("tritonserver", 0.0) == before + 1
    assert "did not answer for" in (healing.workdir / "serve.log").read_text()


def test_drain_answers_503_at_once_and_finishes_in_flight(healing):
    r = drain(healing, STEPS, seed=9)
    print(r)
    assert r["readiness_false_s"] < 0.5 and r["readiness"] == "503", r
    assert r["in_flight"] == "finished" and r["exit_code"] == 0, r


def test_client_prints_the_table_text_for_tritons_and_grpcs_own_words():
    """What Triton says itself of a dead stub, and gRPC of a server gone, become the texts of those causes."""
    triton = (
        "in ensemble 'cosmos3', Failed to process the request(s) for model instance 'cosmos3_vae_decode_0_0', "
        "message: Stub process 'cosmos3_vae_decode_0_0' is not healthy."
    )
    assert errors.client_text(triton, "h:1") == errors.part_died("vae_decode")
    for gone in ("[StatusCode.UNAVAILABLE] Socket closed", "The stream is no longer in valid state",
                 "[StatusCode.UNAVAILABLE] failed to connect to all addresses"):  # fmt: skip
        assert errors.client_text(gone, "h:1") == errors.unreachable("h:1")
    ours = errors.part_died("denoise")
    assert errors.client_text(f"in ensemble 'cosmos3', {ours}", "h:1") == ours
