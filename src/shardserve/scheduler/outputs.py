"""What the leader sends out besides plans: each step's tokens for the detokenizer (`token_out`),
and cache events for the router (`CacheEventFeed`, with --dp-size > 1)."""

from __future__ import annotations

import zmq

from shardserve.ipc.messages.api import TokenOut
from shardserve.ipc.messages.reports import CacheEvents
from shardserve.ipc.sockets import bound, send
from shardserve.scheduler.engine_results import StepOutput


class CacheEventFeed:
    """The leader's cache events and ended requests, published for the router after each step.

    An XPUB socket: ZeroMQ drops what a PUB sends before a subscriber has joined, and a lost
    `ended` would leave its load on the router's books for good, so the leader does not report
    Ready until the router's subscription has arrived (other subscribers may join later)."""

    def __init__(self, ctx: zmq.Context, addr: str, replica: int, allocator, timeout_s: float, secret: bytes = b"",
                 gate=None):
        """`secret` and `gate` (the process's ZAP handler) where `addr` is TCP (ranks placed by Ray)."""
        self.pub = bound(ctx, zmq.XPUB, addr, secret, gate, "the cache events")
        self.pub.setsockopt(zmq.SNDHWM, 0)
        if not self.pub.poll(int(timeout_s * 1000)):
            raise RuntimeError(f"replica {replica}'s leader: the router did not subscribe to its cache events "
                               f"within {timeout_s:.0f} s")
        self.pub.recv()  # the subscription itself
        self.replica, self.allocator, self.seq = replica, allocator, 0
        self.ended: list[str] = []
        allocator.watch_events()

    def publish(self) -> None:
        stored, evicted = self.allocator.take_events()
        if not (stored or evicted or self.ended):
            return
        send(self.pub, CacheEvents(replica=self.replica, seq=self.seq, stored=stored, evicted=evicted,
                                   ended=self.ended))
        self.seq += 1
        self.ended = []


def token_out(o: StepOutput) -> TokenOut:
    r = o.request
    p = r.params
    return TokenOut(
        rid=r.request_id, new_ids=o.new_token_ids, finished=o.finished,
        finish_reason=r.finish_reason if o.finished else None, stop_reason=r.stop_reason if o.finished else None,
        text_cut=r.text_cut, hold=max((len(s) for s in p.stop), default=1) - 1,
        skip_special_tokens=p.skip_special_tokens,
        logprobs=o.logprobs, prompt_tokens=len(r.prompt_token_ids), cached_tokens=r.num_cached_tokens,
        # Complete by the first sampled token, and sent with it only.
        prompt_logprobs=r.prompt_logprobs if p.prompt_logprobs is not None and o.first else None,
        embedding=r.embedding if o.finished else None, error=r.error if o.finished else None,
    )
