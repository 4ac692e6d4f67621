"""Per-step attention inputs, built once per step by the runner's backend and shared by every layer.

The batch is flat: the first `num_decode` tokens are one-token decodes, the rest are prefill
chunks laid end to end. Each backend's `prepare` (attention/backend.py) asks for the description
its kernels read:
- `paged`: each decode's block table and context length, for a kernel that reads the pages in
  place (the CPU C kernel, Triton's);
- `decode_groups`: decodes grouped by context length, each group with padded cache slots for a
  page gather + one SDPA call (so a 30-token context is not padded to 500);
- `extend`: every prefill chunk's block table, for a kernel that attends over the pool in place
  once the chunk's own K/V are written (Triton's);
- otherwise a prefill chunk with no earlier context attends to its own fresh K/V, and one with
  context (a later chunk, or a prefix-cache hit) lists the cache slots of its whole context.
Where prefill tokens are described as decodes (`paged_prefill`), each attends, by the same kernel
as a decode, to the cache up to its own position, so a token's attention is the same arithmetic
whether it is decoded, prefilled in one chunk or several, or follows a prefix that came from the
cache (the batch invariance the engine's greedy outputs rest on; EngineConfig.batch_invariant).

Under a sliding window (`window`: ModelConfig.attention_window) a token attends to its last
`window` keys only: a paged row's block table starts at the window's first page and `skips` says
how many keys of that page fall before it; masks and gathered slots say the same to SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillChunk:
    """One sequence's chunk: tokens [start, start+q_len) of the batch, ending at context kv_len."""

    start: int
    q_len: int
    kv_len: int
    kv_slots: torch.Tensor | None  # cache slots of all kv_len tokens; None when kv_len == q_len
    mask: torch.Tensor | None  # [q_len, kv_len] bool, True = may attend


@dataclass
class DecodeGroup:
    """Decodes of similar context length: batch rows `rows`, their padded cache slots [g, L] (under
    a window, of the window's keys only) and a mask [g, 1, 1, L] (None when no row is padded)."""

    rows: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class PagedDecode:
    """Every decode's pages: block_tables [B, max_pages] (unused entries 0), context_lens [B], and
    the longest context (known on the host, so no kernel launch waits to read it)."""

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    max_len: int = 0
    # Under a sliding window: keys at the start of each row's first page that it does not attend
    # to (its block table starts at the window's first page, context_lens counts from there).
    skips: torch.Tensor | None = None


@dataclass
class PagedExtend:
    """Every prefill chunk's pages: block_tables [C, max_pages], q_starts [C + 1] (rows of q, from 0
    at the first chunk), kv_lens [C] (context through the chunk), and the longest chunk."""

    block_tables: torch.Tensor
    q_starts: torch.Tensor
    kv_lens: torch.Tensor
    max_q: int


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of every new token
    num_decode: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    page_size: int = 0
    paged: PagedDecode | None = None
    paged_prefill: PagedDecode | None = None  # rows num_decode.. : each prefill token as a decode
    extend: PagedExtend | None = None  # rows num_decode.. : every chunk by its block table


# A decode joins the current group while its context is at least this fraction of the group's
# longest: padding waste stays under 1 - GROUP_RATIO, at a few extra SDPA calls per layer.
GROUP_RATIO = 0.6


def _decode_groups(decodes: list[tuple[list[int], int]], page_size: int, device: torch.device,
                   window: int | None) -> tuple[list[DecodeGroup], torch.Tensor]:
    """The groups, and each decode's new-token slot in batch order."""
    lens = torch.tensor([n for _, n in decodes])
    order = sorted(range(len(decodes)), key=lambda i: -decodes[i][1])
    groups, new_slots = [], torch.empty(len(decodes), dtype=torch.long)
    start = 0
    while start < len(order):
        width = decodes[order[start]][1]
        end = start
        while end < len(order) and decodes[order[end]][1] >= GROUP_RATIO * width:
            end += 1
        rows = torch.tensor(order[start:end])
        table = _block_table([decodes[i] for i in order[start:end]], page_size)
        g_lens = lens[rows]
        # Each row's keys from its first (under a window, its window's first), as many as the
        # longest row has (a window's at most).
        span = min(width, window) if window else width
        pos = _starts(g_lens, window)[:, None] + torch.arange(span)[None, :]
        # Padding reads the sequence's last real slot, never an unwritten one: the mask hides it,
        # but 0 * NaN from uninitialised cache memory would still poison the output.
        real = torch.minimum(pos, g_lens[:, None] - 1)
        slots = table.gather(1, real // page_size) * page_size + real % page_size
        last = g_lens - 1
        new_slots[rows] = table.gather(1, (last // page_size)[:, None]).squeeze(1) * page_size + last % page_size
        keep = pos < g_lens[:, None]
        mask = None if bool(keep.all()) else keep.view(len(rows), 1, 1, span)
        groups.append(DecodeGroup(rows.to(device), slots.to(device), None if mask is None else mask.to(device)))
        start = end
    return groups, new_slots


def _block_table(decodes: list[tuple[list[int], int]], page_size: int) -> torch.Tensor:
    """[len(decodes), pages of the longest context], rows padded with page 0."""
    width = max(-(-n // page_size) for _, n in decodes)
    table = torch.zeros(len(decodes), width, dtype=torch.long)
    for j, (pages, n) in enumerate(decodes):
        used = -(-n // page_size)
        table[j, :used] = torch.tensor(pages[:used])
    return table


def _starts(lens: torch.Tensor, window: int | None) -> torch.Tensor:
    """Each row's first key: 0, or under a window the first of its last `window` keys."""
    return (lens - window).clamp(min=0) if window else torch.zeros_like(lens)


def _paged_rows(table: torch.Tensor, lens: torch.Tensor, page_size: int, window: int | None,
                device: torch.device, ends: torch.Tensor | None = None) -> PagedDecode:
    """Rows of block table `table` with contexts `lens`; under a window each row's table starts
    at its window's first page (the entries past a row's pages are never read). `ends`: each
    row's own position + 1, where the window counts back from (default `lens`; an image token's
    context runs past itself, multimodal.py)."""
    ends = lens if ends is None else ends
    if not window or int(ends.max()) <= window:
        return PagedDecode(table.to(device), lens.to(device), int(lens.max()))
    starts = _starts(ends, window)
    first = starts // page_size
    index = (first[:, None] + torch.arange(table.shape[1])[None, :]).clamp(max=table.shape[1] - 1)
    skips = starts - first * page_size
    lens = lens - first * page_size
    return PagedDecode(table.gather(1, index).to(device), lens.to(device), int(lens.max()), skips.to(device))


def _paged(decodes: list[tuple[list[int], int]], page_size: int, device: torch.device,
           window: int | None) -> tuple[PagedDecode, torch.Tensor]:
    table = _block_table(decodes, page_size)
    lens = torch.tensor([n for _, n in decodes], dtype=torch.long)
    last = lens - 1
    new_slots = table.gather(1, (last // page_size)[:, None]).squeeze(1) * page_size + last % page_size
    return _paged_rows(table, lens, page_size, window, device), new_slots


def _slots(pages: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    pos = torch.arange(length)
    return pages[pos // page_size] * page_size + pos % page_size


def build_metadata(
    page_size: int,
    decodes: list[tuple[list[int], int]],
    prefills: list[tuple[list[int], int, int]],
    device: torch.device,
    paged_decode: bool = False,
    paged_prefill: bool = False,
    extend: bool = False,
    window: int | None = None,
    horizons: list[list[int] | None] | None = None,
) -> AttentionMetadata:
    """decodes: (pages, context length including the new token), in batch order;
    prefills: (pages, chunk length, context length through the chunk's last token).
    `paged_decode` describes decodes by block table instead of by padded groups, `paged_prefill`
    (with it) prefill tokens too, and `extend` (with it, not under a `window`) prefill chunks by
    block table. `horizons`: per chunk, None or each token's context length as it attends (an
    image's tokens see the whole image: multimodal.horizons; never with `extend`)."""
    assert not (extend and window), "a sliding window has no extend kernel (the caller refuses it)"
    paged_prefill = paged_prefill and paged_decode
    extend = extend and paged_decode and not paged_prefill
    slot_parts: list[torch.Tensor] = []
    groups: list[DecodeGroup] = []
    paged = None
    if decodes and paged_decode:
        paged, new_slots = _paged(decodes, page_size, device, window)
        slot_parts.append(new_slots)
    elif decodes:
        groups, new_slots = _decode_groups(decodes, page_size, device, window)
        slot_parts.append(new_slots)
    horizons = horizons or [None] * len(prefills)
    assert not (extend and any(h is not None for h in horizons)), "no extend kernel sees past a token"
    chunks, start = [], len(decodes)
    for (pages, q_len, kv_len), seen in zip(prefills, horizons):
        ctx = _slots(torch.tensor(pages, dtype=torch.long), kv_len, page_size)
        slot_parts.append(ctx[kv_len - q_len :])
        windowed = window is not None and kv_len > window
        plain = kv_len == q_len and not windowed and seen is None
        if plain or paged_prefill or extend:  # paged: no slots or mask
            chunks.append(PrefillChunk(start, q_len, kv_len, None, None))
        else:
            pos, keys = torch.arange(kv_len - q_len, kv_len)[:, None], torch.arange(kv_len)[None, :]
            ends = pos + 1 if seen is None else torch.tensor(seen)[:, None]
            mask = (keys < ends) & (keys > pos - window) if windowed else keys < ends
            slots = None if kv_len == q_len else ctx.to(device)  # fresh keys only: the chunk's own
            chunks.append(PrefillChunk(start, q_len, kv_len, slots, mask.to(device)))
        start += q_len
    # An empty step (data-parallel attention: a replica with no work joins its peers' MoE
    # collectives with zero tokens) writes no slot.
    slots = torch.cat(slot_parts).to(device) if slot_parts else torch.zeros(0, dtype=torch.long, device=device)
    pp = _paged_prefill(prefills, horizons, page_size, device, window) if prefills and paged_prefill else None
    ext = _extend(prefills, page_size, device) if prefills and extend else None
    return AttentionMetadata(slots, len(decodes), groups, chunks, page_size, paged, pp, ext)


def _extend(prefills: list[tuple[list[int], int, int]], page_size: int, device: torch.device) -> PagedExtend:
    table = _block_table([(pages, kv_len) for pages, _, kv_len in prefills], page_size)
    q_lens = [q_len for _, q_len, _ in prefills]
    starts = torch.tensor([0, *q_lens]).cumsum(0)
    kv_lens = torch.tensor([kv_len for _, _, kv_len in prefills])
    return PagedExtend(table.to(device), starts.to(device), kv_lens.to(device), max(q_lens))


def _paged_prefill(prefills: list[tuple[list[int], int, int]], horizons: list[list[int] | None], page_size: int,
                   device: torch.device, window: int | None) -> PagedDecode:
    """Every prefill token as a decode row: its chunk's block table, context through itself (an
    image token's, through its image)."""
    table = _block_table([(pages, kv_len) for pages, _, kv_len in prefills], page_size)
    q_lens = torch.tensor([q_len for _, q_len, _ in prefills])
    ends = [torch.arange(kv_len - q_len + 1, kv_len + 1) for _, q_len, kv_len in prefills]
    lens = [e if h is None else torch.tensor(h) for e, h in zip(ends, horizons)]
    return _paged_rows(table.repeat_interleave(q_lens, dim=0), torch.cat(lens), page_size, window, device,
                       torch.cat(ends))
