"""What each Python stub of ours does first, before it imports torch or the package's models: `utf8_locale()`.

Triton's Python backend embeds its interpreter without the locale set-up that the `python3` command does (PEP 538,
PEP 540): in the stub LC_CTYPE stays "C" whatever LANG says, UTF-8 mode is off even with PYTHONUTF8=1, and so every
`open()` without an encoding reads and writes ASCII. torch 2.13's Inductor reads its UTF-8 templates so: on the CPU a
deployment with `compile: true` failed to load ("'ascii' codec can't decode byte 0xe2", from `torch.compile`), and a
checkpoint's JSON or a config with any non-ASCII character would fail the same way. What the interpreter fixed at
its start stays ASCII (sys.stdout and sys.stderr, file names): only `open()`'s default changes. Stdlib only.
"""

from __future__ import annotations

import locale

# the environment's locale first (as `python3` sets it), then PEP 538's coercion targets
_CANDIDATES = ("", "C.UTF-8", "C.utf8", "UTF-8")


def utf8_locale() -> str:
    """Set LC_CTYPE as the `python3` command would (the environment's locale when it is UTF-8, else C.UTF-8) →
    the encoding `open()` uses from now on in this process (unchanged when no UTF-8 locale exists here)."""
    before = locale.setlocale(locale.LC_CTYPE)
    for name in _CANDIDATES:
        try:
            locale.setlocale(locale.LC_CTYPE, name)
        except locale.Error:
            continue
        if _is_utf8(locale.getpreferredencoding(False)):
            return locale.getpreferredencoding(False)
    locale.setlocale(locale.LC_CTYPE, before)
    return locale.getpreferredencoding(False)


def _is_utf8(encoding: str) -> bool:
    return encoding.lower().replace("-", "").replace("_", "") == "utf8"
