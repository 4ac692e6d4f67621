"""Gemma 3's text model (Gemma3ForCausalLM: the 270M and 1B checkpoints; the 4B-27B's
Gemma3ForConditionalGeneration, served text only): Llama's decoder with
each norm scaling by 1 + w, a second norm on each block's output before the residual add, q/k
norms, the tanh-approximated GELU, embeddings scaled by sqrt(hidden), and a sliding window on
five layers in six with their own RoPE base (model_config.py reads which)."""

import torch

from shardserve.layers.attention import ForwardContext
from shardserve.layers.norm import OffsetRMSNorm
from shardserve.models.blocks import CausalLM, DecoderLayer


class GemmaDecoderLayer(DecoderLayer):
    def __init__(self, attn, mlp, cfg, dtype, device, norm=OffsetRMSNorm):
        super().__init__(attn, mlp, cfg, dtype, device, norm)
        self.pre_feedforward_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_feedforward_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), ctx))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def loop_norms(self):
        return (self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                self.post_feedforward_layernorm)


class Gemma3ForCausalLM(CausalLM):
    qk_norm = True
    norm_class = OffsetRMSNorm
    layer = GemmaDecoderLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # sqrt(hidden) in the activations' dtype, as transformers rounds it
        return x * torch.tensor(self.cfg.hidden_size**0.5, dtype=x.dtype)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The 4B-27B checkpoints: the text model under `language_model` (transformers 4's names,
    `language_model.model.*`, or 5's, `model.language_model.*`), served text only; the vision tower
    and its projector are not read."""

    # The text model's tensors under transformers 4's names, 5's, then Gemma3ForCausalLM's.
    PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                ("language_model.", "model."))

    def weight_target(self, name: str) -> tuple[str, object] | None:
        name = name.removeprefix("model.")
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return None
        theirs, ours = next(((t, o) for t, o in self.PREFIXES if name.startswith(t)), ("", ""))
        return super().weight_target(ours + name[len(theirs):])
