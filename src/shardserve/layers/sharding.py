"""Arithmetic of splitting a dimension across ranks, shared by every parallel layer.

Splits are contiguous and as even as possible: the first `total % parts` ranks get one more.
That lets N ranks split sizes N does not divide (9 heads on 2 ranks: 5 and 4).
"""

from __future__ import annotations

from dataclasses import dataclass


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of piece `index` when `total` items are cut into `parts` contiguous pieces."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class HeadShard:
    """Which query and KV heads one rank owns.

    A rank owns a contiguous range of query heads and every KV head those queries read; a KV
    head whose query group straddles two ranks is held (replicated) by both. `kv_of_q` maps each
    local query head to its local KV head.
    """

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int
    kv_of_q: tuple[int, ...]

    @property
    def num_q(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv(self) -> int:
        return self.kv_end - self.kv_start


def head_shard(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadShard:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if tp_size > num_heads:
        raise ValueError(f"tp_size {tp_size} exceeds the {num_heads} attention heads")
    group = num_heads // num_kv_heads
    q0, q1 = split_range(num_heads, tp_size, tp_rank)
    kv0, kv1 = q0 // group, (q1 - 1) // group + 1
    return HeadShard(q0, q1, kv0, kv1, tuple(h // group - kv0 for h in range(q0, q1)))
