"""The in-server router for `--dp-size D`: one process between the tokenizers and D replica leaders.

    tokenizers / API --(TokenizedReq, AbortReq, ...)--> router --> leader of replica d (ep.leader(d))
    leader d --(CacheEvents on its PUB, ep.events(d))--> router      (pages stored / evicted, ends)

The router picks a replica per request (router/policy.py), remembers it until the leader reports
the request ended, and sends that request's abort to the same replica. It follows each replica's
cache events, so it credits a replica only with prefixes it holds. Rank reports go to every
replica. Under data-parallel attention (`lockstep`) every request placed is followed by a
numbered `Wake` to every leader: idle leaders sleep on their inbox, and this is what makes them
all join the next step (scheduler/lockstep.py). Outputs do not pass through here: each leader
sends tokens to the detokenizer and errors and stats to the API process directly.

A replica that died (`ReplicaDown`, from the API process's supervisor) gets nothing more: what
was queued for it is dropped, the requests placed on it go back to the API process
(`ReplicaLost`), which places again those that have streamed nothing, and the detokenizer forgets
their streams. While no replica serves, requests are held until one does (`ReplicaUp`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict

import zmq

from shardserve.ipc.child import run_child
from shardserve.ipc.messages.api import AbortReq, AddRequests, ErrorOut, TokenizedReq
from shardserve.ipc.messages.lifecycle import Shutdown
from shardserve.ipc.messages.plan import Wake
from shardserve.ipc.messages.replicas import DropStreams, ReplicaDown, ReplicaLost, ReplicaUp
from shardserve.ipc.messages.reports import CacheEvents, ReportReq, RouterStats
from shardserve.ipc.sockets import Endpoints, connected, pull, push, recv_all, send
from shardserve.kvcache.pages import page_hashes
from shardserve.launch.process_tree import Child
from shardserve.router.policy import NoReplica, Router, Thresholds

log = logging.getLogger(__name__)
STATS_INTERVAL = 0.25


class ReplicaRouter:
    def __init__(self, ep: Endpoints, policy: str, page_size: int, prefix_cache: bool = True,
                 thresholds: Thresholds = Thresholds(), lockstep: bool = False):
        """`prefix_cache=False` (--no-prefix-cache): replicas share nothing, so no prompt earns affinity."""
        self.ctx = ctx = zmq.Context.instance()
        self.ep = ep
        self.inbox = pull(ctx, ep.scheduler)
        self.leaders = [self._leader_socket(d) for d in range(ep.dp)]
        self.events = connected(ctx, zmq.SUB, [ep.events(d) for d in range(ep.dp)], ep.secret, {zmq.RCVHWM: 0})
        self.events.setsockopt(zmq.SUBSCRIBE, b"")
        self.to_api = push(ctx, ep.api, ep.secret)
        self.to_detok = push(ctx, ep.detokenizer, ep.secret)
        self.held: list[TokenizedReq] = []  # while no replica serves
        self.router = Router(ep.dp, policy, page_size, thresholds)
        self.page_size = page_size if prefix_cache else 0
        self.next_seq = [0] * ep.dp
        self.aborted_early = RecentIds()  # aborts that overtook their request
        self.recently_ended = RecentIds()  # so a late abort is not taken for an early one
        self.last_stats: tuple = ()
        self.last_stats_at = 0.0
        self.lockstep, self.wakes = lockstep, 0

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        poller.register(self.events, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(100))
            # Events first: a request's end must be known before a later request is placed.
            if self.events in ready:
                for msg in recv_all(self.events, "the router's cache-event feed"):
                    self.on_events(msg)
            if self.inbox in ready:
                for msg in recv_all(self.inbox, "the router's inbox"):
                    if isinstance(msg, Shutdown):
                        self.broadcast(msg)
                        return
                    self.handle(msg)
            self.maybe_send_stats()

    def _leader_socket(self, d: int) -> zmq.Socket:
        sock = push(self.ctx, self.ep.leader(d), self.ep.secret)
        sock.setsockopt(zmq.SNDHWM, 0)  # never block: a replica busy in a long step must not stall the others
        return sock

    def handle(self, msg) -> None:
        if isinstance(msg, ReplicaDown):
            self.replicas_down(msg.replicas, msg.reason)
        elif isinstance(msg, ReplicaUp):
            self.replicas_up(msg.replicas)
        elif isinstance(msg, TokenizedReq):
            if self.aborted_early.take(msg.rid):
                return
            d = self.place(msg)
            if d is not None:
                send(self.leaders[d], msg)
                self.wake()
        elif isinstance(msg, AddRequests):
            per_replica: dict[int, list[TokenizedReq]] = {}
            for item in msg.items:
                d = None if self.aborted_early.take(item.rid) else self.place(item)
                if d is not None:
                    per_replica.setdefault(d, []).append(item)
            for d, items in per_replica.items():
                send(self.leaders[d], AddRequests(items=items))
            if per_replica:
                self.wake()
        elif isinstance(msg, AbortReq):
            d = self.router.replica_of(msg.rid)
            if d is not None:
                send(self.leaders[d], msg)
            elif any(r.rid == msg.rid for r in self.held):
                self.held = [r for r in self.held if r.rid != msg.rid]
            elif msg.rid not in self.recently_ended:
                self.aborted_early.add(msg.rid)
        elif isinstance(msg, ReportReq):
            self.broadcast(msg)

    def place(self, req: TokenizedReq) -> int | None:
        """The replica for `req` (None: refused here, with an error to the API)."""
        if req.rid in self.router.requests:
            send(self.to_api, ErrorOut(rid=req.rid, message=f"request id {req.rid!r} is already in use"))
            return None
        # The last prompt token is always recomputed (its logits are needed), as in match_prefix.
        # An adapter's pages chain from its own root (as its replica caches them).
        lora = req.params.lora_request
        root = lora.cache_root if lora is not None else b""
        pages = page_hashes(req.token_ids[: len(req.token_ids) - 1], self.page_size, root) if self.page_size else []
        max_tokens = None if req.auto_max_tokens else req.params.max_tokens
        try:
            return self.router.route(req.rid, pages, len(req.token_ids), max_tokens,
                                     adapter=lora.lora_int_id if lora is not None else None)
        except NoReplica:  # every replica is starting again: wait for one
            self.held.append(req)
            return None

    def replicas_down(self, replicas: list[int], reason: str) -> None:
        """Stop sending to `replicas`; hand back what they held (module docstring)."""
        for d in replicas:
            rep = self.router.replicas[d]
            if not rep.healthy:
                continue
            rep.healthy = False
            rids = [rid for rid, routed in self.router.requests.items() if routed.replica == d]
            for rid in rids:
                self.router.finish(rid)
                self.recently_ended.add(rid)
            rep.prefixes.clear()
            self.leaders[d].close(linger=0)  # drops what was queued for the dead leader
            log.info("replica %d is down: %d request%s handed back", d, len(rids), "" if len(rids) == 1 else "s")
            if rids:
                send(self.to_detok, DropStreams(rids=rids))
            send(self.to_api, ReplicaLost(replica=d, rids=rids, reason=reason))

    def replicas_up(self, replicas: list[int]) -> None:
        """`replicas` serve again (fresh processes, empty caches): place what was held."""
        for d in replicas:
            rep = self.router.replicas[d]
            if rep.healthy:
                continue
            self.leaders[d] = self._leader_socket(d)
            self.next_seq[d] = 0  # a new leader numbers its cache events from 0
            rep.healthy = True
        if self.lockstep and len(replicas) == len(self.leaders):
            self.wakes = 0  # every leader is new and has seen no wake
        held, self.held = self.held, []
        if held:
            self.handle(AddRequests(items=held))

    def wake(self) -> None:
        """After the request itself on the same socket, so a woken leader already holds it."""
        if self.lockstep:
            self.wakes += 1
            self.broadcast(Wake(seq=self.wakes))

    def broadcast(self, msg) -> None:
        for sock, rep in zip(self.leaders, self.router.replicas):
            if rep.healthy:
                send(sock, msg)

    def on_events(self, ev: CacheEvents) -> None:
        if not self.router.replicas[ev.replica].healthy:  # a dead leader's last words
            return
        prefixes = self.router.replicas[ev.replica].prefixes
        if ev.seq != self.next_seq[ev.replica]:
            # A lost message may have held evictions: believe nothing stored rather than too much.
            log.warning("replica %d: cache events %d..%d lost; forgetting its stored prefixes",
                        ev.replica, self.next_seq[ev.replica], ev.seq - 1)
            prefixes.clear()
        self.next_seq[ev.replica] = ev.seq + 1
        prefixes.store(ev.stored)
        prefixes.evict(ev.evicted)
        for rid in ev.ended:
            self.router.finish(rid)
            self.recently_ended.add(rid)

    def maybe_send_stats(self) -> None:
        reps = self.router.replicas
        now_stats = tuple(tuple(getattr(r, f) for r in reps) for f in ("routed", "prompt_tokens", "in_flight", "load"))
        now = time.monotonic()
        idle = not any(now_stats[2])
        if now_stats == self.last_stats or (not idle and now - self.last_stats_at < STATS_INTERVAL):
            return
        self.last_stats, self.last_stats_at = now_stats, now
        routed, prompt, in_flight, load = map(list, now_stats)
        send(self.to_api, RouterStats(routed=routed, prompt_tokens=prompt, in_flight=in_flight, load_tokens=load))


class RecentIds:
    """A bounded set of request ids: the oldest are forgotten first."""

    def __init__(self, limit: int = 10000):
        self.ids: OrderedDict[str, None] = OrderedDict()
        self.limit = limit

    def __contains__(self, rid: str) -> bool:
        return rid in self.ids

    def add(self, rid: str) -> None:
        self.ids[rid] = None
        if len(self.ids) > self.limit:
            self.ids.popitem(last=False)

    def take(self, rid: str) -> bool:
        """Whether `rid` was here (and forget it)."""
        return self.ids.pop(rid, 0) is None


def router_main(ep: Endpoints, policy: str, page_size: int, prefix_cache: bool = True,
                lockstep: bool = False) -> None:
    """Process entry point (the `router` child of a server or LLM with dp > 1)."""

    def setup():
        router = ReplicaRouter(ep, policy, page_size, prefix_cache, lockstep=lockstep)
        return router.serve, {}

    run_child("router", ep.ready, setup, ep.secret)


def router_child(ep: Endpoints, policy: str, page_size: int, prefix_cache: bool = True,
                 lockstep: bool = False) -> Child:
    """The router process of a grid with several replicas (started beside the scheduler ranks)."""
    return Child("router", router_main, (ep, policy, page_size, prefix_cache, lockstep),
                 env={"OMP_NUM_THREADS": "1"})
