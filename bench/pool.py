"""Run a function over items with a fixed number of client threads (the load generators' common loop)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any


def run_pool(items: Iterable[Any], concurrency: int, fn: Callable[[Any], Any]) -> list[Any]:
    """fn(item) for every item, `concurrency` at a time; results in completion order."""
    todo, lock, results = list(items), threading.Lock(), []

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                item = todo.pop(0)
            result = fn(item)
            with lock:
                results.append(result)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results
