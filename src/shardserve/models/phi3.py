"""Phi-3, Phi-3.5 and Phi-4(-mini): Llama's decoder, with q/k/v and gate/up stored fused in the
checkpoint (split back here into the pieces each layer shards), LongRoPE scaling and partial
rotary read from config.json (model_config.py)."""

from collections.abc import Sequence

from shardserve.loader.lora import FUSED_TARGETS, fused_rows, module_shapes
from shardserve.loader.source import RowsSource, TensorSource
from shardserve.models.blocks import CausalLM


class Phi3ForCausalLM(CausalLM):
    def checkpoint_pieces(self, src: TensorSource) -> Sequence[TensorSource]:
        fused = next((m for m in FUSED_TARGETS if f".{m}." in src.name), None)
        if fused is None:
            return (src,)
        c = self.cfg
        shapes = module_shapes(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size)
        pieces = fused_rows(fused, {m: out for m, (_, out) in shapes.items()})
        if src.shape[0] != pieces[-1][2]:
            raise ValueError(f"{src.name}: {src.shape[0]} rows, expected "
                             f"{' + '.join(str(end - start) for _, start, end in pieces)}")
        return [RowsSource(src.name.replace(f".{fused}.", f".{p}."), src, start, end - start)
                for p, start, end in pieces]
