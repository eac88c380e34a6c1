"""Load is shed at the door: how many accepted requests are waiting, shared by the model processes of one server.

The ensemble's first step (`cosmos3_admit`, door.py) runs in microseconds, so it sees each request within
milliseconds of its arrival. It takes a ticket for the request — or refuses it at once with `errors.OVER_CAPACITY`
(the one text a client or mesh retries elsewhere) when `max_queue` tickets are held — before the request waits anywhere (prefill's Triton queue, prefill, the engine's
queue). A ticket is held while the request waits: from the door until the denoise engine's first word about it
(its first step's progress event, or the error that ended it). So `max_queue` bounds the requests ahead of a newly
accepted one, wherever they wait; the requests being denoised are bounded by the K/V pool, not by the door.

Tickets are empty files in one directory (`tickets_dir(cancel_dir)`, per server: `serve.render` gives each server its
own cancel dir), because the door, prefill and denoise run in different stub processes:
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

import fcntl
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

# A `.door` ticket older than this is a request that never reached the engine. Legitimately, a request spends at most
# max_queue prefills there (well under a minute on any deployment): an expired live one only lets the door admit one
# more, which the engine's own queue limit still bounds.
DOOR_TTL_S = 120.0


def tickets_dir(cancel_dir: str | Path) -> Path:
    return Path(cancel_dir) / "tickets"


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


class Tickets:
    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, ident: str, state: str) -> Path:
        if not ident.isalnum():
            raise ValueError(f"ticket id must be alphanumeric, got {ident!r}")
        return self.dir / f"{ident}.{state}"

    def take(self, limit: int, n: int = 1) -> list[Ticket]:
        """Tickets for up to `n` new requests (in their order), as many as keep `limit` or fewer held: one count for a
        whole batch of arrivals. The requests beyond them are refused by the caller."""
        fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # several door instances: counting and taking are one step
            now = time.time()
            tickets = [Ticket(uuid.uuid4().hex, now) for _ in range(max(0, min(n, limit - self.held())))]
            for ticket in tickets:
                self._path(ticket.id, "door").touch()
            return tickets
        finally:
            os.close(fd)

    def held(self) -> int:
        """Tickets held now; expired `.door` ones are dropped first."""
        count, expired = 0, time.time() - DOOR_TTL_S
        for entry in os.scandir(self.dir):
            if entry.name.endswith(".door"):
                try:
                    if entry.stat().st_mtime < expired:
                        os.unlink(entry.path)
                        continue
                except FileNotFoundError:  # released meanwhile
                    continue
            elif not entry.name.endswith(".engine"):
                continue
            count += 1
        return count

    def claim(self, ident: str) -> None:
        """The request reached the denoise model: its ticket no longer expires (taken anew if it had)."""
        try:
            os.replace(self._path(ident, "door"), self._path(ident, "engine"))
        except FileNotFoundError:
            self._path(ident, "engine").touch()

    def release(self, ident: str) -> None:
        """The request stopped waiting (it is being denoised, or it ended)."""
        for state in ("door", "engine"):
            self._path(ident, state).unlink(missing_ok=True)

    def clear(self, state: str) -> None:
        """Drop every ticket in `state` ("door" or "engine"): the model that holds such requests is starting, so those
        of a dead incarnation never end (Triton answers nothing for a dead decoupled stub's requests)."""
        for entry in os.scandir(self.dir):
            if entry.name.endswith(f".{state}"):
                Path(entry.path).unlink(missing_ok=True)
