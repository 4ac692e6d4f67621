"""Linear layers that know how they split across tensor-parallel ranks.

Every weight carries a `weight_loader(param, source, shard_id)` hook (nano-vllm's pattern): the
loader streams a checkpoint tensor in and the layer reads only its own rows or columns. Fused
layers (q/k/v, gate/up) are filled piece by piece *after* each piece is sharded.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from shardserve.distributed.communicator import Communicator
from shardserve.layers import quant_kernel
from shardserve.layers.lora import LoraStep, LoraWeights
from shardserve.layers.sharding import HeadShard, split_range
from shardserve.loader.quantized import BF16, QuantWeight
from shardserve.loader.source import TensorSource


def make_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, loader, shards) -> nn.Parameter:
    """A parameter with its loader hook and the set of shard ids the loader must deliver."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    p.weight_loader = loader
    p.expected_shards = frozenset(shards)
    return p


def copy_into(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: checkpoint piece has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


# Row count oneDNN tunes a packed weight's layout for; any count works with it.
PACK_ROWS_HINT = 64


@functools.cache
def _onednn_linear_works() -> bool:
    """The packing ops are private to torch (inductor uses them): check once that this build has
    them and that they agree with F.linear, else keep F.linear."""
    try:
        w, x = torch.arange(32.0).view(8, 4) / 7, torch.arange(12.0).view(3, 4) / 5
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(y, F.linear(x, w), atol=1e-5))
    except (AttributeError, RuntimeError):
        return False


def packable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and _onednn_linear_works())


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a CPU float32 [out, in] weight, or None where it does not apply.

    On the CPU, oneDNN against a pre-packed weight beats MKL's sgemm on the plain one at every
    batch size we run, one row to a long prefill (the README's measurements give the ratios).
    """
    if not packable(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def apply_linear(x: torch.Tensor, weight: torch.Tensor | None, packed: torch.Tensor | None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) through the packed weight when there is one."""
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def merge_segments(pieces: dict[int, QuantWeight]) -> tuple[tuple[int, QuantWeight], ...]:
    """Row pieces (offset -> weight) in order, neighbours of one format joined into one, each in
    the layout the kernels multiply (quant_kernel.kernel_layout)."""
    out: list[tuple[int, QuantWeight]] = []
    for offset, q in sorted(pieces.items()):
        if out and out[-1][1].qtype == q.qtype and out[-1][0] + out[-1][1].rows == offset:
            prev = out[-1][1]
            out[-1] = (out[-1][0], QuantWeight(q.qtype, torch.cat([prev.data, q.data]), q.cols))
        else:
            out.append((offset, q))
    return tuple((offset, quant_kernel.kernel_layout(q)) for offset, q in out)


class PackedLinear(nn.Module):
    """Base of the linear layers. After loading, the weight takes one of three forms:
    row segments for the C kernels (`quant`): block-quantized pieces kept as the checkpoint
    stored them (a GGUF under --quantization auto, or int8) or a CPU float32 weight as F32 rows;
    oneDNN's packed copy of a CPU float32 weight the C kernels do not take (`packed`); or the
    plain weight. The forms not taken are dropped, so memory does not double."""

    weight: nn.Parameter | None
    packed: torch.Tensor | None = None
    quant: tuple[tuple[int, QuantWeight], ...] | None = None
    # False where the weight must keep float32 precision (a DeepSeek gate): bfloat16 rows offered
    # under --dtype bfloat16 are then not taken, and the weight loads as floats.
    takes_bf16_rows = True
    lora: LoraWeights | None = None  # adapter slots (--enable-lora), attached after building
    _bf16_input = False  # decided once, after loading (takes_bf16_input)

    def __init__(self) -> None:
        super().__init__()
        self._qpieces: dict[int, QuantWeight] = {}

    def take_quantized(self, src: TensorSource, row: int, dim: int | None, start: int = 0,
                       end: int | None = None) -> bool:
        """Keep this piece (local rows from `row`) in its block format if the source offers it;
        a row-parallel cut inside a block is not offered, and that piece loads as floats."""
        q = src.read_quantized(dim, start, end)
        if q is None or (q.qtype == BF16 and not self.takes_bf16_rows):
            return False
        self._qpieces[row] = q
        return True

    @property
    def takes_bf16_input(self) -> bool:
        """Whether this layer takes its input already rounded to bfloat16 (quant_kernel.takes_bf16),
        which the op before it can hand on in place of float32; not with an adapter, whose
        product reads the float32 input."""
        return self._bf16_input and self.lora is None

    def process_after_loading(self) -> None:
        pieces, self._qpieces = self._qpieces, {}
        if pieces and len(pieces) == len(self.weight.expected_shards):
            self.quant, self.weight = merge_segments(pieces), None
            self._bf16_input = quant_kernel.takes_bf16(self.quant)
            return
        for row, q in pieces.items():  # some pieces came quantized, some not: all floats then
            self.weight.data[row: row + q.rows].copy_(quant_kernel.dequantize(q))
        rows = quant_kernel.float_weight(self.weight)
        if rows is not None:
            self.quant, self.weight = ((0, rows),), None
            return
        self.packed = pack_weight(self.weight)
        if self.packed is not None:
            self.weight = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.quant is not None:
            return quant_kernel.linear(x, self.quant, self.out_features, bias)
        return apply_linear(x, self.weight, self.packed, bias)


class ReplicatedLinear(PackedLinear):
    """Every rank holds the whole weight (small layers such as the MoE router)."""

    def __init__(self, in_f: int, out_f: int, bias: bool, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.out_features = out_f
        self.weight = make_param((out_f, in_f), dtype, device, self._load, [None])
        self.bias = make_param((out_f,), dtype, device, self._load, [None]) if bias else None

    def _load(self, param: nn.Parameter, src: TensorSource, shard_id=None) -> None:
        if param is self.weight and self.take_quantized(src, 0, None):
            return
        copy_into(param.data, src.read(), src.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(PackedLinear):
    """Output features split across ranks; each rank returns its slice of the output.

    `pieces` lists the fused sub-matrices as (shard_id, global_rows, (start, end) of this rank):
    one piece for a plain layer, two for gate/up, three for q/k/v.
    """

    def __init__(self, in_f: int, pieces: list[tuple[object, tuple[int, int]]], bias: bool,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.offsets: dict[object, tuple[int, int, int]] = {}
        local = 0
        for shard_id, (start, end) in pieces:
            self.offsets[shard_id] = (local, start, end)
            local += end - start
        ids = list(self.offsets)
        self.in_features, self.out_features = in_f, local
        self.weight = make_param((local, in_f), dtype, device, self._load, ids)
        self.bias = make_param((local,), dtype, device, self._load, ids) if bias else None

    def _load(self, param: nn.Parameter, src: TensorSource, shard_id=None) -> None:
        local, start, end = self.offsets[shard_id]
        if param is self.weight and self.take_quantized(src, local, 0, start, end):
            return
        copy_into(param.data.narrow(0, local, end - start), src.read(0, start, end), src.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        if self.lora is not None:
            self.lora.add(x, y)
        return y

    def make_lora(self, step: LoraStep, slots: int, rank: int, comm: Communicator, fully_sharded: bool, dtype,
                  device) -> LoraWeights:
        """Adapter slots sharded like this layer: A whole, B split like the output pieces."""
        pieces = [(sid, local, start, end) for sid, (local, start, end) in self.offsets.items()]
        self.lora = LoraWeights(step, slots, rank, self.in_features, pieces, comm, fully_sharded, dtype, device)
        return self.lora


def column_linear(in_f: int, out_f: int, bias: bool, comm: Communicator, dtype, device) -> ColumnParallelLinear:
    return ColumnParallelLinear(in_f, [(None, split_range(out_f, comm.size, comm.rank))], bias, dtype, device)


def merged_column_linear(in_f: int, outs: list[int], bias: bool, comm: Communicator, dtype, device):
    """gate/up style: several equal-role matrices stacked on the output dim, shard ids 0..k-1."""
    pieces = [(i, split_range(o, comm.size, comm.rank)) for i, o in enumerate(outs)]
    return ColumnParallelLinear(in_f, pieces, bias, dtype, device)


def qkv_linear(hidden: int, head_dim: int, shard: HeadShard, bias: bool, dtype, device):
    """Fused q/k/v holding this rank's query heads and the KV heads they read."""
    d = head_dim
    pieces = [
        ("q", (shard.q_start * d, shard.q_end * d)),
        ("k", (shard.kv_start * d, shard.kv_end * d)),
        ("v", (shard.kv_start * d, shard.kv_end * d)),
    ]
    return ColumnParallelLinear(hidden, pieces, bias, dtype, device)


class RowParallelLinear(PackedLinear):
    """Input features split across ranks; partial outputs are summed by one all-reduce.

    The bias is added once, after the reduction. `reduce=False` leaves the partial sum to the
    caller, so an MoE block can fold several partials into a single all-reduce.
    """

    def __init__(self, in_f: int, out_f: int, bias: bool, comm: Communicator, dtype, device,
                 reduce: bool = True, in_range: tuple[int, int] | None = None):
        super().__init__()
        if bias and not reduce:
            raise ValueError("a bias must be added after the reduction; use reduce=True")
        self.comm, self.reduce = comm, reduce
        # Attention's o_proj passes head-aligned ranges; everything else splits evenly.
        self.start, self.end = in_range or split_range(in_f, comm.size, comm.rank)
        self.out_features = out_f
        self.weight = make_param((out_f, self.end - self.start), dtype, device, self._load_w, [None])
        self.bias = make_param((out_f,), dtype, device, self._load_b, [None]) if bias else None

    def _load_w(self, param: nn.Parameter, src: TensorSource, shard_id=None) -> None:
        if self.take_quantized(src, 0, 1, self.start, self.end):
            return
        copy_into(param.data, src.read(1, self.start, self.end), src.name)

    def _load_b(self, param: nn.Parameter, src: TensorSource, shard_id=None) -> None:
        copy_into(param.data, src.read(), src.name)

    def make_lora(self, step: LoraStep, slots: int, rank: int, comm: Communicator, fully_sharded: bool, dtype,
                  device) -> LoraWeights:
        """Adapter slots sharded like this layer: A split like the input, B whole."""
        self.lora = LoraWeights(step, slots, rank, 0, [], self.comm, fully_sharded, dtype, device,
                                in_range=(self.start, self.end), out_f=self.out_features)
        return self.lora

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        if self.lora is not None:  # the partial product joins the partial sum: one all-reduce still
            self.lora.add(x, y)
        if self.reduce:
            y = self.comm.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
