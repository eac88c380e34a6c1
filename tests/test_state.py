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


def test_a_parts_proven_peak_lasts_until_the_server_is_new(tmp_path):
    """A reloaded part skips the warmup at the largest admitted request once its first load in this server's life
    ran it (denoise keeps the graph buckets it derived then); a whole restart (`reset`) proves it again."""
    state = ServerState(tmp_path)
    assert state.proven_peak("denoise") is None
    ServerState(tmp_path).prove_peak("denoise", "[12096, 24192]")  # the part's own stub
    ServerState(tmp_path).prove_peak("prefill")
    assert state.proven_peak("denoise") == "[12096, 24192]" and state.proven_peak("prefill") == ""
    state.reset()
    assert state.proven_peak("denoise") is None and state.proven_peak("prefill") is None
