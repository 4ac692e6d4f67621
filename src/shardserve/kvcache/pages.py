"""Page allocation with reference counts and a prefix cache of chained page digests.

A full page's digest is BLAKE2b(parent page's digest + its tokens as bytes), so equal digests
mean equal whole prefixes, and the digest of a prefix is the same in every process and on every
machine (Python's `hash()` is not, before 3.12: other processes, such as a router, could not
follow it). A hit is still checked: each cached page keeps its parent digest and its tokens, and
a lookup takes a page only if both equal the request's, so even a digest collision never hands
out another prompt's KV (nano-vllm checks a block's tokens the same way).

Pages whose reference count drops to zero are not wiped: they join an LRU queue with their
digest intact, where a later request with the same prefix can take them back (a cache hit), and
from whose front allocation evicts when no never-used page is left. This is the chained-hash
design of vLLM's v1 block manager rather than a radix tree: lookups are one dict probe per page
and eviction order falls out of the free queue.

Under context parallelism the allocator serves N pools at once (`parts`, one per context rank):
page id `part * pages_per_part + local page`, so plans, prefix hits and digests keep one global
id per page while each pool has its own free queue. Which pool a request's next page comes from
is `kvcache/spread.py`'s rule.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from shardserve.kvcache.spread import place

ROOT = b""  # the parent digest of a sequence's first page


def page_digest(parent: bytes, tokens: list[int] | tuple[int, ...]) -> bytes:
    """16 bytes naming a page's content and everything before it; stable across processes."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def page_hashes(tokens: list[int], page_size: int, parent: bytes = ROOT) -> list[bytes]:
    """Digests of every full page of `tokens`, each chained to the one before."""
    out = []
    for i in range(0, len(tokens) - page_size + 1, page_size):
        parent = page_digest(parent, tokens[i : i + page_size])
        out.append(parent)
    return out


class PageAllocator:
    """Hands out page ids; with `prefix_cache` it also remembers full pages by content hash."""

    def __init__(self, num_pages: int, page_size: int, prefix_cache: bool = True, parts: int = 1):
        """`num_pages` in all; with `parts` > 1 they are that many equal pools (context ranks)."""
        if num_pages % parts:
            raise ValueError(f"{num_pages} pages do not split into {parts} equal pools")
        self.num_pages, self.page_size, self.prefix_cache = num_pages, page_size, prefix_cache
        self.parts, self.pages_per_part = parts, num_pages // parts
        self.refs = [0] * num_pages
        per = self.pages_per_part
        self.pools: list[OrderedDict[int, None]] = [OrderedDict.fromkeys(range(i * per, (i + 1) * per))
                                                    for i in range(parts)]
        self.hash_of: dict[int, bytes] = {}  # page -> digest
        self.page_of: dict[bytes, int] = {}  # digest -> page
        self.content: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # page -> (parent digest, tokens)
        self.hits = self.queries = 0  # prompt tokens served from / asked of the cache
        # Cache events for a router (`watch_events`): digest -> True (now cached) or False (evicted)
        # since the last take. Only a digest's last change matters, so a page evicted and then
        # recomputed within one step reads as stored, and the reverse as evicted.
        self.events: dict[bytes, bool] | None = None

    def watch_events(self) -> None:
        """Record every page digest that joins or leaves the cache, for `take_events`."""
        self.events = {}

    def take_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, evicted) digests since the last call: each digest's net change, so the two
        lists never share a digest and may be applied in either order."""
        if not self.events:
            return [], []
        stored = [h for h, cached in self.events.items() if cached]
        evicted = [h for h, cached in self.events.items() if not cached]
        self.events = {}
        return stored, evicted

    def _event(self, digest: bytes, cached: bool) -> None:
        if self.events is not None:
            self.events.pop(digest, None)
            self.events[digest] = cached

    @property
    def num_free(self) -> int:
        return sum(len(pool) for pool in self.pools)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def part_of(self, page: int) -> int:
        return page // self.pages_per_part

    def free_in(self, part: int) -> int:
        return len(self.pools[part])

    def allocate(self, n: int, part: int = 0) -> list[int] | None:
        """n pages of pool `part`, or None (and nothing taken) if fewer than n are free there."""
        pool = self.pools[part]
        if n > len(pool):
            return None
        pages = []
        for _ in range(n):
            page, _ = pool.popitem(last=False)
            self._forget(page)
            self.refs[page] = 1
            pages.append(page)
        return pages

    def grow(self, pages: list[int], need: int) -> list[int] | None:
        """`need` more pages for a sequence that holds `pages`: from the one pool, or under context
        parallelism from the pools `spread.place` picks. None (nothing taken) if they are short."""
        if self.parts == 1:
            return self.allocate(need)
        held = [0] * self.parts
        for page in pages:
            held[self.part_of(page)] += 1
        return self.allocate_parts(place(held, [len(pool) for pool in self.pools], need))

    def extend_to(self, pages: list[int], num_tokens: int) -> bool:
        """Grow a sequence's page list in place to hold `num_tokens` tokens (`grow`'s pools);
        False, and the list unchanged, if the pages are short."""
        need = -(-num_tokens // self.page_size) - len(pages)
        if need <= 0:
            return True
        more = self.grow(pages, need)
        if more is None:
            return False
        pages.extend(more)
        return True

    def truncate(self, pages: list[int], num_tokens: int) -> int:
        """Release, in place, the pages past the first `num_tokens` tokens; how many are kept."""
        keep = -(-num_tokens // self.page_size)
        self.release(pages[keep:])
        del pages[keep:]
        return keep

    def allocate_parts(self, parts: list[int]) -> list[int] | None:
        """One page from each listed pool, in order (a request's next pages, `spread.place`), or
        None and nothing taken if any pool is short."""
        need = [parts.count(p) for p in range(self.parts)]
        if any(n > self.free_in(p) for p, n in enumerate(need)):
            return None
        taken = {p: iter(self.allocate(n, p)) for p, n in enumerate(need) if n}
        return [next(taken[p]) for p in parts]

    def release(self, pages: list[int], forget_from: int | None = None) -> None:
        """Drop one reference to each page; later pages go to the queue first so they are evicted
        before the earlier (more widely shared) pages of the same prefix. `forget_from`: a failed
        request's first page of its own computing; from there on its KV may be wrong, so those
        pages leave the prefix cache (those it took from the cache stay)."""
        for i in range(len(pages) - 1, -1, -1):
            page = pages[i]
            if forget_from is not None and i >= forget_from:
                self._forget(page)
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.pools[self.part_of(page)][page] = None

    def match_prefix(self, tokens: list[int], root: bytes = ROOT) -> list[int]:
        """Take a reference to the cached pages holding the longest prefix of `tokens`.

        At least one token is always left uncached, since the last prompt token's logits are
        needed to sample. `root`: the chain's start (a LoRA adapter's, so adapters never share)."""
        if not self.prefix_cache:
            return []
        pages, parent, size = [], root, self.page_size
        for i, h in enumerate(page_hashes(tokens[: len(tokens) - 1], size, root)):
            page = self.page_of.get(h)
            # A digest match must also be a content match: never serve a colliding page.
            if page is None or self.content[page] != (parent, tuple(tokens[i * size : (i + 1) * size])):
                break
            pages.append(page)
            parent = h
        for page in pages:
            if self.refs[page] == 0:
                del self.pools[self.part_of(page)][page]
            self.refs[page] += 1
        return pages

    def record_lookup(self, num_tokens: int, num_hit: int) -> None:
        """Count one admitted prompt for the hit rate (a failed admission is not a lookup)."""
        self.queries += num_tokens
        self.hits += num_hit

    def register(self, tokens: list[int], pages: list[int], num_computed: int, chain: list[int],
                 root: bytes = ROOT) -> None:
        """Publish the full pages among the first `num_computed` tokens.

        `chain` is the caller's list of this sequence's page hashes so far; it is extended in
        place, so each page is hashed once in its lifetime."""
        if not self.prefix_cache:
            return
        full = num_computed // self.page_size
        if full <= len(chain):
            return
        start = len(chain) * self.page_size
        size = self.page_size
        chain.extend(page_hashes(tokens[start : full * size], size, chain[-1] if chain else root))
        for i in range(start // size, full):
            page, h = pages[i], chain[i]
            if page in self.hash_of or h in self.page_of:
                continue  # already known, or the same content (or a colliding one) lives in another page
            self.hash_of[page], self.page_of[h] = h, page
            self.content[page] = (chain[i - 1] if i else root, tuple(tokens[i * size : (i + 1) * size]))
            self._event(h, True)

    def _forget(self, page: int) -> None:
        h = self.hash_of.pop(page, None)
        if h is not None:
            del self.page_of[h]
            del self.content[page]
            self._event(h, False)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
