"""A decode step's decoder layers in one C call (csrc/decode_loop.c), where they fit it.

It applies to a dense llama-family stack (llama, qwen2, qwen3, phi3; gemma3's norms after each
block and GELU too; a window on some layers, each layer reading its own pages and rope tables)
on the CPU in float32 with every
linear weight held as row segments for the C kernels (block-quantized: a GGUF under
--quantization auto, or int8; or float32 weights as F32 rows), run by one tensor rank, and to
steps made only of decode rows attended by the CPU paged kernel. LoRA adapters' products (layers/
lora.py) run inside it, by the same C functions the modules call. Anything else runs the modules
one by one, with the same arithmetic.

The weights' and caches' addresses are gathered once (the tensors never move after loading);
each step passes only the rows, positions and pages.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from shardserve.attention import cpu_kernel
from shardserve.layers import kernels
from shardserve.layers.attention import ForwardContext, SelfAttention
from shardserve.layers.linear import PackedLinear
from shardserve.layers.mlp import GatedMLP

i64, ptr = ctypes.c_int64, ctypes.c_void_p


class Seg(ctypes.Structure):
    _fields_ = [("type", i64), ("rows", i64), ("row_bytes", i64), ("data", ptr)]


class Mat(ctypes.Structure):
    _fields_ = [("nseg", i64), ("seg", Seg * 3)]


class LoraMat(ctypes.Structure):
    _fields_ = [("a", ptr), ("bt", ptr), ("k", i64), ("r", i64), ("npieces", i64), ("piece_end", i64 * 3)]


class LoraRowsC(ctypes.Structure):
    _fields_ = [("order", ptr), ("bounds", ptr), ("gslot", ptr), ("ngroups", i64)]


class Layer(ctypes.Structure):
    _fields_ = [("ln1", ptr), ("ln2", ptr), ("qkv_bias", ptr), ("q_norm", ptr), ("k_norm", ptr),
                ("qkv", Mat), ("o", Mat), ("gate_up", Mat), ("down", Mat), ("k_cache", ptr), ("v_cache", ptr),
                ("lqkv", LoraMat), ("lo", LoraMat), ("lgate_up", LoraMat), ("ldown", LoraMat),
                ("post_attn", ptr), ("post_ffn", ptr), ("windowed", i64)]


class Dims(ctypes.Structure):
    _fields_ = [("hidden", i64), ("hq", i64), ("hkv", i64), ("d", i64), ("inter", i64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("kv_of_q", ptr), ("kv_bf16", i64), ("rd", i64), ("act", i64),
                ("softcap", ctypes.c_float)]


class Window(ctypes.Structure):
    _fields_ = [("cos", ptr), ("sin", ptr), ("block_tables", ptr), ("context_lens", ptr), ("skips", ptr),
                ("max_pages", i64)]


ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # Dims.act


def _mat(linear: PackedLinear) -> Mat:
    segs = linear.quant
    m = Mat(nseg=len(segs))
    for i, (_, q) in enumerate(segs):
        m.seg[i] = Seg(q.qtype, q.rows, q.data.stride(0), q.data.data_ptr())
    return m


def _lora_mat(linear: PackedLinear) -> LoraMat:
    """A layer's adapter slots as the C loop reads them (the same tensors the module path reads)."""
    w = linear.lora
    if w is None:
        return LoraMat()
    ends = (i64 * 3)(*w.piece_end)
    return LoraMat(w.a.data_ptr(), w.bt.data_ptr(), w.k, w.rank, len(w.piece_end), ends)


def _linears(layer: torch.nn.Module) -> tuple[PackedLinear, ...]:
    """A layer's four products, in the order the C loop runs them."""
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _fits(layer: torch.nn.Module) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = layer.loop_norms() if hasattr(layer, "loop_norms") else None
    if (norms is None or not isinstance(attn, SelfAttention) or type(mlp) is not GatedMLP
            or mlp.activation not in ACTIVATIONS):
        return False
    linears = _linears(layer)
    # Adapter slots: CPU float32 and whole (one tensor rank: the loop never shards them).
    adapted = [lin.lora for lin in linears if lin.lora is not None]
    return (all(lin.quant is not None and len(lin.quant) <= 3 for lin in linears)
            and all(w.a.dtype == torch.float32 and w.a.device.type == "cpu" and not w.fully for w in adapted)
            and attn.o_proj.bias is None and attn.o_proj.comm.size == 1 and mlp.down_proj.reduce
            and all(n.weight.dtype == torch.float32 and n.weight.device.type == "cpu" for n in norms if n is not None))


class DecodeLoop:
    """The C layer loop over a stage's layers; `build` answers None where it does not apply."""

    def __init__(self, layers: Sequence[torch.nn.Module], lib: ctypes.CDLL):
        first = layers[0].self_attn
        self.layers, self.lib, self.attn_fn = list(layers), lib, 0
        self.kv_index = first.heads.kv_index
        mlp = layers[0].mlp
        self.dims = Dims(hidden=first.o_proj.out_features, hq=first.hq, hkv=first.hkv, d=first.d,
                         inter=mlp.down_proj.end - mlp.down_proj.start, eps=layers[0].input_layernorm.eps,
                         scale=first.heads.scale, kv_of_q=self.kv_index.data_ptr(), rd=first.rotary_dim,
                         act=ACTIVATIONS[mlp.activation], softcap=first.heads.softcap)
        self._table: ctypes.Array | None = None
        self._key = 0
        # The step's adapter rows are shared by every adapted layer of the runner (layers/lora.py).
        adapted = [lin.lora for layer in layers for lin in _linears(layer) if lin.lora is not None]
        self.lora_step = adapted[0].step if adapted else None

    @classmethod
    def build(cls, layers: Sequence[torch.nn.Module]) -> DecodeLoop | None:
        if not layers or not all(_fits(layer) for layer in layers):
            return None
        try:
            lib = kernels.load()
            cpu_kernel.load()
        except kernels.KernelUnavailable:  # shardserve.native has warned; the modules run one by one
            return None
        return cls(layers, lib)

    def applies(self, x: torch.Tensor, ctx: ForwardContext) -> bool:
        meta = ctx.attn
        # The C loop calls the C attention kernel: only where the runner's backend is that one.
        return (ctx.backend.name == "cpu" and meta.paged is not None and not meta.prefills
                and (ctx.attn_window is None or ctx.attn_window.paged is not None)
                and not meta.decode_groups and meta.num_decode == x.shape[0]
                and ctx.after_layer is None and x.dtype == torch.float32)

    def _layer_table(self, ctx: ForwardContext) -> ctypes.Array:
        # The pool's caches are made once; a new pool (a new first K cache) means new addresses.
        first = ctx.kv_caches[self.layers[0].self_attn.layer_idx][0]
        key = first.data_ptr()
        if self._table is None or key != self._key:
            # The attention kernel for the pool's dtype, whose rows the loop writes in that dtype.
            self.attn_fn = ctypes.cast(cpu_kernel.function(first.dtype), ctypes.c_void_p).value
            self.dims.kv_bf16 = int(first.dtype == torch.bfloat16)
            table = (Layer * len(self.layers))()
            for i, layer in enumerate(self.layers):
                attn, mlp = layer.self_attn, layer.mlp
                k_cache, v_cache = ctx.kv_caches[attn.layer_idx]
                ln1, post_attn, ln2, post_ffn = (None if n is None else n.weight for n in layer.loop_norms())
                table[i] = Layer(
                    ln1=ln1.data_ptr(), ln2=ln2.data_ptr(), post_attn=_ptr(post_attn), post_ffn=_ptr(post_ffn),
                    windowed=int(attn.windowed),
                    qkv_bias=attn.qkv_proj.bias.data_ptr() if attn.qkv_proj.bias is not None else None,
                    q_norm=attn.q_norm.weight.data_ptr() if attn.q_norm is not None else None,
                    k_norm=attn.k_norm.weight.data_ptr() if attn.k_norm is not None else None,
                    qkv=_mat(attn.qkv_proj), o=_mat(attn.o_proj), gate_up=_mat(mlp.gate_up_proj),
                    down=_mat(mlp.down_proj), k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
                    lqkv=_lora_mat(attn.qkv_proj), lo=_lora_mat(attn.o_proj), lgate_up=_lora_mat(mlp.gate_up_proj),
                    ldown=_lora_mat(mlp.down_proj))
            self._table, self._key = table, key
        return self._table

    def run(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The residual stream after every layer, for this step's decode rows."""
        meta, (cos, sin) = ctx.attn, ctx.rope
        x = x.contiguous().clone()
        cos, sin = cos.contiguous(), sin.contiguous()
        tables, lens, slots = meta.paged.block_tables, meta.paged.context_lens, meta.slot_mapping
        table = self._layer_table(ctx)  # first: it picks attn_fn for the pool's dtype
        rows = self.lora_step.rows if self.lora_step is not None else None
        lrows = (LoraRowsC(rows.order.data_ptr(), rows.bounds.data_ptr(), rows.gslot.data_ptr(), rows.ngroups)
                 if rows is not None else None)
        skips = meta.paged.skips.data_ptr() if meta.paged.skips is not None else None
        win = _window(ctx)
        rc = self.lib.decode_layers(
            ctypes.addressof(table), len(self.layers), ctypes.addressof(self.dims), x.data_ptr(),
            x.shape[0], cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1],
            lens.data_ptr(), skips, meta.page_size, self.attn_fn, torch.get_num_threads(),
            ctypes.addressof(lrows) if lrows is not None else None, ctypes.addressof(win[0]) if win else None)
        if rc == 1:
            raise ValueError("decode_layers: a weight's block format or shape is not supported")
        if rc:
            raise MemoryError("decode_layers: out of memory for the step's scratch buffers")
        return x


def _window(ctx: ForwardContext) -> tuple[Window, list[torch.Tensor]] | None:
    """What the windowed layers read where the others attend fully (their pages under the
    window, their rope tables), with the tensors it points into; None where they read the same."""
    if ctx.attn_window is None and ctx.rope_window is None:
        return None
    keep: list[torch.Tensor] = []
    w = Window()
    if ctx.rope_window is not None:
        keep += [t.contiguous() for t in ctx.rope_window]
        w.cos, w.sin = keep[0].data_ptr(), keep[1].data_ptr()
    if ctx.attn_window is not None:
        p = ctx.attn_window.paged
        w.block_tables, w.context_lens, w.skips = p.block_tables.data_ptr(), p.context_lens.data_ptr(), _ptr(p.skips)
        w.max_pages = p.block_tables.shape[1]
    return w, keep
