"""The leader's step plans, fanned out to every other rank of the replica (engine/stage_worker.py),
and what comes back: the sampling rank's results and the later stages' traffic counts."""

from __future__ import annotations

import msgspec

from shardserve.ipc.messages.base import Msg
from shardserve.ipc.messages.disagg import KVTarget
from shardserve.multimodal import ImageInput
from shardserve.sampling_params import SamplingParams


class PlanRequest(msgspec.Struct, array_like=True):
    """A request the other ranks hear of the first time it is scheduled."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    seed: int  # resolved by the leader, so whichever rank samples draws the same tokens
    # With structured outputs or min_tokens: the leader's EOS ids (allowed only once the grammar
    # is complete, banned before min_tokens).
    eos: list[int] = []
    # Disaggregated prefill: where this request's KV goes, layer by layer (kvcache/transfer.py).
    transfer: KVTarget | None = None
    # Disaggregated decode: the tokens the prefill instance sampled, and its sampler's random
    # state after them, so this instance continues exactly as one engine would.
    output: list[int] = []
    rng_state: bytes = b""
    images: list[ImageInput] = []  # the prompt's images (multimodal.py): the first stage embeds them


class LoraOp(msgspec.Struct, array_like=True):
    """One of the leader's adapter decisions (--enable-lora), applied by every rank in order before
    the plan runs: put adapter `lora_id` into `slot`, or with slot DROP, drop the ranks' parsed copy
    of it. `data`: the adapter's safetensors file, sent the first time the ranks meet it (or since
    they dropped it); empty when they keep it parsed already."""

    slot: int
    lora_id: int
    scale: float = 0.0  # lora_alpha / r (or / sqrt(r), rsLoRA): B is multiplied by it
    data: bytes = b""


DROP = -1  # LoraOp.slot: drop the parsed copy


# PlanEntry.token_ids, --async-scheduling: the token this request's previous plan is sampling,
# which the sampling rank fills in before it embeds the row (scheduler/overlap.py).
PENDING = -1


class PlanEntry(msgspec.Struct, array_like=True):
    """One request's share of a micro-batch: tokens [start, start + n) of its sequence."""

    rid: str
    start: int
    token_ids: list[int]  # the n tokens (only the first stage embeds them)
    page_base: int  # the request's page list becomes pages[:page_base] + new_pages
    new_pages: list[int]
    sample: bool  # this chunk reaches the end of the known tokens: sample the next one
    score_first: int = -1  # prompt logprobs: first position scored in this chunk (-1: none)
    score_count: int = 0
    # Speculative decoding: the last num_draft of token_ids are proposals; the target's logits at
    # this chunk's last num_draft + 1 positions decide which it keeps (engine/verify.py).
    num_draft: int = 0
    lora_slot: int = -1  # the adapter slot its rows run with (-1: the base model alone)


class StepPlan(Msg):
    """One micro-batch: every rank of the replica runs exactly these, in `mb` order."""

    mb: int
    entries: list[PlanEntry]
    new: list[PlanRequest] = []
    done: list[str] = []  # requests finished or aborted since the last plan: forget them
    dropped: list[str] = []  # disaggregated decode: transfer rooms given up: write no more of their KV
    # Speculative decoding with the draft sharded like the target: this plan is one draft forward
    # (entries extend the draft's caches; each entry's last row gives the leader logits).
    draft: bool = False
    # LoRA adapters: slots to fill and parsed copies to drop, in the order the leader decided them.
    lora_ops: list[LoraOp] = []


class Tick(Msg):
    """The leader is alive but idle (the other ranks' wait for plans stays bounded)."""


class Wake(Msg):
    """Data-parallel attention: the router sent some replica work; every leader, idle or not,
    must join the next step (numbered, so a leader can tell a wake it has already acted on)."""

    seq: int


class StepResult(Msg):
    """What the sampling rank (last stage, tensor rank 0) returns for micro-batch `mb`."""

    mb: int
    tokens: list[int]  # one per sampled entry, in plan order
    logprobs: list[dict | None] = []
    prompt_logprobs: list[list[dict]] = []  # one list per scoring entry, in plan order
    ended: list[int] = []  # structured outputs: sampled entries (by position) whose output is complete
    # Speculative decoding, per sampled entry (empty when the plan had no proposals): the proposals
    # accepted, emitted before `tokens`' token, and their logprobs.
    accepted: list[list[int]] = []
    accepted_logprobs: list[list[dict | None]] = []
    embeddings: dict[str, list[float]] = {}  # pooling requests whose prompt is complete: request id -> embedding
    failed: dict[int, str] = {}  # sampled entries (by position) that failed alone, and why: their token is void


class StageTraffic(Msg):
    """A later stage's counts, for /metrics: {kind: {op: {calls, MB}}}."""

    stage: int
    rank: int
    groups: dict
