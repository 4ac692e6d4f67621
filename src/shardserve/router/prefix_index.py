"""What the router believes one replica holds in its prefix cache, page by page.

A page is named by its chained digest (kvcache/pages.py: BLAKE2b of the parent page's digest and
the page's tokens), so a digest stands for its whole prefix and this set of digests *is* a prefix
tree: the path from the root to a node is implied by the node's name. The longest cached prefix
of a prompt is the number of its leading page digests present here, one probe per page.

A page is `pending` from the moment a request carrying it is sent (the replica will compute it)
until the request finishes, and `stored` once the replica reports it cached, until the replica
reports it evicted (cache events). A request that ends before its pages were stored (aborted,
refused) withdraws its pending claims, so the router never credits a replica with pages it has not
got. Without events (a standalone router in front of foreign servers) pages are stored once the
worker answers (2xx, or a stream's first event) and `max_pages` bounds the set, least recently
used first out, approximating the worker's own eviction.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixIndex:
    def __init__(self, max_pages: int | None = None):
        self.stored: OrderedDict[bytes, None] = OrderedDict()  # LRU order: oldest first
        self.pending: dict[bytes, int] = {}  # digest -> requests in flight that carry it
        self.max_pages = max_pages

    def __len__(self) -> int:
        """Pages held or being computed (a page both stored and still pending counts twice: this
        only ranks replicas by how full their caches are)."""
        return len(self.stored) + len(self.pending)

    def match(self, pages: list[bytes]) -> int:
        """How many leading pages of a prompt this replica holds (or is computing).

        A pure probe: every replica is asked, but only the one the request goes to uses its pages,
        so recency is refreshed by `claim`/`store`, not here."""
        n = 0
        for p in pages:
            if p not in self.stored and p not in self.pending:
                break
            n += 1
        return n

    def claim(self, pages: list[bytes], confirmed: bool = False) -> list[bytes]:
        """Credit a sent request's pages; returns those claimed as pending (to `unclaim` later)."""
        if confirmed:
            self.store(pages)
            return []
        claimed = [p for p in pages if p not in self.stored]
        for p in claimed:
            self.pending[p] = self.pending.get(p, 0) + 1
        return claimed

    def unclaim(self, pages: list[bytes]) -> None:
        for p in pages:
            left = self.pending.get(p, 0) - 1
            if left > 0:
                self.pending[p] = left
            else:
                self.pending.pop(p, None)

    def store(self, pages: list[bytes]) -> None:
        """Record a prompt's pages as held, most recently used. Last page first, so its first page
        ends up the newest: the LRU bound then drops a prompt's tail before its head (a tail
        without its head never matches) -- as the worker's allocator frees a sequence's later pages
        first."""
        for p in reversed(pages):
            self.stored[p] = None
            self.stored.move_to_end(p)
        if self.max_pages is not None:
            while len(self.stored) > self.max_pages:
                self.stored.popitem(last=False)

    def evict(self, pages: list[bytes]) -> None:
        for p in pages:
            self.stored.pop(p, None)

    def clear(self) -> None:
        """Forget every stored page (events were lost: believe nothing rather than too much)."""
        self.stored.clear()
