"""The one-line refusal of a KV budget too small for a page, worded alike wherever it is caught:
by the launcher for a byte count, by the rank for a fraction of its free memory."""

from __future__ import annotations

import math


def kv_budget_message(setting: float, budget: float, per_page: int, page_size: int) -> str:
    """`setting`: --kv-cache-memory as given; `budget`: the bytes it came to."""
    given = f"{int(budget)} bytes" if setting > 1 else f"{setting} of free memory ({int(budget)} bytes)"
    return (f"--kv-cache-memory {given} holds no KV page: one page of {page_size} tokens takes {per_page} bytes "
            f"on a rank (K and V, all its layers), so give at least {per_page} ({size_text(per_page)}), or a "
            f"smaller --page-size")


def size_text(n: int) -> str:
    """A byte count as --kv-cache-memory takes it, rounded up: 8192 -> 8K, 10000 -> 10K."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= scale:
            return f"{math.ceil(n / scale)}{unit}"
    return str(n)
