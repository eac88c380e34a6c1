"""The server's metrics page (Prometheus text, tritonserver's `/metrics` behind the front) as the benchmarks and
tests read it: `scrape(port)` fetches it, `samples(text, name)` lists a metric's samples with their labels, and
`total(text, name, **labels)` sums the samples whose labels match."""

from __future__ import annotations

import re
import urllib.request

_SAMPLE = re.compile(r"^(\w+)\{([^}]*)\} (\S+)$", re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def scrape(port: int, timeout_s: float = 5.0) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s).read().decode()


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of each sample of metric `name` in `text`."""
    return [(dict(_LABEL.findall(m.group(2))), float(m.group(3))) for m in _SAMPLE.finditer(text)
            if m.group(1) == name]  # fmt: skip


def total(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (every model and instance that exports it)."""
    return sum(v for got, v in samples(text, name) if all(got.get(k) == want for k, want in labels.items()))
