"""`ServerState`, the facts the server's processes share through its state folder: the warmup turn here (the rest
is exercised by the served tests that use each fact)."""

from __future__ import annotations

import threading
import time

from cosmos3_core.triton.state import ServerState


def test_one_part_warms_up_at_a_time(tmp_path):
    """Two parts (each its own ServerState on one folder, as each stub has) ask for the warmup turn at once: the
    second starts only once the first has ended, and a part that raised inside its turn gives it back."""
    log: list[str] = []
    first_in = threading.Event()

    def part(name: str, hold_s: float, wait: threading.Event | None) -> None:
        if wait is not None:
            wait.wait()
        with ServerState(tmp_path).warmup_turn():
            log.append(f"{name} in")
            first_in.set()
            time.sleep(hold_s)
            log.append(f"{name} out")

    a = threading.Thread(target=part, args=("a", 0.3, None))
    b = threading.Thread(target=part, args=("b", 0.0, first_in))
    a.start(), b.start()
    a.join(5), b.join(5)
    assert log == ["a in", "a out", "b in", "b out"]

    try:
        with ServerState(tmp_path).warmup_turn():
            raise RuntimeError("a warmup that failed")
    except RuntimeError:
        pass
    done = threading.Event()
    threading.Thread(target=lambda: (ServerState(tmp_path).warmup_turn().__enter__(), done.set())).start()
    assert done.wait(2), "the turn was not given back after a failed warmup"


def test_an_instances_proven_peak_lasts_until_the_server_is_new(tmp_path):
    """A reloaded instance skips the warmup at the largest admitted request once its first load in this server's life
    ran it (denoise keeps the step layouts it settled on then); another instance proves its own; a whole restart
    (`reset`) proves them again."""
    state = ServerState(tmp_path)
    assert state.proven_peak("cosmos3_denoise_0_0") is None
    ServerState(tmp_path).prove_peak("cosmos3_denoise_0_0", '{"buckets": [12096], "pad_limit": 0.1}')  # its stub
    ServerState(tmp_path).prove_peak("cosmos3_prefill_0_0")
    assert state.proven_peak("cosmos3_denoise_0_0") == '{"buckets": [12096], "pad_limit": 0.1}'
    assert state.proven_peak("cosmos3_prefill_0_0") == "" and state.proven_peak("cosmos3_denoise_1_0") is None
    state.reset()
    assert state.proven_peak("cosmos3_denoise_0_0") is None and state.proven_peak("cosmos3_prefill_0_0") is None


def test_the_server_is_idle_only_when_no_request_is_past_the_door(tmp_path, monkeypatch):
    """A request holds an admission ticket from the door until the engine's first event for it, and the engine is
    busy before that event: the drain waits through both. A `.door` ticket past its TTL (a request cancelled between
    two steps) no longer holds it."""
    state = ServerState(tmp_path)
    assert state.idle()
    ((ident, _),) = state.take(limit=4)  # the door
    assert not state.idle()  # in prefill
    state.claim(ident)  # the denoise model has it
    state.set_busy("cosmos3_denoise_0_0", True)
    assert not state.idle()
    state.release(ident)  # its first event
    assert not state.idle()  # still denoising
    state.set_busy("cosmos3_denoise_0_0", False)
    assert state.idle()
    state.take(limit=4)
    assert not state.idle() and state.idle(tickets=False)  # the drain's wait for tickets is the shorter
    monkeypatch.setattr("cosmos3_core.triton.state.DOOR_TTL_S", -1.0)
    assert state.idle()
