"""A stream's life through the two decoupled models, as pure functions: for each (stage, event, state), what to send,
whether to hold the step's FINAL back, which outcome to count and which fact to tell the other process (state.py).
The stubs (denoise.py, decode.py) execute what these return and decide nothing themselves; tests/test_lifecycle.py
walks every phase × cancel × part death without a server.

Why it is built so (Triton 2.51, gRPC streams, an ensemble with two decoupled steps):

- Triton passes a client's cancel only to the ensemble steps it schedules after it, and answers nothing for the
  requests of a stub that died. So at every moment until a stream's last frame, each of the two processes holds a
  step of it whose FINAL it has not sent: whichever survives a death answers the stream with the dead part's error,
  and a fresh step keeps reaching vae_decode, where `is_cancelled()` shows the cancel.
- No step answers with a Triton error while another step of the same ensemble request may still be in flight
  (Triton then stops counting its steps' FINALs and never releases the request): the engine ends a stream with an
  `error` event as data, and vae_decode, whose step of it is the last, turns it into the Triton error.

Phases of a stream and who holds what:

| phase | denoise holds | vae_decode holds |
|---|---|---|
| engine (queued, denoised) | its request | the latest step (`accepted`, then each progress / chunk) |
| decoding (the engine sent `done`) | its request, FINAL held; a `poll` every POLL_S | the latest step (`done`, then each poll) |
| ending | sent `end` with its FINAL once vae_decode reported `finished` | answers `end`: the stream's last step |

Who counts the outcome (`cosmos3_requests_total`), once: the engine when it ends a stream with an `error` event
(cancelled, failed, rejected, or the reason vae_decode gave it to stop); vae_decode for a stream whose engine part
ended with `done` (at `end`: completed, cancelled, failed, refused); the survivor when a part dies ("failed").
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


# ---------------------------------------------------------------------------------------------------------------
# vae_decode: it sees every step of a stream, in order (one instance: deployment.py)
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class DecodeStream:
    """What vae_decode knows of one stream."""

    stop: str | None = None  # "cancelled", "failed", "refused": decode no more of it
    failure: str | None = None  # the text of the piece that did not decode
    engine_done: bool = False  # the engine's `done` arrived: the outcome is vae_decode's to count


STREAM_EVENTS = ("accepted", "progress", "chunk", "done", "poll", "end", "error")


def decode_step(s: DecodeStream | None, kind: str, cancelled: bool, message: str = "") -> Do:
    """One step of a stream reaching vae_decode (`s` None: a stream it does not know: a step of a dead instance's
    stream, or one it already ended). `cancelled`: the step's `is_cancelled()`; `message`: an error event's text.
    Updates `s`. The executor first releases the stream's previously held step (its FINAL, nothing else)."""
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
    if kind == "done":
        s.engine_done = True
        # the engine ended without seeing a stop (or before it): vae_decode's to count; report it finished now, or
        # after the frames
        return Do(send="nothing" if s.stop else "frames", final=False, finish=True)
    if kind in ("progress", "chunk") and s.stop is None:
        return Do(send="frames", final=False)
    # accepted, poll, or a piece of a stopped stream: hold it; the engine is told to stop (once)
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
    """vae_decode holds a step of a stream whose denoise instance died: answer it now, on that held step. Nobody else
    counts it: the engine (whose part of the stream was not over) is gone, and no `end` will come."""
    if s.stop == "cancelled":
        return Do(count="cancelled", forget=True)  # the client left: nobody reads an error
    return Do(send="error", message=s.failure or part_died("denoise"), count=s.stop or "failed", forget=True)


def frames_go(s: DecodeStream) -> bool:
    """A piece's frames are ready: send them only while the stream is neither cancelled nor failed meanwhile."""
    return s.stop is None


# ---------------------------------------------------------------------------------------------------------------
# denoise: the engine's end of a stream, then its held FINAL until vae_decode is done with it
# ---------------------------------------------------------------------------------------------------------------
def engine_error(stop: str | None, outcome: str | None, decode_down: bool, message: str) -> Do:
    """The engine ends a stream early. `stop`: why vae_decode told it to stop (None: not told); `outcome`: the owner's
    rejection ("rejected", "bad_input"); `decode_down`: vae_decode is dead, so the error event's decode step would
    reach the dead instance: the Triton error goes from here (nothing else of the stream can still complete)."""
    count = outcome or stop or "failed"
    if decode_down:
        return Do(send="error", message=message, count=count, forget=True)
    return Do(send="error_event", message=message, count=count)


@dataclass
class HeldStream:
    """A stream whose engine part ended with `done`: denoise holds its FINAL until vae_decode is done with it."""

    last_poll: float


def held_tick(s: HeldStream, now: float, finished: bool, decode_down: bool) -> Do:
    """The holder's look at one decoding stream (every few milliseconds)."""
    if finished:  # vae_decode sent its last frames (or stopped): the stream's FINAL, with one last step for it
        return Do(send="end", final=True)
    if decode_down:
        return Do(send="error", message=part_died("vae_decode"), count="failed", forget=True)
    if now - s.last_poll >= POLL_S:
        s.last_poll = now
        return Do(send="poll", final=False)
    return Do(send="nothing", final=False)
