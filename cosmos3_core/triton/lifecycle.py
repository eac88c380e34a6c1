"""A stream's life through the two decoupled models, as pure functions: for each (stage, event, state), what to send,
whether to hold the step's FINAL back, which outcome to count and which fact to tell the other process (state.py).
The stubs (denoise.py with its sink.py, decode.py) execute what these return and decide nothing themselves;
tests/test_lifecycle.py walks every phase × cancel × part death without a server.

Why it is built so (Triton 2.51, gRPC streams, an ensemble with two decoupled steps):

- Triton passes a client's cancel only to the ensemble steps it schedules after it, and answers nothing for the
  requests of a stub that died. So at every moment until a stream's last frame, each of the two processes holds a
  step of it whose FINAL it has not sent: whichever survives a death answers the stream with the dead part's error,
  and a fresh step keeps reaching vae_decode, where `is_cancelled()` shows the cancel.
- An ensemble request keeps the model instances it started with: a request that arrived before a part died has its
  steps of that part in the dead instance, reloaded or not (`gone`: the supervisor writes when a part died,
  `ServerState.died_at`). So the survivor answers exactly those, whenever their steps reach it, not only those it
  held at the moment of the death.
- No step answers with a Triton error while another step of the same ensemble request may still be in flight
  (Triton then stops counting its steps' FINALs and never releases the request): the engine ends a stream with an
  `error` event as data, and vae_decode, whose step of it is the last, turns it into the Triton error.
- The stream's last FINAL is vae_decode's answer to its last step (`end`, or the engine's `error` event), sent from
  inside vae_decode's `execute` once every earlier step of the stream there is answered: Triton answers itself a
  step whose `execute` had not returned when its stub died, so there is no moment when a dead vae_decode leaves the
  stream unanswered. A `poll` is answered at once there too (the stream's held step stays held): it only carries a
  client's cancel, which `execute` sees.

Phases of a stream and who holds what:

| phase | denoise holds | vae_decode holds |
|---|---|---|
| engine (queued, denoised) | its request | the latest step (`accepted`, then each progress / chunk) |
| decoding (the engine sent `done`) | its request, FINAL held; a `poll` every POLL_S | the `done` step (each poll answered at once) |
| ending (denoise sent `end` or an `error` event with its FINAL) | nothing | the last step, answered inside `execute` |

A request whose step is in a stub's `execute` when the stub dies is answered by Triton itself, with an error.

Who counts the outcome (`cosmos3_requests_total`), once: the engine when it ends a stream with an `error` event
(cancelled, failed, rejected, or the reason vae_decode gave it to stop); vae_decode for a stream whose engine part
ended with `done` (at `end`: completed, cancelled, failed, refused); the survivor when a part dies ("failed", or
"cancelled" when the client had left).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import part_died

POLL_S = 0.3  # a decoding stream's poll step: how soon vae_decode sees a cancel (its next piece stops)


@dataclass(frozen=True)
class Do:
    """What to do with one step (or one held stream)."""

    # nothing | frames (decode the latents, or pass the event on) | error | error_event | poll | end
    send: str = "nothing"
    final: bool = True  # send this step's FINAL now; False: hold it back (the stream's latest step)
    message: str | None = None  # send == "error": the Triton error's text
    count: str | None = None  # the outcome to count now
    stop: str | None = None  # tell the engine to stop the stream, and why (state.stop)
    finish: bool = False  # tell denoise that decode is done with the stream, after this step's frames (state.finish)
    forget: bool = False  # the stream has ended here: drop what this process keeps of it (state.forget)


def gone(t0: float, died_at: float | None) -> bool:
    """A part that died after the request arrived (`t0`, `died_at`: epoch s) was this request's: its steps of that
    part went, or will go, to the dead instance."""
    return died_at is not None and died_at > t0


# ---------------------------------------------------------------------------------------------------------------
# vae_decode: it sees every step of a stream, in order (one instance: deployment.py)
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class DecodeStream:
    """What vae_decode knows of one stream."""

    t0: float = 0.0  # the request's arrival (the accepted event's): `gone(t0, denoise's death)`
    stop: str | None = None  # "cancelled", "failed", "refused": decode no more of it
    failure: str | None = None  # the text of the piece that did not decode
    engine_done: bool = False  # the engine's `done` arrived: the outcome is vae_decode's to count


STREAM_EVENTS = ("accepted", "progress", "chunk", "done", "poll", "end", "error")


LAST_EVENTS = ("end", "error")  # a stream's last step at vae_decode: answered inside its execute


def decode_step(s: DecodeStream | None, kind: str, cancelled: bool, message: str = "") -> Do:
    """One step of a stream reaching vae_decode (`s` None: a stream it does not know: a step of a dead instance's
    stream, or one it already ended). `cancelled`: the step's `is_cancelled()`; `message`: an error event's text.
    Updates `s`. The executor releases the stream's previously held step (its FINAL, nothing else) when this one is
    held in its place or ends the stream (`not final or forget`): a `poll` leaves it held. A stream whose denoise is
    `gone` gets `denoise_died` instead, but for its last step (denoise sent its FINAL with it)."""
    if kind not in STREAM_EVENTS:
        raise ValueError(f"not a stream event: {kind!r}")
    if s is None:  # nothing to hold for: answer the step and go (an error event: the engine's refusal of a request
        return Do(send="error", message=message) if kind == "error" else Do()  # it could not even read)
    stop = decode_cancelled(s).stop if cancelled else None
    if kind == "error":  # the engine's last word: it counted; a piece's failure is the text the client gets
        if s.stop == "cancelled" and s.failure is None:
            return Do(forget=True)  # the client left: nobody reads an error
        return Do(send="error", message=s.failure or message, forget=True)
    if kind == "end":  # denoise has sent its FINAL: this step is the stream's last
        if s.failure is not None:
            return Do(send="error", message=s.failure, count=s.stop or "failed", forget=True)
        return Do(count=s.stop or "completed", forget=True)
    if kind == "poll":  # answered at once (it carried the cancel, if any); the stream's held step stays held
        return Do(stop=None if s.engine_done else stop)
    if kind == "done":
        s.engine_done = True
        # the engine ended without seeing a stop (or before it): vae_decode's to count; report it finished once the
        # frames are out (or now)
        return Do(send="nothing" if s.stop else "frames", final=False, finish=True)
    if kind in ("progress", "chunk") and s.stop is None:
        return Do(send="frames", final=False)
    # accepted, or a piece of a stopped stream: hold it; the engine is told to stop (once)
    return Do(final=False, stop=None if s.engine_done else stop)


def decode_cancelled(s: DecodeStream) -> Do:
    """The client cancelled (a step's `is_cancelled()`, seen as the step arrives): decode no more of the stream; the
    engine, if its part is not over, is told to stop it (and counts it)."""
    if s.stop is not None:
        return Do(final=False)
    s.stop = "cancelled"
    return Do(final=False, stop=None if s.engine_done else "cancelled")


def decode_failed(s: DecodeStream, message: str, outcome: str = "failed") -> Do:
    """A piece did not decode (`outcome` "refused": the video guardrail refused it). The first failure is the text
    the stream ends with; the engine, if it still runs the stream, is told to stop it (and counts `outcome`)."""
    if s.failure is None:
        s.failure = message
    if s.stop is None or s.stop == "cancelled":
        first = s.stop is None
        s.stop = outcome
        if first and not s.engine_done:
            return Do(final=False, stop=outcome)
    return Do(final=False)


def denoise_died(s: DecodeStream) -> Do:
    """A step of a stream whose denoise instance died (`gone`) before its last step: answer the stream now, on that
    step (the one vae_decode holds, or one that reaches it later). Nobody else counts it: the engine (whose part of
    the stream was not over) is gone, and no `end` will come."""
    if s.stop == "cancelled":
        return Do(count="cancelled", forget=True)  # the client left: nobody reads an error
    return Do(send="error", message=s.failure or part_died("denoise"), count=s.stop or "failed", forget=True)


def frames_go(s: DecodeStream) -> bool:
    """A piece's frames are ready: send them only while the stream is neither cancelled nor failed meanwhile."""
    return s.stop is None


# ---------------------------------------------------------------------------------------------------------------
# denoise: a request's arrival, the engine's end of a stream, then its held FINAL until vae_decode is done with it
# ---------------------------------------------------------------------------------------------------------------
def arrival(t0: float, decode_died_at: float | None) -> str | None:
    """A request reaching denoise: the error it is answered with at once, or None (accepted). Its vae_decode died
    after it began (`gone`): every step of it there, `accepted` too, would go to the dead instance."""
    return part_died("vae_decode") if gone(t0, decode_died_at) else None


def engine_outcome(stop: str | None, outcome: str | None) -> str:
    """The outcome of a stream the engine ends early: the owner's rejection (`outcome`: "rejected", "bad_input"),
    else why vae_decode told it to stop (`stop`), else "failed"."""
    return outcome or stop or "failed"


def engine_error(stop: str | None, outcome: str | None, decode_gone: bool, message: str) -> Do:
    """The engine ends a stream early, counted now. `decode_gone`: no step of the stream can reach a live vae_decode
    (it died after the request arrived, or none was ever sent there), so the Triton error goes from here. Otherwise
    the error goes as an event with denoise's FINAL, and vae_decode's step of it, the stream's last, answers it."""
    count = engine_outcome(stop, outcome)
    if decode_gone:
        return Do(send="error", message=message, count=count, forget=True)
    return Do(send="error_event", message=message, count=count)


@dataclass
class HeldStream:
    """A stream whose engine part ended with `done`: denoise holds its FINAL until vae_decode is done with it."""

    last_poll: float
    t0: float = 0.0  # the request's arrival: `gone(t0, vae_decode's death)`


def held_tick(s: HeldStream, now: float, finished: bool, decode_gone: bool) -> Do:
    """The holder's look at one decoding stream (every few milliseconds). `finished`: vae_decode sent its last frames
    (or stopped); `decode_gone`: `gone`."""
    if decode_gone:  # its steps at vae_decode were the dead instance's (the end step too: nobody would answer it)
        return Do(send="error", message=part_died("vae_decode"), count="failed", forget=True)
    if finished:  # the stream's FINAL, with its last step for vae_decode to answer
        return Do(send="end", final=True)
    if now - s.last_poll >= POLL_S:
        s.last_poll = now
        return Do(send="poll", final=False)
    return Do(send="nothing", final=False)
