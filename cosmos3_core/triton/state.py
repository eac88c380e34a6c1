"""`ServerState(state_dir)`: every fact that crosses between the processes of one server (the supervisor and the
Triton stubs of the door, prefill, denoise and vae_decode), and the only code that touches its folder.

The processes share no memory and Triton gives them no channel besides a request's tensors, so each fact is a file
under `<workdir>/state` (per server: `serve.render` gives each its own and wipes it at start). One method per fact:

| fact | files | written by | read by |
|---|---|---|---|
| a stream must stop: `stop(id, why)` "cancelled" (the client left) or a piece that did not decode ("failed", "refused") | `stop/<id>` (why) | vae_decode (it sees the cancel: Triton cancels only the steps it schedules after it) | the denoise engine, between ticks (`stop_reason`) |
| decode is done with a stream's frames: `finish(id)` | `finished/<id>` | vae_decode (once its last piece's frames are out, or at the stop) | denoise, which then sends the stream's FINAL with its `end` step (`finished`) |
| a part is dead or reloading: `mark_down` / `mark_up` | `down/<part>` | the supervisor (up only once the new stub answers) | the door and prefill (refuse), the denoise engine (ends its streams when vae_decode is down), the front (readiness): `down_parts` |
| when a part last died: `mark_down` writes it, `died_at(part)` | `died/<part>` (epoch seconds) | the supervisor | denoise and vae_decode: a request that arrived before it has its steps of that part in the dead instance (an ensemble request keeps the model instances it started with), so the survivor answers it |
| the server drains: `drain` | `DRAINING` (until the server's next start: `reset`) | the supervisor (SIGINT / SIGTERM) | the door, prefill and the engine (admit nothing new, through tritonserver's own stop) |
| an engine is busy: `set_busy(instance, busy)` | `busy/<instance>` | each denoise instance: before its engine takes a request, and once it holds none | the supervisor's drain (`idle`) |
| admission tickets: `take`, `claim`, `release`, `held` | `tickets/<id>.door`, `.engine` | the door (take), prefill (release on its error), denoise (claim, release at the first event) | the door (`held`): admission.py; the supervisor's drain (`idle`): a request past the door that no engine holds yet |
| an instance's first load in this server's life is done: `prove_peak(instance, note)` / `proven_peak(instance)` | `proven/<instance>` (the note: a denoise instance's step layouts, JSON) | each prefill, denoise and vae_decode instance, once loaded (on the GPU, after its warmup at the largest admitted request) | the same instance reloaded after a death: the plan and the card are unchanged, so it skips that warmup; a denoise instance takes the graph buckets and padding limit it settled on then |
| one part warms up at a time: `warmup_turn()` | `warmup.lock` (an exclusive lock) | prefill, denoise and vae_decode, around their warmups (each reaches its peak, then gives its cached memory back) | the same |
| an AR session's record: `set_session(id, record)` (idle with its parameters, busy, ended and why; None: forgotten) | `sessions/<id>` (sessions.record) | the denoise engine's session table, on each change | prefill (checks a continuation: sessions.kept_params), vae_decode (lets go of an ended session's decoder) |

A stream's facts are dropped by whoever ends it (`forget`): vae_decode at its last step, denoise when vae_decode died.
Stream ids and part names are alphanumeric (`_` allowed in part and instance names).

Stdlib only: the supervisor and the door's stub import it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

# A `.door` ticket older than this is a request that never reached the engine (cancelled between two steps).
# Legitimately a request spends at most max_queue prefills there (well under a minute on any deployment): an expired
# live one only lets the door admit one more, which the engine's own queue limit still bounds.
DOOR_TTL_S = 120.0

_NAME = re.compile(r"\w+")


def _name(value: str) -> str:
    if not _NAME.fullmatch(value):
        raise ValueError(f"a state name must be alphanumeric, got {value!r}")
    return value


def _write(path: Path, text: str) -> None:
    """Whole or not at all: a reader never sees half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class ServerState:
    def __init__(self, state_dir: str | Path):
        self.dir = Path(state_dir)
        for sub in ("stop", "finished", "down", "died", "busy", "tickets", "proven"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def warmup_turn(self) -> Iterator[None]:
        """Held while a part runs its warmup: the parts load at once, but reach their peaks one after another (each
        gives its cached memory back before the next starts), so loading never holds every part's peak together."""
        with open(self.dir / "warmup.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def prove_peak(self, part: str, note: str = "") -> None:
        _write(self.dir / "proven" / _name(part), note)

    def proven_peak(self, part: str) -> str | None:
        """The note of instance `part`'s first load in this server's life ("" without one), or None before it."""
        try:
            return (self.dir / "proven" / _name(part)).read_text()
        except FileNotFoundError:
            return None

    def reset(self) -> None:
        """A new server: nothing of a previous run's (serve.render, before any stub starts)."""
        shutil.rmtree(self.dir, ignore_errors=True)
        self.__init__(self.dir)

    # ---- streams: vae_decode → denoise ----
    def stop(self, stream: str, why: str) -> None:
        (self.dir / "stop" / _name(stream)).write_text(why)

    def stop_reason(self, stream: str) -> str | None:
        try:
            return (self.dir / "stop" / _name(stream)).read_text() or "cancelled"
        except FileNotFoundError:
            return None

    def finish(self, stream: str) -> None:
        (self.dir / "finished" / _name(stream)).touch()

    def finished(self, stream: str) -> bool:
        return (self.dir / "finished" / _name(stream)).exists()

    def forget(self, stream: str) -> None:
        for sub in ("stop", "finished"):
            (self.dir / sub / _name(stream)).unlink(missing_ok=True)

    # ---- parts: the supervisor → everyone ----
    def mark_down(self, part: str) -> None:
        """`part`'s stub died (now, or a moment ago): every request that arrived before now has its steps of that part
        in the dead instance."""
        _write(self.dir / "died" / _name(part), repr(time.time()))
        (self.dir / "down" / _name(part)).touch()

    def died_at(self, part: str) -> float | None:
        """When the supervisor last saw `part`'s stub dead (epoch seconds), or None."""
        try:
            return float((self.dir / "died" / _name(part)).read_text())
        except (FileNotFoundError, ValueError):
            return None

    def mark_up(self, part: str) -> None:
        (self.dir / "down" / _name(part)).unlink(missing_ok=True)

    def down_parts(self) -> list[str]:
        """The parts down now, in the order they went down."""
        entries = [(e.stat().st_mtime_ns, e.name) for e in os.scandir(self.dir / "down")]
        return [name for _, name in sorted(entries)]

    def is_down(self, part: str) -> bool:
        return (self.dir / "down" / _name(part)).exists()

    # ---- drain: the supervisor → the door, prefill and the engine ----
    def drain(self) -> None:
        (self.dir / "DRAINING").touch()

    def draining(self) -> bool:
        return (self.dir / "DRAINING").exists()

    # ---- engines: denoise → the supervisor's drain ----
    def set_busy(self, instance: str, busy: bool) -> None:
        path = self.dir / "busy" / _name(instance)
        if busy:
            path.touch()
        else:
            path.unlink(missing_ok=True)

    def idle(self, tickets: bool = True) -> bool:
        """No denoise instance holds a request (waiting, denoised, or its pieces still decoding) and, with `tickets`,
        none past the door holds an admission ticket (from the door until the engine's first event for it)."""
        return (not tickets or self.held() == 0) and not any(os.scandir(self.dir / "busy"))

    # ---- admission tickets (admission.py): door, prefill, denoise ----
    def _ticket(self, ident: str, where: str) -> Path:
        return self.dir / "tickets" / f"{_name(ident)}.{where}"

    def take(self, limit: int, n: int = 1) -> list[tuple[str, float]]:
        """(id, arrival) for up to `n` new requests, as many as keep `limit` or fewer tickets held: one count for a
        whole batch of arrivals. The requests beyond them are refused by the caller."""
        fd = os.open(self.dir / "tickets" / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # several door instances: counting and taking are one step
            now = time.time()
            taken = [(uuid.uuid4().hex, now) for _ in range(max(0, min(n, limit - self.held())))]
            for ident, _ in taken:
                self._ticket(ident, "door").touch()
            return taken
        finally:
            os.close(fd)

    def held(self) -> int:
        """Tickets held now; expired `.door` ones are dropped first."""
        count, expired = 0, time.time() - DOOR_TTL_S
        for entry in os.scandir(self.dir / "tickets"):
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
            os.replace(self._ticket(ident, "door"), self._ticket(ident, "engine"))
        except FileNotFoundError:
            self._ticket(ident, "engine").touch()

    def release(self, ident: str) -> None:
        """The request stopped waiting (it is being denoised, or it ended)."""
        for where in ("door", "engine"):
            self._ticket(ident, where).unlink(missing_ok=True)

    def clear_tickets(self, where: str) -> None:
        """Drop every ticket held at `where` ("door" or "engine"): the model that holds such requests is starting, so
        those of a dead incarnation never end (Triton answers nothing for a dead decoupled stub's requests)."""
        for entry in os.scandir(self.dir / "tickets"):
            if entry.name.endswith(f".{where}"):
                Path(entry.path).unlink(missing_ok=True)

    # ---- AR sessions: the denoise engine → prefill and vae_decode ----
    def set_session(self, ident: str, record: str | None) -> None:
        folder = self.dir / "sessions"
        folder.mkdir(exist_ok=True)
        path = folder / _name(ident)
        if record is None:
            path.unlink(missing_ok=True)
            return
        tmp = folder / f".{ident}.{os.getpid()}"  # whole or not at all: a reader never sees half of it
        tmp.write_text(record)
        os.replace(tmp, path)

    def session(self, ident: str) -> str | None:
        try:
            return (self.dir / "sessions" / _name(ident)).read_text()
        except FileNotFoundError:
            return None

    def clear_sessions(self) -> None:
        """A denoise instance is starting: a previous one's sessions are gone with its pages."""
        shutil.rmtree(self.dir / "sessions", ignore_errors=True)
