"""One context rank's share of a plan (context parallelism, `--cp-size`).

The leader's plan is the same for every rank: whole chunks and global page ids (page id =
context rank x pages per pool + local page, see kvcache/spread.py). A context rank runs:

- every decode of the step (one token each, replicated: the query is needed wherever the
  request's keys are); only the rank whose page holds the new position stores its K/V;
- of each prefill chunk, the tokens whose pages are its own (the zigzag layout of `spread.place`);
  it stores their K/V, and its ring block is every key of the request it holds through the chunk.

Rows that need logits (the sampled row of each entry, then prompt-scored rows) live on the rank
that computed them (decodes: context rank 0); after the last layer they are gathered over the
context group in plan order (`ContextStep.order`), so the sampling rank sees what one rank would.
Every rank can work out every other rank's share from the plan, so no sizes are exchanged.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import torch

from shardserve.attention.context import ContextChunk, ContextMetadata
from shardserve.distributed.communicator import Communicator
from shardserve.ipc.messages.plan import PlanEntry


@dataclass
class ContextStep:
    meta: ContextMetadata
    logit_rows: torch.Tensor  # this rank's rows that need logits, in plan order
    counts: list[int]  # how many such rows each context rank has
    order: torch.Tensor  # the plan's order of the rows gathered rank by rank
    lora_slots: list[int]  # each of this rank's rows: its LoRA adapter slot (-1: none)


@dataclass
class _Rows:
    """What the step builds up, entry by entry."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    write_rows: list[int]
    tables: list[list[int]]
    lens: list[int]
    chunks: list[ContextChunk]
    sample: list[tuple[int, int]]  # (owning context rank, its row) of each sampled row
    score: list[tuple[int, int]]
    lora: list[int]  # each row's adapter slot
    num_rows: int = 0


class ContextSplit:
    """Turns plans into this context rank's rows; remembers which of each request's pages are its own."""

    def __init__(self, comm: Communicator, pages_per_part: int, page_size: int, device: torch.device,
                 first_stage: bool):
        self.comm, self.me, self.parts = comm, comm.rank, comm.size
        self.per, self.p, self.device = pages_per_part, page_size, device
        self.first = first_stage
        self.own: dict[str, tuple[list[int], list[int]]] = {}  # rid -> (page indexes, local pages), ascending

    def forget(self, rid: str) -> None:
        self.own.pop(rid, None)

    def _sync(self, rid: str, pages: list[int], page_base: int) -> tuple[list[int], list[int]]:
        """This rank's pages of a request whose list changed from `page_base` on (O(new pages))."""
        idx, local = self.own.setdefault(rid, ([], []))
        keep = bisect_right(idx, page_base - 1)
        del idx[keep:], local[keep:]
        for i in range(page_base, len(pages)):
            if pages[i] // self.per == self.me:
                idx.append(i)
                local.append(pages[i] % self.per)
        return idx, local

    def inputs(self, entries: list[PlanEntry], pages_of: dict[str, list[int]]) -> tuple[list[int], list[int],
                                                                                            ContextStep]:
        """(token ids to embed, positions, the step's context inputs) of this rank's rows."""
        rows = _Rows([], [], [], [], [], [], [], [], [], [])
        for e in entries:
            pages = pages_of[e.rid]
            idx, local = self._sync(e.rid, pages, e.page_base)
            if len(e.token_ids) == 1:
                self._decode(rows, e, pages, idx, local)
            else:
                self._chunk(rows, e, pages, idx, local)
        return rows.token_ids, rows.positions, self._step(rows, sum(len(e.token_ids) == 1 for e in entries))

    def _decode(self, rows: _Rows, e: PlanEntry, pages: list[int], idx: list[int], local: list[int]) -> None:
        p, pos, r = self.p, e.start, rows.num_rows
        last = pos // p
        k = bisect_right(idx, last)
        holds_last = bool(k) and idx[k - 1] == last
        rows.tables.append(local[:k])
        rows.lens.append(p * k - (p - pos % p - 1) * holds_last)
        if holds_last:
            rows.slots.append(local[k - 1] * p + pos % p)
            rows.write_rows.append(r)
        if self.first:
            rows.token_ids.append(e.token_ids[0])
        rows.positions.append(pos)
        rows.lora.append(e.lora_slot)
        # Every rank has a decode's row: context rank 0 gives its logits.
        if e.sample:
            rows.sample.append((0, r))
        if e.score_count:
            rows.score.append((0, r))
        rows.num_rows += 1

    def _chunk(self, rows: _Rows, e: PlanEntry, pages: list[int], idx: list[int], local: list[int]) -> None:
        p, start, end, r = self.p, e.start, e.start + len(e.token_ids), rows.num_rows
        last = (end - 1) // p
        k = bisect_right(idx, last)
        offsets = torch.arange(p)
        k_pos = (torch.tensor(idx[:k], dtype=torch.long)[:, None] * p + offsets).reshape(-1)
        slots = (torch.tensor(local[:k], dtype=torch.long)[:, None] * p + offsets).reshape(-1)
        keep = k_pos < end
        k_pos, slots = k_pos[keep], slots[keep]
        mine = k_pos >= start
        q_pos = k_pos[mine]
        q_len = len(q_pos)
        rows.slots.extend(slots[mine].tolist())
        rows.write_rows.extend(range(r, r + q_len))
        if self.first:
            rows.token_ids.extend(e.token_ids[i] for i in (q_pos - start).tolist())
        rows.positions.extend(q_pos.tolist())
        rows.lora.extend([e.lora_slot] * q_len)
        held = [0] * self.parts  # every rank's keys through the chunk: its ring block's length
        for g in pages[: last + 1]:
            held[g // self.per] += p
        held[pages[last] // self.per] -= p - (end - 1) % p - 1
        rows.chunks.append(ContextChunk(r, q_len, q_pos.to(self.device), slots.to(self.device),
                                        k_pos.to(self.device), held))
        if e.sample and not e.num_draft:  # the chunk's last position: the last of its owner's rows
            rows.sample.append((pages[last] // self.per, r + q_len - 1))
        elif e.sample:  # and the positions before each proposal (speculative decoding)
            wanted = torch.arange(end - 1 - e.num_draft, end)
            for pos, i in zip(wanted.tolist(), torch.searchsorted(q_pos, wanted).tolist()):
                rows.sample.append((pages[pos // p] // self.per, r + i))
        if e.score_count:
            scored = torch.arange(e.score_first, e.score_first + e.score_count)
            at = torch.searchsorted(q_pos, scored).tolist()
            for pos, i in zip(scored.tolist(), at):
                rows.score.append((pages[pos // p] // self.per, r + i))
        rows.num_rows += q_len

    def _step(self, rows: _Rows, num_decode: int) -> ContextStep:
        dev = self.device
        width = max([len(t) for t in rows.tables] + [1])
        table = torch.zeros(len(rows.tables), width, dtype=torch.long)
        for j, t in enumerate(rows.tables):
            table[j, : len(t)] = torch.tensor(t, dtype=torch.long)
        every = len(rows.write_rows) == rows.num_rows
        meta = ContextMetadata(self.comm, torch.tensor(rows.slots, dtype=torch.long, device=dev),
                               None if every else torch.tensor(rows.write_rows, dtype=torch.long, device=dev),
                               num_decode, table.to(dev), torch.tensor(rows.lens, dtype=torch.long, device=dev),
                               max(rows.lens, default=0), rows.chunks, self.p)
        wanted = rows.sample + rows.score
        counts, order, seen = [0] * self.parts, [], [0] * self.parts
        for owner, _ in wanted:
            counts[owner] += 1
        base = [sum(counts[:o]) for o in range(self.parts)]
        for owner, _ in wanted:
            order.append(base[owner] + seen[owner])
            seen[owner] += 1
        mine = [row for owner, row in wanted if owner == self.me]
        return ContextStep(meta, torch.tensor(mine, dtype=torch.long, device=dev), counts,
                           torch.tensor(order, dtype=torch.long, device=dev), rows.lora)
