"""The texts a client can get when a part of the server dies, restarts or drains: one text per cause, saying what
happened and whether to retry. The stubs send them as Triton errors (gRPC), the supervisor's readiness answers them
in its 503 body, and the client prints them; `client_text` turns what Triton or gRPC say themselves about the same
causes into the same texts. docs/operations.md tables them.

Pure stdlib: the client, the supervisor and the stubs import it.

A part is one Python model of the ensemble, named without its `cosmos3_` prefix (`denoise` is `cosmos3_denoise`);
the supervisor marks a dead part down in the server's state (triton/state.py) until it is loaded again, so that the
stubs still alive can answer for it.
"""

from __future__ import annotations

import re

PARTS = ("admit", "prefill", "denoise", "vae_decode")  # the ensemble's steps, in order
# what a part's reload took on the tiny default on a loaded 2-core machine: 21-29 s (docs/operations.md; the goal is
# 10 s). The text tells clients the measured figure, not the goal
RETRY_PART_S = 30
RETRY_SERVER_S = 30

# The one text of a refusal for load, the same on every replica: a client or a mesh retries it elsewhere.
OVER_CAPACITY = "over capacity: the server's queue is full; retry later or on another replica"
STARTING = "the server is starting (its models are loading); retry in a few seconds"
SERVER_RESTARTING = f"tritonserver is restarting after it exited; retry in about {RETRY_SERVER_S} s"
DRAINING = "the server is shutting down (draining): it admits no new requests; retry on another server or later"


def model_of(part: str) -> str:
    return f"cosmos3_{part}"


def part_of(model_or_instance: str) -> str | None:
    """`cosmos3_denoise` or its instance `cosmos3_denoise_0_0` → `denoise`; None for anything else."""
    model = re.sub(r"_\d+_\d+$", "", model_or_instance)
    return model.removeprefix("cosmos3_") if model.startswith("cosmos3_") and model != "cosmos3_" else None


def part_died(part: str) -> str:
    """For a request in flight in (or still needing) a part whose process died."""
    return (
        f"{model_of(part)} died while this request needed it (its process ended); it restarts by itself: "
        f"retry in about {RETRY_PART_S} s"
    )


def part_restarting(part: str) -> str:
    """For a new request while a part reloads (and the readiness body meanwhile)."""
    return f"{model_of(part)} is restarting after its process died; retry in about {RETRY_PART_S} s"


def part_stopped(part: str) -> str:
    """For a request still in a part when that part is unloaded (the server stopping)."""
    return f"{model_of(part)} stopped before this request finished (the server is stopping); retry on another server"


def drain_timeout(seconds: float) -> str:
    return (
        f"the server is shutting down and this request did not finish within its {seconds:g} s drain timeout; "
        "retry on another server or later"
    )


def unreachable(url: str) -> str:
    return (
        f"cannot reach the server at {url} (connection refused or closed): none is running there (start one: "
        f"make serve), or it is restarting (retry in about {RETRY_SERVER_S} s)"
    )


# What Triton 2.51 says itself when a step reaches a dead Python stub (before the supervisor has marked it).
_DEAD_STUB = re.compile(r"(?:Stub process|model instance) '(cosmos3_\w+?)_\d+_\d+'.*not healthy", re.S)
# What tritonclient / gRPC say when the server went away under a stream, or was never there.
_GONE = ("Socket closed", "Stream removed", "failed to connect", "Connection refused", "StatusCode.UNAVAILABLE",
         "The stream is no longer in valid state", "Broken pipe")  # fmt: skip
_ENSEMBLE_PREFIX = re.compile(r"^in ensemble '[^']*', ")
_QUEUE_FULL = "Exceeds maximum queue size"  # what Triton says when a model's queue policy refuses


def client_text(message: str, url: str) -> str:
    """The table's text for an error as the client received it: ours unchanged (less Triton's "in ensemble" prefix),
    Triton's own words for a dead stub and gRPC's for a server gone → the text of that cause."""
    message = _ENSEMBLE_PREFIX.sub("", message.strip())
    dead = _DEAD_STUB.search(message)
    if dead and part_of(dead.group(1)):
        return part_died(part_of(dead.group(1)))  # type: ignore[arg-type]
    if _QUEUE_FULL in message:  # Triton's own refusal at the door's queue (model_repository/cosmos3_admit)
        return OVER_CAPACITY
    if any(s in message for s in _GONE):
        return unreachable(url)
    return message
