"""Phi-3, Phi-3.5 and Phi-4(-mini): Llama's decoder, with q/k/v and gate/up stored fused in the
checkpoint (split back here into the pieces each layer shards), LongRoPE scaling and partial
rotary read from config.json (model_config.py)."""

from collections.abc import Sequence

from shardserve.loader.source import RowsSource, TensorSource
from shardserve.models.blocks import CausalLM


class Phi3ForCausalLM(CausalLM):
    def checkpoint_pieces(self, src: TensorSource) -> Sequence[TensorSource]:
        c = self.cfg
        q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        for fused, parts in ((".qkv_proj.", (("q_proj", q), ("k_proj", kv), ("v_proj", kv))),
                             (".gate_up_proj.", (("gate_proj", inter), ("up_proj", inter)))):
            if fused not in src.name:
                continue
            if src.shape[0] != sum(n for _, n in parts):
                raise ValueError(f"{src.name}: {src.shape[0]} rows, expected {' + '.join(str(n) for _, n in parts)}")
            pieces, offset = [], 0
            for name, rows in parts:
                pieces.append(RowsSource(src.name.replace(fused, f".{name}."), src, offset, rows))
                offset += rows
            return pieces
        return (src,)
