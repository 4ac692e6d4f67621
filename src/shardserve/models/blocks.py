"""The decoder stack every supported architecture shares; model files only pick the parts.

Parameter names mirror Hugging Face's (minus the `model.` prefix) so `weight_target` only has
to map the few checkpoint tensors that are fused here: q/k/v, gate/up, and stacked experts.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn

from shardserve.config import ModelConfig
from shardserve.distributed.communicator import Communicator
from shardserve.distributed.expert_placement import PlacementPlan
from shardserve.distributed.pipeline import Stage
from shardserve.layers.attention import ForwardContext, SelfAttention
from shardserve.layers.decode_loop import DecodeLoop
from shardserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shardserve.layers.mlp import GatedMLP
from shardserve.layers.moe import EXPERT_PIECES
from shardserve.layers.norm import RMSNorm
from shardserve.layers.rotary import RotaryEmbedding
from shardserve.loader.source import TensorSource

# Checkpoint name piece -> (our fused parameter's name piece, shard id).
FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


_UNBUILT = object()


class DecoderLayer(nn.Module):
    """Pre-norm attention, then pre-norm MLP, each added to the residual stream."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, cfg: ModelConfig, dtype, device,
                 norm: type[RMSNorm] = RMSNorm):
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # A norm hands its rows as bfloat16 where the product after it would round them so itself.
        x = x + self.self_attn(positions, self.input_layernorm(x, takes_bf16(self.self_attn)), ctx)
        return x + self.mlp(self.post_attention_layernorm(x, takes_bf16(self.mlp)))

    def loop_norms(self) -> tuple[RMSNorm, RMSNorm | None, RMSNorm, RMSNorm | None]:
        """The norms before the attention, after it, before the MLP and after it (None: none
        there), as the C decode loop runs a layer (layers/decode_loop.py)."""
        return self.input_layernorm, None, self.post_attention_layernorm, None

def takes_bf16(module: nn.Module) -> bool:
    """Whether `module` (an attention or MLP) takes its input as bfloat16 rows: its first product's
    takes_bf16_input, where it says (others take float32)."""
    return getattr(module, "takes_bf16_input", False)


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm, LM head. Subclasses override the hooks below.

    A pipeline stage builds only its part: the embedding on the first stage, layers
    [stage.start, stage.end) (other indices hold empty placeholders, so parameter names keep
    their checkpoint layer numbers), and the final norm and LM head on the last stage."""

    qk_norm = False
    norm_class = RMSNorm  # every norm's (Gemma's scales by 1 + w)
    layer = DecoderLayer
    fused = FUSED  # the checkpoint pieces this architecture fuses (see FUSED)
    # Checkpoint name pieces spelled otherwise than ours: (theirs, ours), replaced in order.
    renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, cfg: ModelConfig, comm: Communicator, dtype: torch.dtype, device: torch.device,
                 stage: Stage | None = None, expert: Communicator | None = None,
                 placements: PlacementPlan | None = None):
        """`expert`: the expert group MoE layers dispatch tokens over (expert parallelism), if any;
        `placements`: where each MoE layer's experts live over it (None: contiguous)."""
        super().__init__()
        self.cfg = cfg
        self.expert_comm, self.placements = expert, placements
        self.stage = stage = stage or Stage(0, 1, 0, cfg.num_layers)
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, comm, dtype, device)
                             if stage.first else None)
        positions = cfg.served_positions or cfg.max_position_embeddings
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, positions, cfg.rope_scaling, device)
        # The windowed layers' own tables (Gemma 3's local base, unscaled), where they have them.
        self.rotary_window = (RotaryEmbedding(cfg.rotary_dim, cfg.window_rope_theta, positions, None, device)
                              if cfg.window_rope_theta is not None else None)
        self.layers = nn.ModuleList(
            self.layer(
                self.make_attention(cfg, i, comm, dtype, device),
                self.make_mlp(cfg, i, comm, dtype, device),
                cfg, dtype, device, norm=self.norm_class,
            ) if stage.owns(i) else nn.Identity()
            for i in range(cfg.num_layers)
        )
        self.norm = self.lm_head = None
        self._loop: DecodeLoop | None | object = _UNBUILT
        if stage.last:
            self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
            # A tied head on a stage without the embedding loads the embedding matrix itself.
            tied = self.embed_tokens if cfg.tie_word_embeddings else None
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, comm, dtype, device, tied_to=tied)

    def make_attention(self, cfg: ModelConfig, layer: int, comm: Communicator, dtype, device) -> nn.Module:
        return SelfAttention(cfg, layer, comm, dtype, device, qk_norm=self.qk_norm, norm=self.norm_class)

    def make_mlp(self, cfg: ModelConfig, layer: int, comm: Communicator, dtype, device) -> nn.Module:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, comm, dtype, device, activation=cfg.mlp_activation)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, ctx: ForwardContext,
                hidden: torch.Tensor | None = None, embeds: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        """The final-normed hidden states on the last stage, the residual stream elsewhere.
        `embeds` (rows, vectors): rows whose embedding is given (an image's), not looked up."""
        if embeds is not None:  # their ids are placeholders, which may lie outside the vocabulary
            input_ids = input_ids.index_fill(0, embeds[0], 0)
        x = self.embed(input_ids) if self.stage.first else hidden
        if embeds is not None:
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
        ctx.rope = self.rotary.cos_sin(positions)
        if self.rotary_window is not None:
            ctx.rope_window = self.rotary_window.cos_sin(positions)
        loop = self._decode_loop()
        if loop is not None and loop.applies(x, ctx):
            x = loop.run(x, ctx)
            return self.norm(x) if self.stage.last else x
        for i in range(self.stage.start, self.stage.end):
            x = self.layers[i](positions, x, ctx)
            if ctx.after_layer is not None:
                ctx.after_layer(i)
        return self.norm(x) if self.stage.last else x

    def _decode_loop(self) -> DecodeLoop | None:
        """The C loop over this stage's layers for small decode steps, built on first use (after
        loading: it needs the quantized weights); None where it does not apply."""
        if self._loop is _UNBUILT:
            self._loop = DecodeLoop.build([self.layers[i] for i in range(self.stage.start, self.stage.end)])
        return self._loop

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def checkpoint_pieces(self, src: TensorSource) -> Sequence[TensorSource]:
        """The tensors `src` holds, each loaded on its own: itself, but where an architecture's
        checkpoints store fused what others store apart (models/phi3.py)."""
        return (src,)

    def weight_target(self, name: str) -> tuple[str, object] | None:
        """Our parameter name and shard id for a checkpoint tensor, or None to skip it (another
        stage's tensor is never read)."""
        if self.cfg.tie_word_embeddings and name == "lm_head.weight":
            return None  # some tied checkpoints still store it; the embedding is the source
        name = name.removeprefix("model.")
        for theirs, ours in self.renames:
            name = name.replace(theirs, ours)
        if not self._on_this_stage(name):
            if name == "embed_tokens.weight" and self.cfg.tie_word_embeddings and self.stage.last:
                return "lm_head.weight", None
            return None
        if name.startswith("lm_head."):
            return name, None
        m = _EXPERT.match(name)
        if m:
            stacked, _ = EXPERT_PIECES[m.group(3)]
            return f"{m.group(1)}.{stacked}", (int(m.group(2)), m.group(3))
        parts = name.split(".")
        for i, p in enumerate(parts):
            if p in self.fused:
                fused, shard = self.fused[p]
                return ".".join(parts[:i] + [fused] + parts[i + 1 :]), shard
        return name, None

    def _on_this_stage(self, name: str) -> bool:
        if name.startswith("layers."):
            return self.stage.owns(int(name.split(".")[1]))
        if name.startswith("embed_tokens."):
            return self.stage.first
        return self.stage.last  # the final norm and the LM head
