"""The routing policy (router/policy.py) and what it believes each replica holds
(router/prefix_index.py), on hand-made page keys."""

from __future__ import annotations

import pytest

from shardserve.kvcache.pages import page_hashes
from shardserve.router.policy import NoReplica, Router, Thresholds
from shardserve.router.prefix_index import PrefixIndex

PS = 4  # tokens per page


def pages(tokens: list[int]) -> list[bytes]:
    return page_hashes(tokens, PS)


SYSTEM = list(range(100, 132))  # 8 pages of shared prefix


def prompt(tail: int, n: int = 3) -> list[int]:
    return SYSTEM + [tail] * n


def send(router: Router, rid: str, tokens: list[int], max_tokens: int | None = 8, confirmed: bool = True) -> int:
    return router.route(rid, pages(tokens), len(tokens), max_tokens, confirmed=confirmed)


# ---- PrefixIndex


def test_index_matches_leading_pages_only():
    idx = PrefixIndex()
    a = pages(list(range(16)))  # 4 pages
    idx.store(a[:2])
    assert idx.match(a) == 2
    # Chained digests: page 2's tokens at the start of a prompt are a different page.
    assert idx.match(pages(list(range(4, 16)))) == 0
    other = pages([99] + list(range(1, 16)))
    assert idx.match(other) == 0  # a different first token changes every digest after it


def test_index_pending_until_unclaimed():
    idx = PrefixIndex()
    a = pages(list(range(12)))
    claimed = idx.claim(a)
    assert claimed == a and idx.match(a) == 3 and not idx.stored
    again = idx.claim(a)  # a second request in flight with the same pages
    idx.unclaim(claimed)
    assert idx.match(a) == 3  # still claimed by the second one
    idx.unclaim(again)
    assert idx.match(a) == 0 and len(idx) == 0


def test_index_stored_pages_are_not_claimed_and_outlive_unclaim():
    idx = PrefixIndex()
    a = pages(list(range(12)))
    idx.store(a[:2])
    claimed = idx.claim(a)
    assert claimed == a[2:]
    idx.unclaim(claimed)
    assert idx.match(a) == 2


def test_index_evict_and_clear():
    idx = PrefixIndex()
    a = pages(list(range(16)))
    idx.store(a)
    idx.evict([a[2]])
    assert idx.match(a) == 2  # the chain breaks at the evicted page
    pending = idx.claim(pages([7] * 8))
    idx.clear()
    assert idx.match(a) == 0
    assert idx.match(pages([7] * 8)) == 2  # clear forgets stored pages, not requests in flight
    idx.unclaim(pending)


def test_index_lru_bound_drops_tails_first_and_probes_do_not_refresh():
    idx = PrefixIndex(max_pages=4)
    a, b = pages([1] * 12), pages([2] * 8)  # 3 + 2 pages
    idx.store(a)
    idx.store(b)  # one page must go: a's tail, so a still matches its first two
    assert len(idx) == 4 and idx.match(a) == 2 and idx.match(b) == 2
    for _ in range(3):
        idx.match(a)  # only probes: a was stored before b, so a goes first
    idx.store(pages([3] * 8))
    assert idx.match(b) == 2 and idx.match(a) == 0


def test_confirmed_claim_stores_at_once():
    idx = PrefixIndex()
    a = pages(list(range(8)))
    assert idx.claim(a, confirmed=True) == []
    assert list(idx.stored) and idx.match(a) == 2 and not idx.pending


# ---- Router


def test_cache_affinity_beats_the_tie_breaks():
    r = Router(2, page_size=PS)
    r.replicas[0].load = 10_000  # replica 0 busy: the first request goes to replica 1
    assert send(r, "a", prompt(1)) == 1
    r.finish("a")
    r.replicas[0].load = 0
    # Now both are idle; replica 1 holds the shared prefix, so it beats replica 0's lower index
    # and emptier index.
    assert send(r, "b", prompt(2)) == 1
    assert send(r, "c", prompt(3)) == 1  # cached 32 - 0.5 * load(b) still beats replica 0's 0
    # An unrelated prompt takes the replica with less load.
    assert send(r, "d", [7] * 20) == 0


def test_cached_tokens_never_count_the_last_prompt_token():
    r = Router(2, page_size=PS)
    r.replicas[0].load = 10_000
    tokens = SYSTEM[:8]  # exactly two pages
    assert send(r, "a", tokens, max_tokens=0) == 1
    r.finish("a")
    r.replicas[0].load = 0
    send(r, "b", tokens, max_tokens=0)
    assert r.requests["b"].cost == 1  # 8 tokens, 7 cached: the last token is always recomputed


def test_load_term_overrides_affinity_when_a_replica_is_swamped():
    r = Router(2, page_size=PS)
    assert send(r, "warm", prompt(1)) == 0
    r.finish("warm")
    # Replica 0 holds 32 cached tokens; each request there adds ~8 + 8 outstanding tokens.
    picks = [send(r, f"r{i}", prompt(i + 2), max_tokens=64) for i in range(4)]
    assert picks[0] == 0  # affinity while replica 0 is idle
    assert 1 in picks  # once its load outweighs the cached tokens, replica 1 takes some
    assert r.replicas[1].load > 0


def test_imbalance_thresholds_need_both_absolute_and_relative_gaps():
    t = Thresholds(balance_abs_tokens=100, balance_rel=2.0, load_weight=0.0)  # score = cached tokens only
    r = Router(2, page_size=PS, thresholds=t)
    send(r, "warm", prompt(1))
    r.finish("warm")  # replica 0 holds the prefix
    r.replicas[0].load, r.replicas[1].load = 150, 100  # gap 50 <= 100: affinity
    assert send(r, "a", prompt(2), max_tokens=0) == 0
    r.finish("a")
    r.replicas[0].load, r.replicas[1].load = 1150, 1000  # gap 150 > 100 but 1150 < 2 x 1000: affinity
    assert send(r, "b", prompt(3), max_tokens=0) == 0
    r.finish("b")
    r.replicas[0].load, r.replicas[1].load = 250, 100  # gap 150 > 100 and 250 > 2 x 100: least loaded
    assert r.imbalanced(r.replicas)
    assert send(r, "c", prompt(4), max_tokens=0) == 1


def test_eviction_removes_credit():
    r = Router(2, page_size=PS)
    r.replicas[0].load = 10_000
    p = prompt(1)
    send(r, "a", p, confirmed=False)
    r.replicas[1].prefixes.store(pages(p))  # the replica reports the pages stored
    r.finish("a")
    r.replicas[0].load = 0
    r.replicas[1].prefixes.evict(pages(p)[:1])  # ... then evicts the first one
    assert send(r, "b", prompt(2)) == 0  # no credit left: the tie goes to the emptier replica


def test_pending_credit_is_withdrawn_when_a_request_ends_unstored():
    r = Router(2, page_size=PS)
    r.replicas[0].load = 10_000
    send(r, "a", prompt(1), confirmed=False)
    assert r.replicas[1].prefixes.match(pages(prompt(2))) == 8  # pending counts while in flight
    r.finish("a")  # aborted before the replica stored anything
    r.replicas[0].load = 0
    assert r.replicas[1].prefixes.match(pages(prompt(2))) == 0
    assert send(r, "b", prompt(2)) == 0


def test_tie_breaks_lower_load_then_smaller_index_then_lower_index():
    r = Router(3, page_size=PS)
    r.replicas[0].load, r.replicas[1].load, r.replicas[2].load = 5, 3, 3
    assert send(r, "a", [1] * 3) == 1  # no cache anywhere: least load, then lowest index
    r.finish("a")
    r.replicas[1].load = 4
    assert send(r, "b", [1] * 3) == 2
    r.finish("b")
    r.replicas[0].load = r.replicas[1].load = r.replicas[2].load = 0
    r.replicas[0].prefixes.store(pages([9] * 8))
    r.replicas[1].prefixes.store(pages([8] * 4))
    # Equal loads, no match: the replica holding least (room for a new prefix), replica 2.
    assert send(r, "c", [1] * 3, max_tokens=0) == 2
    r.replicas[2].prefixes.store(pages([7] * 12))
    r.finish("c")
    assert send(r, "d", [1] * 3, max_tokens=0) == 1


def test_finish_releases_load_and_counts():
    r = Router(2, page_size=PS)
    i = send(r, "a", [1] * 10, max_tokens=6)
    rep = r.replicas[i]
    assert (rep.load, rep.in_flight, rep.routed) == (16, 1, 1)
    assert r.replica_of("a") == i
    assert r.finish("a") == i and r.finish("a") is None  # a second finish is a no-op
    assert (rep.load, rep.in_flight, rep.routed) == (0, 0, 1)


def test_missing_max_tokens_counts_the_decode_estimate():
    r = Router(1, page_size=PS, thresholds=Thresholds(decode_estimate=100))
    send(r, "a", [1] * 10, max_tokens=None)
    assert r.replicas[0].load == 110


def test_unhealthy_replicas_are_skipped():
    r = Router(3, page_size=PS)
    r.replicas[0].healthy = r.replicas[2].healthy = False
    assert {send(r, f"r{i}", [i] * 5) for i in range(4)} == {1}
    r.replicas[1].healthy = False
    with pytest.raises(NoReplica):
        send(r, "x", [1])


def test_round_robin_and_least_load():
    rr = Router(3, policy="round_robin", page_size=PS)
    assert [send(rr, f"r{i}", prompt(1)) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    ll = Router(2, policy="least_load", page_size=PS)
    send(ll, "warm", prompt(1), max_tokens=100)  # replica 0, now loaded and holding the prefix
    assert send(ll, "a", prompt(2)) == 1  # cache means nothing to least_load
    with pytest.raises(ValueError, match="unknown load-balance policy"):
        Router(2, policy="random")


def test_character_units_keep_loads_and_thresholds_in_tokens():
    """A router counting characters (no tokenizer) measures load in tokens: a 4000-character
    prompt weighs 1000 tokens, under the 2048-token imbalance threshold, so its group's next
    requests keep their affinity (counted in characters, 4000 would trip it)."""
    from shardserve.kvcache.pages import page_hashes
    from shardserve.router.policy import Router

    r = Router(2, "cache_aware", page_size=16, units_per_token=4.0)
    text = [ord("a") + i % 26 for i in range(4000)]
    pages = page_hashes(text[:-1], 16)
    assert r.route("a", pages, len(text), 8) == 0
    assert r.replicas[0].load == 1000 + 8 and r.replicas[0].prompt_tokens == 1000
    assert r.route("b", pages, len(text), 8) == 0
    assert r.route("c", pages, len(text), 8) == 0  # replica 1 idle, yet no imbalance in tokens


def test_a_lora_adapters_requests_follow_it_until_its_replica_is_busy():
    """An adapter's requests go where its last one went (it likely sits in a slot there), other
    adapters and the base spread by load, and load still wins past `adapter_tokens`."""
    r = Router(2, page_size=PS)

    def lora(rid: str, tail: int, adapter: int | None, max_tokens: int = 8) -> int:
        tokens = [tail] * 6
        return r.route(rid, pages(tokens), len(tokens), max_tokens, confirmed=True, adapter=adapter)

    first = lora("a1", 1, 7)
    assert [lora(f"a{i}", i, 7) for i in range(2, 5)] == [first] * 3  # follows adapter 7 despite its load
    other = lora("b1", 50, 8)
    assert other != first  # a new adapter goes to the less loaded replica
    assert lora("b2", 51, 8) == other
    # Swamp adapter 7's replica: past adapter_tokens of extra load its next request moves.
    moved = lora("big", 2, 7, max_tokens=5000)
    assert moved == first
    assert lora("a5", 3, 7) != first and r.adapter_home[7] != first
