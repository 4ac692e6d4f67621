"""The in-server router process's logic, over real ZeroMQ sockets in this process: placement,
aborts to the owning replica, cache events adding and removing credit, a lost event, a replica
that dies (its requests handed back, nothing more sent to it) and comes back."""

from __future__ import annotations

import time

import pytest
import zmq

from shardserve.ipc.messages.api import AbortReq, AddRequests, TokenizedReq
from shardserve.ipc.messages.replicas import DropStreams, ReplicaDown, ReplicaLost, ReplicaUp
from shardserve.ipc.messages.reports import CacheEvents, ReportReq
from shardserve.ipc.sockets import Endpoints, pull, recv, send
from shardserve.kvcache.pages import page_hashes
from shardserve.router.replicas import ReplicaRouter
from shardserve.sampling_params import SamplingParams

PAGE = 4


@pytest.fixture
def wired():
    """A ReplicaRouter for 2 replicas, the leaders' inboxes (PULL) and their event feeds (PUB)."""
    ep = Endpoints.create(1, dp=2)
    ctx = zmq.Context.instance()
    leaders = [pull(ctx, ep.leader(d)) for d in range(2)]
    pubs = []
    for d in range(2):
        pub = ctx.socket(zmq.XPUB)  # as the leaders do: wait for the router's subscription
        pub.bind(ep.events(d))
        pubs.append(pub)
    api, detok = pull(ctx, ep.api), pull(ctx, ep.detokenizer)
    router = ReplicaRouter(ep, "cache_aware", PAGE)
    for pub in pubs:
        assert pub.poll(5000) and pub.recv() == b"\x01"
    router.test_api, router.test_detok = api, detok
    yield router, leaders, pubs
    for s in (*leaders, *pubs, api, detok, router.inbox, router.events, router.to_api, router.to_detok,
              *router.leaders):
        s.close(linger=0)


def req(rid: str, ids: list[int], max_tokens: int = 4) -> TokenizedReq:
    return TokenizedReq(rid=rid, token_ids=ids, params=SamplingParams(max_tokens=max_tokens))


def landed(leaders) -> dict[str, int]:
    out = {}
    for d, sock in enumerate(leaders):
        while (msg := recv(sock, timeout_ms=200)) is not None:
            items = msg.items if isinstance(msg, AddRequests) else [msg]
            out.update({getattr(m, "rid", type(m).__name__): d for m in items})
    return out


def events(router, pub, replica: int, seq: int, **kw) -> None:
    send(pub, CacheEvents(replica=replica, seq=seq, **kw))
    deadline = time.monotonic() + 2
    while router.next_seq[replica] <= seq and time.monotonic() < deadline:
        if router.events.poll(50):
            router.on_events(recv(router.events))
    assert router.next_seq[replica] == seq + 1


PREFIX = list(range(100, 124))  # 6 pages of 4


def test_stored_prefix_draws_its_group_and_a_new_prompt_goes_to_the_empty_replica(wired):
    router, leaders, pubs = wired
    router.handle(req("a1", PREFIX + [1, 2]))
    assert landed(leaders) == {"a1": 0}
    events(router, pubs[0], 0, 0, stored=page_hashes(PREFIX, PAGE), ended=["a1"])
    router.handle(req("b1", [7] * 26))  # nothing cached anywhere: the replica with the emptier cache
    router.handle(req("a2", PREFIX + [3, 4]))  # 24 tokens cached on replica 0
    assert landed(leaders) == {"b1": 1, "a2": 0}


def test_eviction_events_remove_the_credit(wired):
    router, leaders, pubs = wired
    pages = page_hashes(PREFIX, PAGE)
    router.handle(req("a1", PREFIX + [1]))
    events(router, pubs[0], 0, 0, stored=pages, ended=["a1"])
    router.handle(req("x", [9] * 40, max_tokens=200))  # replica 1 now carries far more load
    events(router, pubs[0], 0, 1, evicted=pages[:1])  # the prefix's first page is gone: no credit
    assert router.router.replicas[0].prefixes.match(pages) == 0
    router.handle(req("a2", PREFIX + [2]))
    assert landed(leaders) == {"a1": 0, "x": 1, "a2": 0}  # replica 0 by load alone


def test_pending_pages_count_until_the_request_ends(wired):
    router, leaders, pubs = wired
    pages = page_hashes(PREFIX, PAGE)
    router.handle(req("a1", PREFIX + [1]))
    assert router.router.replicas[0].prefixes.match(pages) == len(pages)  # sent, not yet stored
    router.handle(req("a2", PREFIX + [2]))  # follows its prefix although replica 0 is busier
    events(router, pubs[0], 0, 0, ended=["a1", "a2"])  # both ended (aborted) before storing a page
    assert router.router.replicas[0].prefixes.match(pages) == 0
    assert router.router.replicas[0].load == 0 and router.router.replicas[0].in_flight == 0
    assert landed(leaders) == {"a1": 0, "a2": 0}


def test_a_lost_event_message_forgets_the_replicas_stored_prefixes(wired):
    router, leaders, pubs = wired
    pages = page_hashes(PREFIX, PAGE)
    events(router, pubs[1], 1, 0, stored=pages)
    assert router.router.replicas[1].prefixes.match(pages) == len(pages)
    events(router, pubs[1], 1, 2)  # seq 1 never arrived: it may have held evictions
    assert router.router.replicas[1].prefixes.match(pages) == 0


def test_aborts_follow_their_request_and_early_aborts_drop_it(wired):
    router, leaders, _ = wired
    router.handle(req("a", [1, 2, 3]))
    router.handle(req("b", [4, 5, 6]))
    placed = landed(leaders)
    router.handle(AbortReq(rid="b"))
    assert landed(leaders) == {"b": placed["b"]}  # only the replica that has it hears of it
    router.handle(AbortReq(rid="c"))  # overtook its request
    router.handle(req("c", [7, 8, 9]))
    assert landed(leaders) == {}
    router.handle(ReportReq(rid="r"))
    assert [recv(s, 1000).rid for s in leaders] == ["r", "r"]


def test_a_batch_is_split_by_replica_in_order(wired):
    router, leaders, _ = wired
    router.handle(AddRequests(items=[req(str(i), [i] * 30, max_tokens=50) for i in range(4)]))
    placed = landed(leaders)
    assert sorted(placed) == ["0", "1", "2", "3"] and set(placed.values()) == {0, 1}


def test_a_late_abort_of_an_ended_request_is_not_kept(wired):
    router, leaders, pubs = wired
    router.handle(req("a", [1, 2, 3]))
    events(router, pubs[0], 0, 0, ended=["a"])
    router.handle(AbortReq(rid="a"))  # the client gave up as the answer arrived
    assert "a" not in router.aborted_early


def test_a_dead_replica_hands_back_its_requests_and_gets_nothing_until_it_is_up(wired):
    router, leaders, pubs = wired
    router.handle(req("a", [1] * 9))
    router.handle(req("b", [2] * 9))
    assert landed(leaders) == {"a": 0, "b": 1}
    events(router, pubs[1], 1, 0)  # replica 1's leader has numbered one event
    router.handle(ReplicaDown(replicas=[1], reason="scheduler-1 was killed by signal 9"))
    lost = recv(router.test_api, timeout_ms=2000)
    assert lost == ReplicaLost(replica=1, rids=["b"], reason="scheduler-1 was killed by signal 9")
    assert recv(router.test_detok, timeout_ms=2000) == DropStreams(rids=["b"])
    assert router.router.replica_of("b") is None and router.router.replicas[1].load == 0
    # A dead leader's last events are ignored; new requests and reports go to replica 0 only.
    send(pubs[1], CacheEvents(replica=1, seq=1, stored=page_hashes([2] * 8, PAGE)))
    assert router.events.poll(2000), "the dead leader's late event never arrived"
    router.on_events(recv(router.events))
    assert len(router.router.replicas[1].prefixes) == 0 and router.next_seq[1] == 1
    router.handle(req("c", [3] * 9))
    router.handle(ReportReq(rid="r"))
    assert landed(leaders) == {"c": 0, "r": 0}
    # Every replica down: requests are held, and an abort removes one; they go out when one is up.
    router.handle(ReplicaDown(replicas=[0], reason="gone"))
    assert recv(router.test_api, timeout_ms=2000).rids == ["a", "c"]
    router.handle(req("d", [4] * 9))
    router.handle(req("e", [5] * 9))
    router.handle(AbortReq(rid="e"))
    assert landed(leaders) == {}
    router.handle(ReplicaUp(replicas=[1]))
    assert landed(leaders) == {"d": 1}
    assert router.next_seq[1] == 0  # a new leader numbers its events from 0
