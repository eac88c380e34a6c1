"""Test hooks, off unless the environment variable COSMOS3_FAULTS is set (comma-separated key=value):

  step_delay_s=<float>    every engine tick first sleeps this long (tiny models step in milliseconds;
                          this gives served tests the step time of a real model)
  prefill_delay_s=<float> prefill first sleeps this long for each request (a served test's requests then sit
                          between the door and the denoise engine)
  fail_step_seed=<int>    a request with this seed raises inside its denoise step (fails that request only)
  fail_decode_seed=<int>  a request with this seed raises in vae_decode's send thread, on its last piece
  fail_forward=<int>      the n-th packed denoise forward after the warmup (1: the first served) raises, once (a
                          fault of the tick, not of one request: the engine must fail that tick's requests and heal)
  fail_capture=<int>      the n-th CUDA graph capture after the warmup raises inside the capture, once (the layout
                          must run that step eagerly and never capture again)
  check_finite=1          say on stderr ("cosmos3: check_finite: ...") where a request's values stop being finite:
                          prefill's outputs, the denoise model's inputs, the K/V admission writes to the pool, each
                          tick's outputs (with its layout), the decoder's input latents; the first CHECK_LINES of each
                          (a host sync at each: diagnostics only)

Read once at import; production servers never set it.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _parse(raw: str) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in raw.split(",") if item.strip())
    return {k.strip(): v.strip() for k, v in pairs}


FAULTS = _parse(os.environ.get("COSMOS3_FAULTS", ""))
STEP_DELAY_S = float(FAULTS.get("step_delay_s", 0.0))
PREFILL_DELAY_S = float(FAULTS.get("prefill_delay_s", 0.0))
FAIL_STEP_SEED = int(FAULTS["fail_step_seed"]) if "fail_step_seed" in FAULTS else None
FAIL_DECODE_SEED = int(FAULTS["fail_decode_seed"]) if "fail_decode_seed" in FAULTS else None


FAIL_FORWARD = int(FAULTS["fail_forward"]) if "fail_forward" in FAULTS else None
FAIL_CAPTURE = int(FAULTS["fail_capture"]) if "fail_capture" in FAULTS else None
CHECK_FINITE = FAULTS.get("check_finite") == "1"
_counts = {"forward": 0, "capture": 0}


class InjectedFault(RuntimeError):
    pass


def _nth(kind: str, n: int | None) -> None:
    if n is None:
        return
    _counts[kind] += 1
    if _counts[kind] == n:
        raise InjectedFault(f"injected fault in {kind} {n}")


def restart_counts() -> None:
    """The engine's warmup ends: `fail_forward` / `fail_capture` count served work from here."""
    _counts.update(dict.fromkeys(_counts, 0))


def maybe_fail_forward() -> None:
    _nth("forward", FAIL_FORWARD)


def maybe_fail_capture() -> None:
    _nth("capture", FAIL_CAPTURE)


def nonfinite(*tensors: torch.Tensor | None) -> int:
    """Non-finite elements in these tensors (None: none); a host sync each."""
    return sum(int((~t.isfinite()).sum()) for t in tensors if t is not None and t.is_floating_point())


CHECK_LINES = 4  # per site: the first non-finite values matter (and bench.matrix prints the log's last 20 lines)
_said: dict[str, int] = {}


def say(site: str, message: str, limit: int = CHECK_LINES) -> None:
    """`check_finite=1`: a stderr line "cosmos3: check_finite: <site> <message>", at most `limit` per site."""
    _said[site] = _said.get(site, 0) + 1
    if _said[site] <= limit:
        print(f"cosmos3: check_finite: {site} {message}", file=sys.stderr, flush=True)


def said(site: str) -> int:
    """How many times `say` was called for `site`."""
    return _said.get(site, 0)


def report_nonfinite(site: str, detail: str, **tensors: torch.Tensor | None) -> bool:
    """`say` which of the named tensors are not finite (nothing when all are) → whether any is not."""
    counts = {name: (n, t.numel()) for name, t in tensors.items() if t is not None and (n := nonfinite(t))}
    if counts:
        say(site, f"{detail}: " + ", ".join(f"{name} {n} of {total} non-finite" for name, (n, total) in counts.items()))
    return bool(counts)
