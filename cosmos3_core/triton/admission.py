"""Load is shed at the door: how many accepted requests are waiting, shared by the model processes of one server.

The ensemble's first step (`cosmos3_admit`, door.py) runs in microseconds, so it sees each request within
milliseconds of its arrival. It takes a ticket for the request — or refuses it at once with `errors.OVER_CAPACITY`
(the one text a client or mesh retries elsewhere) when `max_queue` tickets are held — before the request waits anywhere (prefill's Triton queue, prefill, the engine's
queue). A ticket is held while the request waits: from the door until the denoise engine's first word about it
(its first step's progress event, or the error that ended it). So `max_queue` bounds the requests ahead of a newly
accepted one, wherever they wait; the requests being denoised are bounded by the K/V pool, not by the door.

Tickets are empty files in the server's state folder (`ServerState.take` / `claim` / `release` / `held`, state.py),
because the door, prefill and denoise run in different stub processes:
  <id>.door    taken at the door; released by prefill when the request fails there;
  <id>.engine  claimed by the denoise model when the request reaches it; released by its first event.
A `.door` ticket whose request never reaches the denoise model (the client cancelled it between the steps, the
ensemble stopped it) would be held forever: one older than `DOOR_TTL_S` is dropped when the door counts. An
`.engine` ticket always ends (every engine request ends with an event), except in a denoise stub that died: the denoise
model drops every `.engine` ticket when it starts (a reload of the part, or of the whole server), the door every
`.door` one.

Stdlib only: the door's stub imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from .state import DOOR_TTL_S

__all__ = ["DOOR_TTL_S", "Ticket"]


@dataclass(frozen=True)
class Ticket:
    """What the door hands on to prefill (BYTES [1] `ticket`): the request's id and its arrival (epoch s)."""

    id: str
    t0: float

    def encode(self) -> str:
        return f"{self.id} {self.t0!r}"

    @classmethod
    def decode(cls, text: str | bytes) -> Ticket:
        ident, t0 = (text.decode() if isinstance(text, bytes) else text).split()
        if not ident.isalnum():
            raise ValueError(f"ticket id must be alphanumeric, got {ident!r}")
        return cls(ident, float(t0))
