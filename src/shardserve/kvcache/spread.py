"""Which context rank's pool holds each of a request's pages (context parallelism).

A request's KV is spread over the N pools page by page (a page holds consecutive positions, so
the prefix cache's page digests work unchanged), and the rank that holds a page is the rank that
computes its tokens, so no KV ever moves after it is written. Two goals decide where a page goes:

- **Room**: every pool holds about 1/N of every request (at most one page more than another
  pool, unless prefix-cache hits arrived unevenly), so a context N times longer than one pool
  fits, and the request's admission limit is ceil(pages / N) per pool. New pages go to the pools
  holding the fewest of the request's pages; ties go to the pool with most free pages (keeping
  the pools balanced across requests), then the lower rank.
- **Work**: causal attention over a prefill chunk costs more for later tokens, so a chunk's new
  pages are laid out zigzag: rank r's first half early in the chunk and its second half late, in
  the order 0, 1, ..., N-1, N-1, ..., 1, 0 (the zigzag split of ring attention, at page grain).

A decode step adds at most one page, which goes where the room rule says.
"""

from __future__ import annotations


def place(held: list[int], free: list[int], need: int) -> list[int]:
    """The pools of a request's next `need` pages, in sequence order. `held[p]`: the request's
    pages already in pool p; `free[p]`: free pages of pool p."""
    n = len(held)
    counts, quota = list(held), [0] * n
    for _ in range(need):
        p = min(range(n), key=lambda i: (counts[i], quota[i] - free[i], i))
        counts[p] += 1
        quota[p] += 1
    early = [r for r in range(n) for _ in range(quota[r] - quota[r] // 2)]
    late = [r for r in reversed(range(n)) for _ in range(quota[r] // 2)]
    return early + late
