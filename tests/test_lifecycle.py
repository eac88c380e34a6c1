"""A stream's life (cosmos3_core/triton/lifecycle.py) without a server: every phase × a client's cancel × a part's
death, both processes played step by step as the stubs execute it. Each walk checks that the stream is counted once,
with the right outcome, and that the client gets its frames and one end, or the dead part's error."""

from __future__ import annotations

from collections import Counter

import pytest

from cosmos3_core.errors import part_died
from cosmos3_core.triton import lifecycle
from cosmos3_core.triton.lifecycle import DecodeStream, HeldStream

SINGLE = ["accepted", "progress", "progress", "done"]
AR = ["accepted", "progress", "chunk", "progress", "chunk", "done"]


class Walk:
    """Denoise sends `events`; vae_decode answers each; after `done` the holder polls until vae_decode finished.
    `cancel_at`: the client cancels once the stream reached that point (an event index, or "decoding": while the
    last piece decodes); `kill`: (part, point) that part dies there."""

    def __init__(self, events, cancel_at=None, kill=None, decode_fails=None):
        self.events, self.cancel_at, self.kill, self.decode_fails = events, cancel_at, kill, decode_fails
        self.counts: Counter[str] = Counter()
        self.client: list[str] = []  # what reached the client: frames of <kind>, error <text>
        self.open_steps: set[int] = set()  # vae_decode steps whose FINAL was not sent
        self.stop: str | None = None  # state.stop
        self.finished = False  # state.finish
        self.s: DecodeStream | None = None
        self.held: int | None = None
        self.cancelled = False
        self.dead: str | None = None
        self.n = 0
        self.denoise_final = False
        self.decoding = 0  # the holder's ticks until the last piece's frames are ready

    def decode(self, kind: str, message: str = "") -> None:
        if self.dead == "vae_decode":
            return  # Triton answers nothing for a dead stub's steps
        if kind == "accepted":
            self.s = DecodeStream()
        self.n += 1
        step = self.n
        if self.dead == "denoise" and self.s is not None and kind not in lifecycle.LAST_EVENTS:
            do = lifecycle.denoise_died(self.s)  # a step of a dead denoise's stream, come late (lifecycle.gone)
        else:
            do = lifecycle.decode_step(self.s, kind, self.cancelled, message)
        if self.held is not None and (not do.final or do.forget):  # a poll leaves the held step held
            self.open_steps.discard(self.held)
            self.held = None
        self.apply(do)
        if do.send == "frames" and kind == "done":
            self.decoding = 2  # the last piece decodes over two of the holder's ticks
        elif do.send == "frames":
            self.piece_out(kind)
        elif do.finish:
            self.finished = True
        if do.send == "error":
            self.client.append(f"error {do.message}")
        if do.final:
            return
        self.held = step
        self.open_steps.add(step)

    def piece_out(self, kind: str) -> None:
        """A piece's frames are ready (or it failed)."""
        if self.decode_fails == kind:
            self.apply(lifecycle.decode_failed(self.s, "the piece failed"))
        elif kind == "progress" or lifecycle.frames_go(self.s):
            self.client.append(f"frames of {kind}")
        if kind == "done":
            self.finished = True

    def apply(self, do: lifecycle.Do) -> None:
        if do.count:
            self.counts[do.count] += 1
        if do.stop:
            self.stop = do.stop
        if do.forget:
            self.s = None

    def at(self, point) -> None:
        if self.cancel_at == point and not self.cancelled:
            self.cancelled = True
        if self.kill is not None and self.kill[1] == point and self.dead is None:
            self.dead = self.kill[0]
            if self.dead == "denoise" and self.held is not None and self.s is not None:
                do = lifecycle.denoise_died(self.s)  # vae_decode's watcher, on its held step
                self.open_steps.discard(self.held)
                self.held = None
                self.apply(do)
                if do.send == "error":
                    self.client.append(f"error {do.message}")

    def run(self) -> None:
        for i, kind in enumerate(self.events):
            self.at(i)
            if self.dead == "denoise":
                return
            if kind != "accepted" and (self.stop or self.dead == "vae_decode"):  # the engine ends it between ticks
                stop = self.stop if self.stop else None
                do = lifecycle.engine_error(stop, None, self.dead == "vae_decode", part_died("vae_decode")
                                            if self.dead else "cancelled")  # fmt: skip
                self.apply(do)
                self.denoise_final = True
                if do.send == "error":
                    self.client.append(f"error {do.message}")
                else:
                    self.decode("error", do.message)
                return
            self.decode(kind)
        h, now = HeldStream(last_poll=0.0), 0.0
        for _ in range(20):  # the holder's ticks, one poll each
            now += lifecycle.POLL_S
            self.at("decoding")
            if self.dead == "denoise":
                return
            if self.decoding and self.dead is None:
                self.decoding -= 1
                if not self.decoding:
                    self.piece_out("done")
            do = lifecycle.held_tick(h, now, self.finished, self.dead == "vae_decode")
            if do.send == "end":  # sent with denoise's FINAL; vae_decode answers it inside its execute
                self.at("ending")
                if self.dead == "vae_decode":  # the step is in its execute, or queued for it: Triton answers it
                    self.client.append(f"error {part_died('vae_decode')}")
                    self.denoise_final = True
                    return
            self.apply(do)
            if do.send == "error":
                self.client.append(f"error {do.message}")
            elif do.send in ("poll", "end"):
                self.decode(do.send)
            if do.final:
                self.denoise_final = True
                return
        raise AssertionError("the stream never ended")


@pytest.mark.parametrize("events", [SINGLE, AR], ids=["single", "ar"])
def test_a_stream_alone_completes_counted_once(events):
    w = Walk(events)
    w.run()
    assert w.counts == {"completed": 1} and w.denoise_final and not w.open_steps
    assert w.client[-1] == "frames of done" and not any(c.startswith("error") for c in w.client)


@pytest.mark.parametrize("events", [SINGLE, AR], ids=["single", "ar"])
@pytest.mark.parametrize("point", [1, 2, 3, "decoding", "ending"])
def test_a_cancel_in_any_phase_is_counted_cancelled_once(events, point):
    w = Walk(events, cancel_at=point)
    w.run()
    assert w.counts == {"cancelled": 1}, (w.counts, w.client)
    assert w.denoise_final and not w.open_steps
    assert not any(c.startswith("error") for c in w.client)  # the client left: nothing more is said
    assert ("frames of done" in w.client) == (point == "ending")  # by then the last frames were out


@pytest.mark.parametrize("events", [SINGLE, AR], ids=["single", "ar"])
@pytest.mark.parametrize("part", ["denoise", "vae_decode"])
@pytest.mark.parametrize("point", [1, 2, 3, "decoding", "ending"])
def test_a_part_dying_in_any_phase_ends_the_stream_with_its_error(events, part, point):
    w = Walk(events, kill=(part, point))
    w.run()
    # the last step in vae_decode's execute (or queued for it) when it dies: Triton answers it, and counts it
    # (nv_inference_request_failure), none of ours
    assert w.counts == ({} if (part, point) == ("vae_decode", "ending") else {"failed": 1}), (w.counts, w.client)
    assert w.client[-1] == f"error {part_died(part)}", w.client


@pytest.mark.parametrize("point", [1, "decoding", "ending"])
@pytest.mark.parametrize("part", ["denoise", "vae_decode"])
def test_a_cancelled_stream_whose_part_dies_is_counted_once(point, part):
    w = Walk(AR, cancel_at=point, kill=(part, point))
    w.run()
    assert sum(w.counts.values()) == (0 if (part, point) == ("vae_decode", "ending") else 1), w.counts


@pytest.mark.parametrize("kind", ["chunk", "done"])
def test_a_piece_that_fails_ends_the_stream_with_its_text_counted_once(kind):
    w = Walk(AR, decode_fails=kind)
    w.run()
    assert w.counts == {"failed": 1}, w.counts
    assert w.client[-1] == "error the piece failed" and w.denoise_final and not w.open_steps


def test_a_poll_is_answered_at_once_and_the_held_step_stays():
    s = DecodeStream(engine_done=True)
    do = lifecycle.decode_step(s, "poll", False)
    assert do.final and not do.forget and do.send == "nothing"


def test_a_part_is_gone_for_the_requests_that_arrived_before_its_death():
    """An ensemble request keeps the model instances it started with: a death after its arrival was its part's."""
    assert lifecycle.gone(10.0, 11.0) and not lifecycle.gone(12.0, 11.0) and not lifecycle.gone(10.0, None)


def test_a_request_reaching_denoise_after_its_vae_decode_died_is_refused_with_that_error():
    """Its `accepted`, and every later step of it at vae_decode, would go to the dead instance: answered at once."""
    assert lifecycle.arrival(10.0, 11.0) == part_died("vae_decode")
    assert lifecycle.arrival(12.0, 11.0) is None and lifecycle.arrival(10.0, None) is None


def test_a_late_step_of_a_dead_denoise_stream_is_answered_with_its_error():
    """vae_decode takes a step (its `accepted` was queued behind a piece) after the watcher answered the held ones:
    the stream is answered on that step, counted once."""
    s = DecodeStream(t0=10.0)
    assert lifecycle.gone(s.t0, 11.0)
    do = lifecycle.denoise_died(s)
    assert do.send == "error" and do.message == part_died("denoise") and do.final and do.count == "failed"
    s.stop = "cancelled"
    assert lifecycle.denoise_died(s) == lifecycle.Do(count="cancelled", forget=True)


def test_a_step_of_a_stream_decode_does_not_know_is_answered_at_once():
    assert lifecycle.decode_step(None, "chunk", False) == lifecycle.Do()
    do = lifecycle.decode_step(None, "error", False, "over capacity")
    assert do.send == "error" and do.message == "over capacity" and do.final
    with pytest.raises(ValueError):
        lifecycle.decode_step(DecodeStream(), "bogus", False)


def test_the_holder_polls_every_poll_s_and_ends_once_finished():
    h = HeldStream(last_poll=0.0)
    assert lifecycle.held_tick(h, 0.1, False, False).send == "nothing"
    assert lifecycle.held_tick(h, lifecycle.POLL_S, False, False).send == "poll"
    assert lifecycle.held_tick(h, lifecycle.POLL_S + 0.1, False, False).send == "nothing"
    end = lifecycle.held_tick(h, 1.0, True, False)
    assert end.send == "end" and end.final and end.count is None
    gone = lifecycle.held_tick(h, 1.0, True, True)  # vae_decode died: nobody would answer the end step
    assert gone.send == "error" and gone.message == part_died("vae_decode") and gone.count == "failed"


def test_the_engine_counts_its_own_end_and_the_reason_it_was_given():
    assert lifecycle.engine_outcome(None, "bad_input") == "bad_input"
    assert lifecycle.engine_error(None, None, False, "boom").count == "failed"
    assert lifecycle.engine_error("cancelled", None, False, "cancelled").count == "cancelled"
    assert lifecycle.engine_error("refused", None, False, "cancelled").count == "refused"
    assert lifecycle.engine_error(None, "rejected", False, "queue full").count == "rejected"
    down = lifecycle.engine_error(None, None, True, part_died("vae_decode"))
    assert down.send == "error" and down.forget
