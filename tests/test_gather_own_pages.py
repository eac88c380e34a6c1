"""FlashInfer's gather (`attention.gather_layout` / `gather_kv`) reads only K/V of the pack's own prefixes.

The gather's prefix capacity is a power of two (at least 8,192 tokens), far more than a pack's text: the unused
entries fill the kv rows after the last request's keys, which FA3 reads in its last request's final K/V tile and
multiplies by a probability of 0 — a NaN there is NaN in that request's rows, and from there (its padding rows' K/V
in the next layer) in the last segment of the pack. Those entries copied pool token 0 (page 0), a page no request
of the pack need hold: stale K/V of any earlier request (a failed one's NaN) then blackened the last request of
every later pack, whatever it was (served Nano, every GPU matrix cell after the first failing pack).
"""

from __future__ import annotations

import torch

from cosmos3_core.attention import gather_kv, gather_layout, prefix_capacity, unpack_index
from cosmos3_core.kv_pool import KVPool
from cosmos3_core.rows import Segment


def test_the_gather_reads_no_page_outside_the_pack():
    pool = KVPool(64, 4, 1, 2, 8, torch.float32, "cpu")
    stale = pool.alloc(5)  # pages 0-1: an earlier request's, freed below with NaN K/V left in them
    texts = [pool.alloc(n) for n in (7, 3)]
    pool.free(stale)
    pool.k_pages.fill_(float("nan"))
    pool.v_pages.fill_(float("nan"))
    for t in texts:  # only the pack's own prefix tokens are K/V
        pool.write(t, torch.randn(1, t.num_tokens, 2, 8), torch.randn(1, t.num_tokens, 2, 8))
    segments = [Segment(0, 50, (texts[0],), False), Segment(64, 30, (texts[1],), False)]
    rows = 128
    layout = gather_layout(segments, rows, pool.page_size, prefix_capacity(segments))
    index = unpack_index(layout.packed(), rows)
    own = torch.randn(rows, 2, 8)
    for pages in (pool.k_pages[0], pool.v_pages[0]):
        buf = gather_kv(own, pages, *index)
        assert buf.isfinite().all(), f"{int(buf.isnan().any(dim=(1, 2)).sum())} kv rows read a page outside the pack"
