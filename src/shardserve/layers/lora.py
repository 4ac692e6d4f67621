"""LoRA adapters on a linear layer: every resident adapter's matrices in slots, applied to each
row with its own adapter in one batch (S-LoRA's and Punica's segmented products).

A linear that may carry adapters gets a `LoraWeights` (engine/lora_runtime.py attaches them). Its
slots hold, for slot s: A [k, in] (a fused layer's pieces one after another, `rank` rows each,
zero past an adapter's own rank) and B transposed, Bt [rank, out] with the scale folded in. A step's
rows name their slots (`LoraRows`, -1 for the base model); the layer adds scale * B (A x) to each
adapter row's output.

How the matrices shard follows the layer they attach to, written here once:
- column-parallel (q/k/v, gate/up): A whole, B split like the layer's output rows. With
  --fully-sharded-loras A is split by rank too, and the step's A x is gathered over the tensor group.
- row-parallel (o, down): A split like the layer's input, B whole; each rank adds its partial
  B (A_i x_i) before the layer's one all-reduce, so no collective is added. With
  --fully-sharded-loras B is split by output: A x is all-reduced first, each rank adds its columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from shardserve.distributed.communicator import Communicator
from shardserve.layers.cpu_ops import cpu_float32
from shardserve.layers.kernels import load_or_none
from shardserve.layers.sharding import split_range


@dataclass
class LoraRows:
    """A step's adapter rows grouped by slot, as the C kernel reads them: `order` (the groups' rows
    one after another), `bounds` (where each group starts, and the end), `gslot` (each group's
    slot); `groups` gives (slot, row indices) per group for the torch path. Base-model rows are in
    no group."""

    by_slot: dict[int, list[int]]
    device: torch.device
    order: torch.Tensor
    bounds: torch.Tensor
    gslot: torch.Tensor

    @property
    def ngroups(self) -> int:
        return len(self.by_slot)

    @cached_property
    def groups(self) -> list[tuple[int, torch.Tensor]]:
        """Made only where the torch path runs (the C kernel reads the flat tensors)."""
        return [(s, torch.tensor(rows, dtype=torch.long, device=self.device)) for s, rows in self.by_slot.items()]

    @classmethod
    def of(cls, per_row: list[int], device: torch.device) -> LoraRows | None:
        """None where no row runs an adapter (the step is the base model's alone)."""
        by_slot: dict[int, list[int]] = {}
        for row, s in enumerate(per_row):
            if s >= 0:
                by_slot.setdefault(s, []).append(row)
        if not by_slot:
            return None
        by_slot = dict(sorted(by_slot.items()))
        order = [row for rows in by_slot.values() for row in rows]
        bounds = [0]
        for rows in by_slot.values():
            bounds.append(bounds[-1] + len(rows))
        return cls(by_slot, device, _cpu_longs(order), _cpu_longs(bounds), _cpu_longs(list(by_slot)))


def _cpu_longs(values: list[int]) -> torch.Tensor:
    """The C kernel reads these on the CPU, whatever the model's device."""
    return torch.tensor(values, dtype=torch.long)


class LoraStep:
    """The current step's rows, shared by one runner's adapted layers (set before each forward)."""

    rows: LoraRows | None = None


class LoraWeights:
    """One linear layer's adapter slots.

    A column-parallel layer passes its output `pieces` in local order, each (shard id, local
    offset, global rows [start, end)); a row-parallel layer passes its input range `in_range`
    (global columns) and its output width `out_f`. `rank` is --max-lora-rank: every slot's size.
    """

    def __init__(self, step: LoraStep, slots: int, rank: int, in_f: int, pieces: list[tuple[object, int, int, int]],
                 comm: Communicator, fully_sharded: bool, dtype: torch.dtype, device: torch.device,
                 in_range: tuple[int, int] | None = None, out_f: int = 0):
        self.step, self.comm, self.rank = step, comm, rank
        self.row_parallel = in_range is not None
        self.fully = fully_sharded and comm.size > 1
        self.in_range, self.out_range = in_range, None
        if self.row_parallel:
            if self.fully:  # B split by output: this rank's columns
                self.out_range = split_range(out_f, comm.size, comm.rank)
            o0, o1 = self.out_range or (0, out_f)
            self.piece_end = [o1 - o0]
            in_local = in_range[1] - in_range[0]
            k_local = rank
        else:
            self.piece_of = {sid: (local, start, end) for sid, local, start, end in pieces}
            self.piece_end = [local + end - start for _, local, start, end in pieces]
            in_local = in_f
            # Fully sharded: each rank holds rank / size of every piece's A rows (rank padded up).
            self.rank_local = -(-rank // comm.size) if self.fully else rank
            k_local = len(pieces) * self.rank_local
        self.k = k_local
        out_local = self.piece_end[-1]
        self.a = torch.zeros(slots, k_local, in_local, dtype=dtype, device=device)
        self.bt = torch.zeros(slots, rank, out_local, dtype=dtype, device=device)
        self._ends = torch.tensor(self.piece_end, dtype=torch.long)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.bt[slot].zero_()

    def shard(self, shard_id: object, a: torch.Tensor, b: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
        """This rank's (A rows, Bt columns) of one piece's full A [r, in] and B [out, r]: what a
        host cache keeps, so a slot load is a copy."""
        r = a.shape[0]
        if self.row_parallel:
            i0, i1 = self.in_range
            o0, o1 = self.out_range or (0, b.shape[0])
            return a[:, i0:i1].contiguous(), (b[o0:o1] * scale).t().contiguous()
        _, start, end = self.piece_of[shard_id]
        if self.fully:
            j0 = self.comm.rank * self.rank_local
            a = a[j0 : min(j0 + self.rank_local, r)]
        return a.contiguous(), (b[start:end] * scale).t().contiguous()

    def write(self, slot: int, shard_id: object, a: torch.Tensor, bt: torch.Tensor) -> None:
        """Put one piece's sharded matrices (from `shard`) into `slot`."""
        if self.row_parallel:
            self.a[slot, : a.shape[0]].copy_(a)
            self.bt[slot, : bt.shape[0]].copy_(bt)
            return
        p = list(self.piece_of).index(shard_id)
        local, start, end = self.piece_of[shard_id]
        rows = self.rank_local
        self.a[slot, p * rows : p * rows + a.shape[0]].copy_(a)
        self.bt[slot, : bt.shape[0], local : local + end - start].copy_(bt)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += this step's adapter products for x's rows (y: the layer's output, or on a
        row-parallel layer its partial sum before the reduction)."""
        rows = self.step.rows
        if rows is None:
            return
        u = self._shrink(x, rows)
        if self.fully:
            u = self._combine(u)
        out = y if self.out_range is None else y[:, self.out_range[0] : self.out_range[1]]
        self._expand(u, rows, out)

    def _combine(self, u: torch.Tensor) -> torch.Tensor:
        """Fully sharded: row-parallel sums the partial A x; column-parallel gathers each rank's
        rank-slice of every piece back into piece order."""
        if self.row_parallel:
            return self.comm.all_reduce(u)
        t, pieces, rl = u.shape[0], len(self.piece_end), self.rank_local
        gathered = self.comm.all_gather(u.contiguous(), dim=1)  # [t, size * pieces * rl]
        full = gathered.view(t, self.comm.size, pieces, rl).transpose(1, 2).reshape(t, pieces, -1)
        return full[:, :, : self.rank].reshape(t, pieces * self.rank).contiguous()

    def _shrink(self, x: torch.Tensor, rows: LoraRows) -> torch.Tensor:
        x = x.contiguous()
        lib = load_or_none() if cpu_float32(x, self.a) else None
        if lib is not None:
            u = torch.zeros(x.shape[0], self.k, dtype=torch.float32)  # base rows: zero (a collective sums them)
            lib.lora_shrink_f32(x.data_ptr(), x.stride(0), x.shape[1], rows.order.data_ptr(), rows.bounds.data_ptr(),
                                rows.gslot.data_ptr(), rows.ngroups, self.a.data_ptr(), self.k, u.data_ptr(),
                                torch.get_num_threads())
            return u
        u = x.new_zeros(x.shape[0], self.k)
        for s, idx in rows.groups:
            u.index_copy_(0, idx, x.index_select(0, idx) @ self.a[s].t())
        return u

    def _expand(self, u: torch.Tensor, rows: LoraRows, y: torch.Tensor) -> None:
        r, out = self.rank, self.piece_end[-1]
        lib = load_or_none() if cpu_float32(u, y, self.bt) else None
        if lib is not None:
            lib.lora_expand_f32(u.data_ptr(), u.shape[1], rows.order.data_ptr(), rows.bounds.data_ptr(),
                                rows.gslot.data_ptr(), rows.ngroups, self.bt.data_ptr(), out, r,
                                self._ends.data_ptr(), len(self.piece_end), y.data_ptr(), y.stride(0),
                                torch.get_num_threads())
            return
        for s, idx in rows.groups:
            us, start = u.index_select(0, idx), 0
            delta = torch.empty(idx.numel(), out, dtype=y.dtype, device=y.device)
            for p, end in enumerate(self.piece_end):
                delta[:, start:end] = us[:, p * r : (p + 1) * r] @ self.bt[s, :, start:end]
                start = end
            y.index_add_(0, idx, delta)

