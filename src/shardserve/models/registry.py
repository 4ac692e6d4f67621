"""Architecture name (config.json's `architectures[0]`) -> model class."""

from __future__ import annotations

from shardserve.models.blocks import CausalLM
from shardserve.models.deepseek import DeepseekV2ForCausalLM
from shardserve.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from shardserve.models.llama import LlamaForCausalLM
from shardserve.models.mixtral import MixtralForCausalLM
from shardserve.models.phi3 import Phi3ForCausalLM
from shardserve.models.qwen2 import Qwen2ForCausalLM
from shardserve.models.qwen2_moe import Qwen2MoeForCausalLM
from shardserve.models.qwen3 import Qwen3ForCausalLM
from shardserve.models.qwen3_moe import Qwen3MoeForCausalLM

MODELS: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV2ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
}


def model_class(architecture: str) -> type[CausalLM]:
    try:
        return MODELS[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(MODELS))}"
        ) from None
