"""Test hooks, off unless the environment variable COSMOS3_FAULTS is set (comma-separated key=value):

  step_delay_s=<float>    every engine tick first sleeps this long (tiny models step in milliseconds;
                          this gives served tests the step time of a real model)
  fail_step_seed=<int>    a request with this seed raises inside its denoise step (fails that request only)
  fail_decode_seed=<int>  a request with this seed raises in vae_decode's send thread, on its last piece

Read once at import; production servers never set it.
"""

from __future__ import annotations

import os


def _parse(raw: str) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in raw.split(",") if item.strip())
    return {k.strip(): v.strip() for k, v in pairs}


FAULTS = _parse(os.environ.get("COSMOS3_FAULTS", ""))
STEP_DELAY_S = float(FAULTS.get("step_delay_s", 0.0))
FAIL_STEP_SEED = int(FAULTS["fail_step_seed"]) if "fail_step_seed" in FAULTS else None
FAIL_DECODE_SEED = int(FAULTS["fail_decode_seed"]) if "fail_decode_seed" in FAULTS else None


class InjectedFault(RuntimeError):
    pass
