"""`cosmos3_requests_total{outcome}`: how each request the server took ended, counted once, by the one stage where
it ended. docs/metrics.md gives the identity these counters keep and what each outcome means.

Who counts what (each stage under its own `model` label; the server merges the families, same name and kind):
  cosmos3_admit       rejected (over capacity, shutting down)
  cosmos3_prefill     bad_input, failed, rejected (a later stage is down); refused (the text guardrail's)
  cosmos3_denoise     rejected (queue full, draining), bad_input (what only the engine checks), cancelled, failed,
                      refused: a request its engine ended (the reason vae_decode gave it to stop, if any); failed: a
                      request whose pieces were decoding when vae_decode died
  cosmos3_vae_decode  a request whose engine part ended with its last piece: completed, cancelled (during the decode),
                      failed, refused (the video guardrail's); failed or cancelled: a request whose denoise died
lifecycle.py decides each count.

`count` only bumps a plain counter under a lock (a thread that must not wait on the server: the door's execute);
`publish` hands the increments to Triton (the door's thread every 0.05 s, the engine's metrics thread); `count_now`
does both, where each answer that ends a request goes out: prefill's execute, decode's threads, denoise's responder
and holder (the engine thread never talks to the server). A stub killed loses only what it had not published.
Only imported inside a Triton Python stub.
"""

from __future__ import annotations

import threading

import triton_python_backend_utils as pb_utils

NAME = "cosmos3_requests_total"
DESCRIPTION = "Requests ended, by outcome"  # every stage registers the family with this same text
OUTCOMES = ("completed", "cancelled", "failed", "rejected", "bad_input", "refused")  # all, as docs/metrics.md
# what each stage counts (the door counts its own `rejected`, door.py; prefill's guardrail its `refused`)
AT_PREFILL = ("bad_input", "failed", "rejected")
AT_DENOISE = ("rejected", "bad_input", "cancelled", "failed", "refused")
AT_DECODE = ("completed", "cancelled", "failed", "refused")


class Outcomes:
    """The counters of the outcomes one stage counts (`outcomes`), under its labels."""

    def __init__(self, labels: dict[str, str], outcomes: tuple[str, ...]):
        self._family = pb_utils.MetricFamily(name=NAME, description=DESCRIPTION, kind=pb_utils.MetricFamily.COUNTER)
        self._metrics = {k: self._family.Metric(labels={**labels, "outcome": k}) for k in outcomes}
        self._pending = dict.fromkeys(outcomes, 0)
        self._lock = threading.Lock()

    def count(self, outcome: str) -> None:
        with self._lock:
            self._pending[outcome] += 1

    def publish(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, dict.fromkeys(self._pending, 0)
        for k, n in pending.items():
            if n:
                self._metrics[k].increment(n)

    def count_now(self, outcome: str) -> None:
        """From a thread that may talk to the server (prefill's execute, decode's responder)."""
        self.count(outcome)
        self.publish()
