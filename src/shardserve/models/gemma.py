"""Gemma 2 and Gemma 3: Llama's decoder with each norm scaling by 1 + w, a second norm on each
block's output before the residual add, the tanh-approximated GELU, embeddings scaled by
sqrt(hidden), queries by query_pre_attn_scalar, and a sliding window on some layers (model_config.py
reads which). Gemma 2 caps attention scores and logits with tanh; Gemma 3 adds q/k norms and gives
its windowed layers their own RoPE base. Gemma3ForCausalLM holds the 270M and 1B checkpoints,
Gemma3ForConditionalGeneration the 4B-27B, which read images too."""

import torch

from shardserve.layers.attention import ForwardContext
from shardserve.layers.norm import OffsetRMSNorm
from shardserve.models.blocks import CausalLM, DecoderLayer, takes_bf16
from shardserve.models.vision import Gemma3VisionEncoder, vision_weight_name


class GemmaDecoderLayer(DecoderLayer):
    """Each block's output normed (post_attention_layernorm, post_feedforward_layernorm) before it
    joins the residual stream; pre_feedforward_layernorm is the norm before the MLP."""

    def __init__(self, attn, mlp, cfg, dtype, device, norm=OffsetRMSNorm):
        super().__init__(attn, mlp, cfg, dtype, device, norm)
        self.pre_feedforward_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_feedforward_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        attn, mlp = self.self_attn, self.mlp
        x = x + self.post_attention_layernorm(attn(positions, self.input_layernorm(x, takes_bf16(attn)), ctx))
        return x + self.post_feedforward_layernorm(mlp(self.pre_feedforward_layernorm(x, takes_bf16(mlp))))

    def loop_norms(self):
        """All four: the C decode loop norms each block's output too."""
        return (self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                self.post_feedforward_layernorm)


class Gemma2ForCausalLM(CausalLM):
    norm_class = OffsetRMSNorm
    layer = GemmaDecoderLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the activations' dtype, as transformers rounds it to the weights'
        # (the same but for --dtype bfloat16 on the CPU, whose activations are float32)
        return x * torch.tensor(self.cfg.hidden_size**0.5, dtype=x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if (cap := self.cfg.final_logit_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The 4B-27B checkpoints: the text model under `language_model` (transformers 4's names,
    `language_model.model.*`, or 5's, `model.language_model.*`), and on the first pipeline stage
    the image encoder (models/vision.py), replicated on every tensor-parallel rank."""

    # The text model's tensors under transformers 4's names (the model's, the head's), then 5's;
    # anything else (Gemma3ForCausalLM's names) as it is.
    PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                ("language_model.", "model."))

    def __init__(self, cfg, comm, dtype, device, stage=None, **kw):
        super().__init__(cfg, comm, dtype, device, stage, **kw)
        self.vision = Gemma3VisionEncoder(cfg.vision, dtype, device) if self.stage.first else None

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 RGB [N, size, size, 3] -> each image's rows of embeddings [N, tokens, hidden]."""
        return self.vision(pixels)

    def weight_target(self, name: str) -> tuple[str, object] | None:
        if (ours := vision_weight_name(name)) is not None:
            return ("vision." + ours, None) if self.vision is not None else None
        name = name.removeprefix("model.")
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return None  # SigLIP's pooling head, which Gemma 3 does not use
        theirs, ours = next(((t, o) for t, o in self.PREFIXES if name.startswith(t)), ("", ""))
        return super().weight_target(ours + name[len(theirs):])
