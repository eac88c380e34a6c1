"""AR sessions: what a kept stream leaves for its continuation, and the table that bounds them. No model.

A request with `parameters.session = {"keep": true}` (window_mode chained or kv) keeps, after its last window:

- its text K/V pages (per CFG branch), so a continuation with the same prompt runs no prefill;
- kv: its committed K/V pages (the last window is committed too before the stream ends), still counted in the pool;
- chained: the last window's tail latents (the next window's pinned frames);
- the seed, the next window's index and first latent frame: the continuation's windows are the same plan's next
  ones (`windows.continue_windows`), their noise drawn from `seed + window index` as one long stream's would be;
- kv: each branch's text length when the session began, which the vision positions count from in every later
  window (a re-prompt's new text length must not move the committed frames' positions).

The UniPC state needs nothing: each window starts a fresh sampler. The scheduler (scheduler.py) owns a
`SessionTable` and is its only writer, on the engine thread, but for `claim` (a continuation's `submit`, any thread):
both under the scheduler's lock. A session is idle (in the table, counted live, its pages held) until a continuation
claims it; the claiming job then owns its pages, and the session is live again only if that job keeps it. It ends
when its TTL passes (`session_ttl_s` since it was kept), when a request needs its pages or `max_sessions` is reached
(least recently kept first: an eviction), when the server drains, or when its continuation fails or is cancelled.

`SessionInfo` is what other processes learn of an idle session: the table tells `on_record(id, record)` each change
of a session's record — idle (its `SessionInfo`), busy, ended (why), or None (forgotten) — and the server keeps it
(triton/state.py); prefill reads it (`kept_params`) to check a continuation against its session's parameters, to
refuse one whose session is busy or ended by name, and to skip the text prefill when the prompt's tokens are the
session's.
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from .requests import GenerationParams, RequestError

SESSION_ID = re.compile(r"[0-9a-f]{32}")
ENDED_MEMORY = 4096  # ended sessions whose reason a late continuation is told (then "unknown")


@dataclass(frozen=True)
class SessionInfo:
    """An idle session as prefill sees it: the kept request's parameters (sizes, windows, seed, `text_digest`), and
    where its windows stand."""

    id: str
    params: GenerationParams
    next_window: int
    next_latent: int

    def encode(self) -> str:
        return json.dumps({**asdict(self), "params": asdict(self.params)})

    @classmethod
    def decode(cls, text: str) -> SessionInfo:
        raw = json.loads(text)
        return cls(raw["id"], GenerationParams(**raw["params"]), raw["next_window"], raw["next_latent"])


@dataclass
class Session:
    """A kept stream's state (engine thread). `text_pages` and `context` are pool page lists (kv_pool.PageList)."""

    id: str
    params: GenerationParams
    next_window: int
    next_latent: int
    text_pages: list[Any]  # per branch
    context: list[list[Any]]  # kv: per branch, per committed latent frame; chained: empty lists
    vision_base: tuple[int, ...]  # per branch: the text length vision positions count from
    tail: Any = None  # chained: the last window's last `overlap` latent frames [1, C, o, h, w]
    kept_at: float = 0.0

    @property
    def info(self) -> SessionInfo:
        return SessionInfo(self.id, self.params, self.next_window, self.next_latent)

    def pages(self) -> list[Any]:
        return [*self.text_pages, *(f for branch in self.context for f in branch)]


@dataclass
class SessionTable:
    """The idle sessions, least recently kept first, and why ended ones ended. `on_record(id, record)`: told each
    change of a session's record (`record`), None once it is forgotten."""

    ttl_s: float = 120.0
    max_sessions: int = 16
    clock: Callable[[], float] = time.monotonic
    on_record: Callable[[str, str | None], None] | None = None
    idle: OrderedDict[str, Session] = field(default_factory=OrderedDict)
    busy: set[str] = field(default_factory=set)  # claimed by a continuation not yet ended
    ended: OrderedDict[str, str] = field(default_factory=OrderedDict)  # id → why
    evictions: int = 0

    @property
    def live(self) -> int:
        """Sessions kept and not ended: idle ones and those being continued (`cosmos3_sessions`)."""
        return len(self.idle) + len(self.busy)

    def claim(self, ident: str) -> Session:
        """A continuation takes the session (any thread, under the scheduler's lock) → it, out of the table. A
        RequestError naming `session` when it cannot be continued."""
        if not SESSION_ID.fullmatch(ident):
            raise RequestError("session", f"continue: a session id (32 hex digits), got {ident[:64]!r}")
        if ident in self.busy:
            raise RequestError("session", f"{ident} is already being continued by another request")
        session = self.idle.pop(ident, None)
        if session is None:
            why = self.ended.get(ident)
            raise RequestError("session", f"{ident} " + (f"has ended ({why})" if why else "is unknown"))
        self.busy.add(ident)
        self._tell(ident, record(busy=True))  # prefill of another continuation refuses it at once
        return session

    def keep(self, session: Session) -> None:
        """A stream ended keeping its session (a continuation's claim, if it had one, ends here)."""
        self.busy.discard(session.id)
        session.kept_at = self.clock()
        self.idle[session.id] = session
        self.ended.pop(session.id, None)
        self._tell(session.id, record(info=session.info))

    def restore(self, session: Session) -> None:
        """A claim given back (the continuation was refused before it queued): idle again, as it was."""
        self.busy.discard(session.id)
        self.idle[session.id] = session
        self.idle = OrderedDict(sorted(self.idle.items(), key=lambda kv: kv[1].kept_at))
        self._tell(session.id, record(info=session.info))

    def release(self, ident: str, why: str) -> None:
        """A claimed session ends with its continuation (failed, cancelled, or it did not keep)."""
        self.busy.discard(ident)
        self._remember(ident, why)

    def end(self, ident: str, why: str) -> Session:
        """Take an idle session out (`why`: "expired: ...", "evicted: ..." (counted), "ended: ...") → it, for the caller to free its pages."""
        session = self.idle.pop(ident)
        if why.startswith("evicted"):
            self.evictions += 1
        self._remember(ident, why)
        return session

    def expired(self) -> list[str]:
        now = self.clock()
        return [i for i, s in self.idle.items() if now - s.kept_at >= self.ttl_s]

    def oldest(self) -> str | None:
        return next(iter(self.idle), None)

    def _remember(self, ident: str, why: str) -> None:
        self.ended[ident] = why
        self.ended.move_to_end(ident)
        self._tell(ident, record(ended=why))
        while len(self.ended) > ENDED_MEMORY:
            self._tell(self.ended.popitem(last=False)[0], None)

    def _tell(self, ident: str, text: str | None) -> None:
        if self.on_record is not None:
            self.on_record(ident, text)


def record(info: SessionInfo | None = None, busy: bool = False, ended: str = "") -> str:
    """A session's record as other processes read it (`kept_params`)."""
    if info is not None:
        return json.dumps({"state": "idle", "info": info.encode()})
    return json.dumps({"state": "busy"} if busy else {"state": "ended", "why": ended})


def record_live(text: str | None) -> bool:
    """A record's session is live (idle, or being continued)."""
    return text is not None and json.loads(text)["state"] != "ended"


def kept_params(ident: str, text: str | None) -> SessionInfo:
    """The idle session a continuation names, from its record (None: none) → its info; a RequestError naming
    `session` when it is not idle (what the engine would answer, said before any work)."""
    if text is None:
        raise RequestError("session", f"{ident} is unknown")
    raw = json.loads(text)
    if raw["state"] == "busy":
        raise RequestError("session", f"{ident} is already being continued by another request")
    if raw["state"] == "ended":
        raise RequestError("session", f"{ident} has ended ({raw['why']})")
    return SessionInfo.decode(raw["info"])
