"""The chaos soak (bench/chaos.py) on the CPU, as CI runs it, through the supervised server (its front, a real
tritonserver, real stubs).

- 2 minutes: 8 concurrent mixed streams, a random part SIGKILLed every ~20 s, a fifth of the requests cancelled by
  their client. Every stream ends (completed, cancelled, or a clear error), none hangs past 5 s after its part's death
  (prefill's queued requests: 20 s, Triton answers those), every part is served again after every kill, the pool ends
  all free, the counters add up, and nothing of the server is left after it stops. Should tritonserver itself die
  meanwhile (Triton 2.51's Python backend once crashed while loading a killed vae_decode again), the supervisor
  restarts it whole and the soak follows that restart (below).
- A forced whole restart: tritonserver itself SIGKILLed once during the soak (its stubs paused a moment first, so
  that its last counters can be read). The report follows it: one whole restart, counted once by
  `cosmos3_restarts_total{part="tritonserver"}`; the streams in flight when it died ended within 5 s (unreachable);
  the restarted server served again; the counters of both lives of tritonserver add up to what was sent.

`python -m bench.chaos --minutes 10` is the long run."""

from __future__ import annotations

import json

import pytest

from bench.chaos import HUNG_S, WHOLE, run

pytestmark = pytest.mark.served


def test_two_minutes_of_chaos(served_deployment, tmp_path):
    report = run(str(served_deployment[0]), tmp_path / "chaos", minutes=2, seed=1)
    print(json.dumps(report, indent=1))
    assert report["ok"], json.dumps(report, indent=1)
    assert report["streams"] >= 8 and sum(report["kills"].values()) >= 2, report


def test_a_whole_tritonserver_restart_is_followed(served_deployment, tmp_path):
    report = run(str(served_deployment[0]), tmp_path / "chaos", minutes=1, seed=2, kill_every=15, targets=(WHOLE,),
                 max_kills=1)  # fmt: skip
    print(json.dumps(report, indent=1))
    assert report["ok"], json.dumps(report, indent=1)
    assert report["kills"][WHOLE] == 1 and report["restarts_total"].get(WHOLE) == 1, report
    (restart,) = report["whole_restarts"]
    # the streams in flight when it died: each ended, with the server-unreachable text, within HUNG_S
    assert restart["forced"] and restart["in_flight"] >= 1, restart
    assert restart["in_flight_ends"].get("unreached", 0) >= 1 and restart["slowest_in_flight_end_s"] <= HUNG_S, restart
    # served again: a probe after the kill, and a request sent after the restart
    assert report["back_s"][WHOLE][0] is not None and restart["served_again_s"] is not None, report
    # both lives counted requests, and their sum is what the identity adds up (none lost but the unsure few)
    first, second = report["lives"]
    identity = report["identity"]
    assert first["counted"] > 0 and second["counted"] > 0, report["lives"]
    assert identity["lives"] == 2 and identity["counted"] == first["counted"] + second["counted"], identity
    assert identity["answered_by_triton"] == first["answered_by_triton"] + second["answered_by_triton"], identity
    assert 0 <= identity["difference"] <= restart["unsure"] < first["counted"], identity
