"""PageAllocator: reference counts, all-or-nothing allocation, prefix matching over chained page
hashes, LRU eviction of cached pages; and EngineCore.abort returning a request's pages."""

from __future__ import annotations

import pytest
import torch

from shardserve.config import EngineConfig
from shardserve.core import Status
from shardserve.kvcache.pages import PageAllocator, page_hashes
from shardserve.sampling_params import SamplingParams
from shardserve.scheduler.engine_core import EngineCore

PAGE = 4


def cached_sequence(alloc: PageAllocator, tokens: list[int], num_computed: int | None = None) -> list[int]:
    """Run one sequence through the allocator: take pages, publish full ones, free them all."""
    pages = alloc.allocate(-(-len(tokens) // alloc.page_size))
    assert pages is not None
    alloc.register(tokens, pages, len(tokens) if num_computed is None else num_computed, [])
    alloc.release(pages)
    return pages


# ----------------------------------------------------------------------------- allocation


def test_allocate_and_release_refcounts() -> None:
    alloc = PageAllocator(8, PAGE)
    pages = alloc.allocate(3)
    assert pages is not None and len(set(pages)) == 3
    assert [alloc.refs[p] for p in pages] == [1, 1, 1]
    assert (alloc.num_used, alloc.num_free) == (3, 5)
    more = alloc.allocate(2)
    assert more is not None and not set(more) & set(pages)
    alloc.release(pages)
    assert [alloc.refs[p] for p in pages] == [0, 0, 0]
    assert (alloc.num_used, alloc.num_free) == (2, 6)
    alloc.release(more)
    assert alloc.num_used == 0 and alloc.allocate(0) == []


def test_shared_page_freed_by_last_reference() -> None:
    alloc = PageAllocator(8, PAGE)
    tokens = list(range(9))
    pages = alloc.allocate(3)
    alloc.register(tokens, pages, 9, [])
    shared = alloc.match_prefix(tokens)  # a second sequence takes the two full pages
    assert shared == pages[:2] and [alloc.refs[p] for p in pages] == [2, 2, 1]
    alloc.release(pages)
    assert [alloc.refs[p] for p in pages] == [1, 1, 0] and alloc.num_used == 2
    alloc.release(shared)
    assert alloc.num_used == 0


def test_a_failed_request_leaves_the_prefix_cache_what_only_it_holds() -> None:
    """release(forget_from=k): the pages a failed request computed itself may hold what went wrong and are no
    longer served; those it took from the cache stay."""
    alloc = PageAllocator(8, PAGE)
    tokens = list(range(13))
    first = alloc.allocate(2)
    alloc.register(tokens[:8], first, 8, [])
    failing = alloc.match_prefix(tokens)  # shares the first two pages, then computes its own
    assert failing == first
    own = alloc.allocate(2)
    alloc.register(tokens, failing + own, 12, [])
    alloc.release(first)
    alloc.release(failing + own, forget_from=len(failing))
    assert alloc.match_prefix(tokens) == first  # its own full page is forgotten, the shared ones are not
    assert alloc.num_used == 2


def test_allocation_failure_takes_nothing() -> None:
    alloc = PageAllocator(5, PAGE)
    held = alloc.allocate(3)
    refs, free = list(alloc.refs), list(alloc.pools[0])
    assert alloc.allocate(3) is None
    assert alloc.refs == refs and list(alloc.pools[0]) == free
    assert alloc.allocate(2) is not None and alloc.allocate(1) is None
    alloc.release(held)
    assert alloc.num_free == 3


def test_failed_allocation_evicts_no_cached_page() -> None:
    alloc = PageAllocator(2, PAGE)
    cached_sequence(alloc, list(range(8)))
    hashes = dict(alloc.hash_of)
    assert len(hashes) == 2
    assert alloc.allocate(3) is None
    assert alloc.hash_of == hashes


# ----------------------------------------------------------------------------- prefix matching


def test_prefix_match_longest_chain() -> None:
    alloc = PageAllocator(16, PAGE)
    tokens = list(range(100, 114))  # 14 tokens: 3 full pages and a partial one
    pages = cached_sequence(alloc, tokens)
    assert len(alloc.page_of) == 3  # the partial page is not published
    assert alloc.match_prefix(tokens + [1, 2]) == pages[:3]
    assert alloc.match_prefix(tokens[:10] + [7, 7, 7, 7, 7]) == pages[:2]  # diverges inside page 3
    assert alloc.match_prefix([0] + tokens[1:]) == []  # diverges in page 1: nothing after it counts
    # A page's hash covers its whole prefix: page 2's tokens after a different page 1 do not match.
    assert alloc.match_prefix([0, 0, 0, 0] + tokens[4:]) == []


def test_prefix_match_leaves_one_token() -> None:
    alloc = PageAllocator(16, PAGE)
    tokens = list(range(12))  # exactly 3 full pages
    pages = cached_sequence(alloc, tokens)
    assert alloc.match_prefix(tokens) == pages[:2]  # the last token must be computed to sample
    assert alloc.match_prefix(tokens + [5]) == pages[:3]
    assert alloc.match_prefix(tokens[:4]) == []
    assert alloc.match_prefix(tokens[:5]) == pages[:1]
    assert alloc.match_prefix([3]) == []


def test_prefix_match_takes_references() -> None:
    alloc = PageAllocator(8, PAGE)
    tokens = list(range(9))
    pages = cached_sequence(alloc, tokens)
    assert alloc.num_used == 0
    hit = alloc.match_prefix(tokens)
    assert hit == pages[:2] and alloc.num_used == 2
    assert all(p not in alloc.pools[0] and alloc.refs[p] == 1 for p in hit)
    assert alloc.match_prefix(tokens) == hit and [alloc.refs[p] for p in hit] == [2, 2]
    # Taken pages are never handed out again while referenced.
    assert not set(alloc.allocate(6)) & set(hit)


def test_only_computed_pages_are_published() -> None:
    alloc = PageAllocator(16, PAGE)
    tokens = list(range(16))
    pages = cached_sequence(alloc, tokens, num_computed=9)  # a prefill chunk of 9 tokens so far
    assert alloc.match_prefix(tokens) == pages[:2]


def test_register_is_incremental_and_keeps_first_copy() -> None:
    alloc = PageAllocator(16, PAGE)
    tokens = list(range(12))
    pages = alloc.allocate(3)
    chain: list[bytes] = []
    alloc.register(tokens, pages, 5, chain)
    assert chain == page_hashes(tokens[:4], PAGE)
    alloc.register(tokens, pages, 12, chain)
    assert chain == page_hashes(tokens, PAGE)
    assert [alloc.page_of[h] for h in chain] == pages
    # Same content computed again in other pages: the cache keeps pointing at the first copy.
    copy = alloc.allocate(3)
    alloc.register(tokens, copy, 12, [])
    assert [alloc.page_of[h] for h in chain] == pages and not set(copy) & set(alloc.hash_of)


def test_disabled_prefix_cache_never_matches() -> None:
    alloc = PageAllocator(8, PAGE, prefix_cache=False)
    tokens = list(range(13))
    cached_sequence(alloc, tokens)
    assert alloc.hash_of == {} and alloc.page_of == {}
    assert alloc.match_prefix(tokens) == []
    assert alloc.num_used == 0


def test_hit_rate() -> None:
    alloc = PageAllocator(8, PAGE)
    assert alloc.hit_rate == 0.0
    alloc.record_lookup(10, 0)
    alloc.record_lookup(10, 8)
    assert alloc.hit_rate == pytest.approx(0.4)


# ----------------------------------------------------------------------------- eviction


def test_never_used_pages_go_before_cached_ones() -> None:
    alloc = PageAllocator(4, PAGE)
    a = cached_sequence(alloc, list(range(8)))
    fresh = alloc.allocate(2)
    assert not set(fresh) & set(a)
    assert len(alloc.page_of) == 2  # nothing evicted yet


def test_lru_evicts_least_recently_freed_first() -> None:
    alloc = PageAllocator(4, PAGE)
    a_tokens, b_tokens = list(range(8)), list(range(50, 58))
    a = cached_sequence(alloc, a_tokens)
    b = cached_sequence(alloc, b_tokens)  # freed after a
    a_hashes = page_hashes(a_tokens, PAGE)
    # Within a sequence its last page goes first: the first page is the most widely shared.
    (victim,) = alloc.allocate(1)
    assert victim == a[1]
    assert victim not in alloc.hash_of and a_hashes[1] not in alloc.page_of
    assert alloc.page_of[a_hashes[0]] == a[0]
    assert alloc.match_prefix(a_tokens + [0]) == [a[0]]
    assert alloc.match_prefix(b_tokens + [0]) == b
    alloc.release([a[0]] + b)
    alloc.release([victim])


def test_reuse_refreshes_lru_position() -> None:
    alloc = PageAllocator(4, PAGE)
    a_tokens, b_tokens = list(range(8)), list(range(50, 58))
    a = cached_sequence(alloc, a_tokens)
    b = cached_sequence(alloc, b_tokens)
    alloc.release(alloc.match_prefix(a_tokens + [0]))  # a is used again, so now b is older
    assert alloc.allocate(2) == [b[1], b[0]]
    assert alloc.match_prefix(b_tokens + [0]) == []
    assert alloc.match_prefix(a_tokens + [0]) == a


# ----------------------------------------------------------------------------- abort on EngineCore


@pytest.fixture(scope="module")
def tiny(tiny_model) -> tuple[str, torch.nn.Module]:
    return tiny_model("llama")


def make_core(path: str, **cfg) -> EngineCore:
    return EngineCore(EngineConfig(model=path, show_progress=False, page_size=PAGE, num_pages=64, **cfg))


def run_steps(core: EngineCore, n: int) -> None:
    for _ in range(n):
        core.step()


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_abort_running_request_frees_pages(tiny, prefix_cache: bool) -> None:
    core = make_core(tiny[0], enable_prefix_cache=prefix_cache)
    before = core.allocator.num_used
    prompt = list(range(1, 12))
    req = core.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=30))
    run_steps(core, 4)
    assert req.status is Status.RUNNING and len(req.output_token_ids) == 4
    pages = list(req.pages)
    assert core.allocator.num_used == len(pages) > before
    assert core.abort("a") is True
    assert core.allocator.num_used == before
    assert all(core.allocator.refs[p] == 0 for p in pages)
    assert req.status is Status.FINISHED and req.finish_reason == "abort" and req.pages == []
    assert not core.has_unfinished() and core.step() == []
    assert core.abort("a") is False
    if prefix_cache:  # its full pages stay findable until evicted
        again = core.add_request("b", prompt, SamplingParams(temperature=0, max_tokens=1))
        run_steps(core, 1)
        assert again.num_cached_tokens == 8
    else:
        assert core.allocator.hash_of == {}


def test_abort_waiting_and_unknown(tiny) -> None:
    core = make_core(tiny[0])
    req = core.add_request("w", [1, 2, 3], SamplingParams(max_tokens=4))
    assert core.abort("w") is True
    assert req.finish_reason == "abort" and not core.has_unfinished()
    assert core.abort("w") is False
    assert core.abort("never-added") is False


def test_abort_finished_request_is_false(tiny) -> None:
    core = make_core(tiny[0])
    core.add_request("f", [1, 2, 3], SamplingParams(max_tokens=2))
    while core.has_unfinished():
        core.step()
    assert core.abort("f") is False


def test_abort_leaves_other_requests_intact(tiny) -> None:
    core = make_core(tiny[0])
    solo = core.add_request("solo", [9, 8, 7, 6, 5], SamplingParams(temperature=0, max_tokens=10))
    while core.has_unfinished():
        core.step()
    core = make_core(tiny[0])
    keep = core.add_request("keep", [9, 8, 7, 6, 5], SamplingParams(temperature=0, max_tokens=10))
    core.add_request("drop", list(range(20, 40)), SamplingParams(temperature=0, max_tokens=10))
    run_steps(core, 3)
    assert core.abort("drop")
    while core.has_unfinished():
        core.step()
    assert keep.finish_reason == "length" and keep.output_token_ids == solo.output_token_ids
    assert core.allocator.num_used == 0


# ----------------------------------------------------------------------------- digests


def test_digests_are_the_same_in_another_process() -> None:
    """Another process (a router, another replica) computes the same digest for the same prefix;
    Python's hash() would differ between processes before 3.12 (PYTHONHASHSEED)."""
    import os
    import subprocess
    import sys

    import shardserve

    src = os.path.dirname(os.path.dirname(shardserve.__file__))  # the code under test, wherever installed
    tokens = list(range(3 * PAGE)) + [2**40, 7]
    code = ("from shardserve.kvcache.pages import page_hashes;"
            f"print(','.join(h.hex() for h in page_hashes({tokens!r}, {PAGE})))")
    theirs = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONHASHSEED": "123", "PYTHONPATH": src}).stdout.strip()
    mine = page_hashes(tokens, PAGE)
    assert theirs == ",".join(h.hex() for h in mine)
    assert len(mine) == 3 and len(set(mine)) == 3 and all(len(h) == 16 for h in mine)
    # Chained: the same page after another prefix has another digest.
    assert page_hashes(tokens[PAGE : 2 * PAGE], PAGE)[0] != mine[1]


def test_a_forced_collision_never_serves_another_prompts_pages(monkeypatch) -> None:
    """With a digest that collides for every page, a lookup must still check the content: the
    second prompt gets none of the first one's pages, and the first still gets its own."""
    from shardserve.kvcache import pages as pages_mod

    monkeypatch.setattr(pages_mod, "page_digest", lambda parent, tokens: b"same" + parent[:0])
    alloc = PageAllocator(16, PAGE)
    a_tokens, b_tokens = list(range(2 * PAGE)), list(range(100, 100 + 2 * PAGE))
    a = cached_sequence(alloc, a_tokens)
    assert alloc.match_prefix(b_tokens + [0]) == []
    hit = alloc.match_prefix(a_tokens + [0])
    assert hit == a[:1]  # page 2's digest equals page 1's too, so it was never published
    alloc.release(hit)
    # The same check covers the parent: equal tokens after another prefix are not a hit.
    monkeypatch.setattr(pages_mod, "page_digest", lambda parent, tokens: bytes([tokens[0] % 256]))
    alloc = PageAllocator(16, PAGE)
    c = cached_sequence(alloc, [1] * PAGE + [2] * PAGE)
    assert alloc.match_prefix([3] * PAGE + [2] * PAGE + [0]) == []
    assert alloc.match_prefix([1] * PAGE + [2] * PAGE + [0]) == c


def test_cache_events_report_stored_and_evicted_digests() -> None:
    alloc = PageAllocator(2, 2)
    alloc.watch_events()
    tokens = [1, 2, 3, 4, 5]
    pages = alloc.allocate(2)
    chain: list[bytes] = []
    alloc.register(tokens, pages, 4, chain)
    assert alloc.take_events() == (chain, [])
    assert alloc.take_events() == ([], [])  # taken once
    alloc.release(pages)
    alloc.allocate(1)  # evicts the later page first (it was queued first)
    assert alloc.take_events() == ([], [chain[1]])


def test_cache_events_net_out_a_page_evicted_and_recomputed_in_one_step() -> None:
    alloc = PageAllocator(1, 2)
    alloc.watch_events()
    tokens = [1, 2, 3]
    first = alloc.allocate(1)
    chain: list[bytes] = []
    alloc.register(tokens, first, 2, chain)
    alloc.take_events()
    alloc.release(first)
    again = alloc.allocate(1)  # evicts the digest ...
    alloc.register(tokens, again, 2, [])  # ... and the same content is cached again
    assert alloc.take_events() == (chain, [])
    alloc.release(again)
    alloc.allocate(1)
    assert alloc.take_events() == ([], chain)


def test_spread_keeps_each_request_balanced_and_chunks_zigzag():
    # Context parallelism: 4 pools of 8. An 8-page chunk is two pages per pool, zigzag.
    alloc = PageAllocator(32, PAGE, parts=4)
    pages = alloc.grow([], 8)
    assert [alloc.part_of(p) for p in pages] == [0, 1, 2, 3, 3, 2, 1, 0]
    # A decode's new page goes to the pool holding fewest of the request's pages; on a tie, the
    # pool with most free pages (another request took two of pool 0's).
    other = alloc.grow([], 2)
    assert [alloc.part_of(p) for p in other] == [0, 1]
    one = alloc.grow(pages, 1)
    assert alloc.part_of(one[0]) == 2
    pages += one
    # An uneven chunk after it tops the other pools up first.
    more = alloc.grow(pages, 3)
    held = [sum(alloc.part_of(p) == i for p in pages + more) for i in range(4)]
    assert held == [3, 3, 3, 3]
    # Short in one pool: nothing is taken.
    free = alloc.num_free
    assert alloc.allocate_parts([3] * 9) is None and alloc.num_free == free
    alloc.release(pages + more + other)
    assert alloc.num_free == 32
