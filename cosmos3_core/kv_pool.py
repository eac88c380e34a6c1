"""Paged pool for per-layer text K/V (GEN-facing K, already normed and rotated; V).

Storage: `k_pages`, `v_pages` `[layers, num_pages, page_size, kv_heads, head_dim]`. A request holds one
`PageList` per CFG branch: the page ids in order and the token count. Allocation is exact: a branch of
n tokens holds ceil(n / page_size) pages, released by `free`. Thread contract: the engine thread is the
only caller; `pages_used` may be read from any thread (an int read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class PoolExhausted(RuntimeError):
    pass


@dataclass
class PageList:
    pages: list[int]
    num_tokens: int
    index: torch.Tensor | None = None  # the page ids on the pool's device, made once (no per-step host copy)


class KVPool:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (num_layers, num_pages, page_size, kv_heads, head_dim)
        self.k_pages = torch.zeros(shape, dtype=dtype, device=device)
        self.v_pages = torch.zeros(shape, dtype=dtype, device=device)
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    @property
    def pages_free(self) -> int:
        return len(self._free)

    @property
    def pages_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, num_tokens: int) -> PageList:
        need = self.pages_for(num_tokens)
        if need > len(self._free):
            raise PoolExhausted(f"need {need} pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(need)]
        return PageList(pages, num_tokens, torch.tensor(pages, dtype=torch.long).to(self.k_pages.device))

    def free(self, page_list: PageList) -> None:
        self._free.extend(reversed(page_list.pages))
        page_list.pages = []
        page_list.num_tokens = 0
        page_list.index = None

    def write(self, page_list: PageList, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [layers, num_tokens, kv_heads, head_dim] for exactly `page_list.num_tokens` tokens."""
        n, ps = page_list.num_tokens, self.page_size
        for i, page in enumerate(page_list.pages):
            lo, hi = i * ps, min(n, (i + 1) * ps)
            self.k_pages[:, page, : hi - lo] = k[:, lo:hi]
            self.v_pages[:, page, : hi - lo] = v[:, lo:hi]

    def gather(self, layer: int, page_list: PageList) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's K, V for a branch: [num_tokens, kv_heads, head_dim] each (reference path)."""
        idx, n = page_list.index, page_list.num_tokens
        return self.k_pages[layer, idx].flatten(0, 1)[:n], self.v_pages[layer, idx].flatten(0, 1)[:n]
