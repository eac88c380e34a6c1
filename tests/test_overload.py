"""Load is shed at the door (cosmos3_core/triton/admission.py, door.py).

Served: the session's real server (max_queue 8, every engine tick 20 ms longer: tests/conftest.py) gets 3 × max_queue
requests at once. Every refused one hears the one over-capacity text within a second of sending (a bound for a
loaded 2-core CI; bench/overload.py measures the real figure, docs/operations.md), every accepted one completes, no
ticket is left held, and `cosmos3_requests_total` accounts for every request sent. Without the door the requests
wait in prefill's queue and the engine refuses the late ones seconds later, with its own text.

Unit: the ticket directory's count, claim, release and the expiry of a ticket that never reached the engine.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml

from cosmos3_core.triton.admission import DOOR_TTL_S, Ticket
from cosmos3_core.triton.state import ServerState


def test_tickets_count_claim_release_expire(tmp_path):
    tickets = ServerState(tmp_path / "state")
    (a,) = (Ticket(*t) for t in tickets.take(3))
    b, c = (Ticket(*t) for t in tickets.take(3, 5))  # a batch of 5 arrivals: 2 more fit
    assert tickets.take(3) == [] and tickets.held() == 3
    tickets.release(c.id)
    assert Ticket.decode(a.encode()) == a
    tickets.claim(a.id)  # reached the engine: held until its first event
    tickets.release(b.id)  # failed in prefill
    assert tickets.held() == 1
    (c,) = (Ticket(*t) for t in tickets.take(2))
    old = time.time() - DOOR_TTL_S - 1  # c never reached the engine (cancelled between the steps): it expires
    os.utime(tickets.dir / "tickets" / f"{c.id}.door", (old, old))
    assert tickets.held() == 1
    # an engine ticket never expires: its request always ends
    os.utime(tickets.dir / "tickets" / f"{a.id}.engine", (old, old))
    assert tickets.held() == 1
    tickets.claim(c.id)  # an expired one that reaches the engine after all is counted again
    assert tickets.held() == 2
    (d,) = (Ticket(*t) for t in tickets.take(3))
    tickets.clear_tickets("engine")  # the denoise model starting: a dead incarnation's waiting requests never end
    assert tickets.held() == 1
    tickets.clear_tickets("door")
    assert tickets.held() == 0
    tickets.release(d.id)  # a late release of a dropped ticket is harmless
    with pytest.raises(ValueError):
        Ticket.decode("../x 1.0")


def _tickets_of(server) -> ServerState:
    """The ticket directory of the served deployment (its rendered deployment.yaml, beside the repository)."""
    repo = next(a.split("=", 1)[1] for a in server.proc.command if a.startswith("--model-repository="))
    deployment = yaml.safe_load((Path(repo).parent / "deployment.yaml").read_text())
    return ServerState(deployment["state_dir"])


@pytest.mark.served
def test_overload_refused_at_once(server, served_deployment):
    from bench.overload import fire, outcome_counts, summarize

    metrics = f"http://127.0.0.1:{server.metrics_port}/metrics"
    max_queue = served_deployment[1].max_queue
    time.sleep(0.6)  # the engine publishes its counters every 0.2 s
    before = outcome_counts(metrics)
    outcomes = fire(server.url, 3 * max_queue, {"steps": 2, "num_frames": 1}, timeout_s=300)
    time.sleep(0.6)
    report = summarize(outcomes, before, outcome_counts(metrics))
    assert report["lost"] == 0 and report["error"] == 0, report
    assert report["refused"] >= max_queue and report["completed"] >= max_queue, report  # 3x: most are refused
    assert report["refusal_max_s"] < 1.0, report
    assert report["accounted"], report  # completed + rejected (+ failed, cancelled) == sent
    assert _tickets_of(server).held() == 0
    assert server.alive()
