"""What config.json says, read the engine's way: DeepSeek's latent cache widths and gate rules,
Phi-3's rotary, sliding windows (on every layer or some), Gemma 3's two kinds of layer, and every
option the engine does not implement refused at start naming its field and value."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import (
    Gemma3TextConfig,
    MistralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
)

from shardserve.config import EngineConfig, ModelConfig
from shardserve.distributed.layout import LayoutError
from shardserve.launch.checks import check_context
from shardserve.scheduler.engine_core import EngineCore


def config_dict(tiny_model, arch: str) -> dict:
    path, _ = tiny_model(arch)
    with open(f"{path}/config.json") as f:
        return json.load(f)


def test_latent_cache_is_one_vector_per_token(tiny_model):
    cfg = ModelConfig.from_dict(config_dict(tiny_model, "deepseek_v3"))
    assert (cfg.num_kv_heads, cfg.kv_widths) == (1, (16 + 8, 0))  # kv_lora_rank + qk_rope_head_dim, no V
    assert cfg.kv_values_per_token(1, cfg.num_layers) == 2 * 24
    assert cfg.mlp_only_layers == (0,) and cfg.shared_expert_intermediate_size == 32
    assert (cfg.router.scoring, cfg.router.groups, cfg.router.correction_bias) == ("sigmoid", "top2", True)
    v2 = ModelConfig.from_dict(config_dict(tiny_model, "deepseek_v2"))
    assert v2.mla.q_lora_rank is None and (v2.router.scoring, v2.router.groups) == ("softmax", "max")
    core = EngineCore(EngineConfig(model=tiny_model("deepseek_v3")[0], num_pages=8, page_size=4, show_progress=False))
    assert tuple(core.runner.pool.k.shape) == (2, 32, 1, 24) and core.runner.pool.v.numel() == 0


def test_deepseek_gate_stays_float32_in_bfloat16(tiny_model):
    """As transformers keeps it: the routing of a bf16 model is chosen from float32 logits."""
    path, model = tiny_model("deepseek_v3")
    core = EngineCore(EngineConfig(model=path, dtype="bfloat16", num_pages=16, page_size=4, show_progress=False))
    gate = core.runner.model.layers[1].mlp.gate
    assert gate.e_score_correction_bias.dtype == torch.float32
    assert gate.weight.dtype == torch.float32 if gate.quant is None else gate.quant[0][1].name.startswith("F32")
    x = torch.randn(5, 48, dtype=torch.bfloat16)
    weights, experts = gate.route(x)
    ref_w, ref_e = model.model.layers[1].mlp.gate(x.float())[1:]
    assert weights.dtype == torch.bfloat16
    assert sorted(map(sorted, experts.tolist())) == sorted(map(sorted, ref_e.tolist()))


@pytest.mark.parametrize("arch,key,value,named", [
    ("deepseek_v3", "rope_parameters", {"rope_type": "dynamic", "rope_theta": 1e4}, "rope_type 'dynamic'"),
    ("deepseek_v3", "rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4},
     "rope_type 'longrope' without short_factor and long_factor"),
    ("phi3", "rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.7},
     "partial_rotary_factor 0.7 rotates 11 of 16 dims, an odd count"),
    ("llama", "partial_rotary_factor", 1.5, "partial_rotary_factor 1.5"),
    ("llama", "rope_parameters", {"rope_type": "linear", "rope_theta": 1e4}, "rope_type 'linear' without factor"),
    ("phi3", "rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                 "long_factor": [1.0] * 7}, "long_factor has 7 entries for a rotary width of 16"),
    ("deepseek_v2", "topk_method", "noaux_tc", "topk_method 'noaux_tc'"),
    ("deepseek_v3", "scoring_func", "softmax", "scoring_func 'softmax'"),
    ("deepseek_v3", "moe_layer_freq", 2, "moe_layer_freq 2"),
    ("deepseek_v3", "n_group", 3, "n_group 3 does not divide n_routed_experts 8"),
    ("mixtral", "hidden_act", "gelu", "hidden_act 'gelu'"),
    ("deepseek_v3", "quantization_config", {"quant_method": "fp8"}, "quantization_config 'fp8'"),
    ("deepseek_v2", "norm_topk_prob", True, "norm_topk_prob True"),  # transformers ignores it, DeepSeek's code not
    ("deepseek_v2", "rope_interleave", False, "rope_interleave False"),
])
def test_unimplemented_options_are_refused_by_name(tiny_model, arch, key, value, named):
    d = config_dict(tiny_model, arch) | {key: value}
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_dict(d)


def test_left_out_deepseek_keys_take_transformers_defaults(tiny_model):
    """A trimmed V3 config routes as transformers' class would read it (8 groups, 4 chosen, x 2.5),
    not as one group."""
    d = {k: v for k, v in config_dict(tiny_model, "deepseek_v3").items()
         if k not in ("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob")}
    router = ModelConfig.from_dict(d).router
    assert (router.n_group, router.topk_group, router.scaling, router.renormalize) == (8, 4, 2.5, True)


def test_phi3_configs_read_as_transformers_reads_them(tiny_model):
    """Phi-3's early spellings of LongRoPE ("su", "yarn") are LongRoPE; the original length comes
    from the top level; the attention factor follows max / original positions; which set is served
    follows --max-model-len, decided once."""
    d = config_dict(tiny_model, "phi3_longrope")
    rope = d["rope_parameters"] | {"rope_type": "su"}
    d = d | {"rope_parameters": {k: v for k, v in rope.items() if k != "original_max_position_embeddings"}}
    mc = ModelConfig.from_dict(d)
    s = mc.rope_scaling
    assert (s.kind, s.original_max_position_embeddings, mc.rotary_dim, mc.head_dim) == ("longrope", 64, 12, 16)
    assert s.cos_sin_scale == pytest.approx((1 + math.log(512 / 64) / math.log(64)) ** 0.5)
    assert not mc.serving(mc.served_length(64)).rope_scaling.use_long
    assert mc.serving(mc.served_length(65)).rope_scaling.use_long
    assert mc.serving(mc.served_length(None)).rope_scaling.use_long  # 512, the model's own
    bare = {k: v for k, v in d.items() if k != "original_max_position_embeddings"}
    assert ModelConfig.from_dict(bare).rope_scaling.original_max_position_embeddings == 4096  # Phi3Config's default


@pytest.mark.parametrize("cls,arch,first,want", [
    (Qwen3Config, "Qwen3ForCausalLM", 2, "some"),  # layers 2 and 3
    (Qwen3Config, "Qwen3ForCausalLM", 0, "all"),
    (Qwen2Config, "Qwen2ForCausalLM", 4, "none"),  # max_window_layers past the last layer
    (Qwen2MoeConfig, "Qwen2MoeForCausalLM", 0, "none"),  # Qwen2-MoE: even layers below it
    (Qwen2MoeConfig, "Qwen2MoeForCausalLM", 4, "some"),
])
@pytest.mark.parametrize("with_types", [True, False])
def test_which_layers_keep_the_window_as_transformers_says(cls, arch, first, want, with_types):
    """config.json's layer_types, or where a config leaves it out (Qwen's published ones do), what
    its transformers config class would fill in; the others attend fully."""
    cfg = cls(vocab_size=301, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, use_sliding_window=True, sliding_window=16, max_window_layers=first)
    d = cfg.to_dict() | {"architectures": [arch]}
    if not with_types:
        del d["layer_types"]
    sliding = [t == "sliding_attention" for t in cfg.layer_types]
    assert want == ("all" if all(sliding) else "some" if any(sliding) else "none")
    mc = ModelConfig.from_dict(d)
    assert mc.attention_window == (None if want == "none" else 16) and mc.served_length(None) == 512
    assert [mc.windowed(i) for i in range(4)] == (sliding if want != "none" else [False] * 4)


def test_a_window_everywhere_is_refused_where_no_kernel_keeps_it(tmp_path):
    """Context parallelism and Triton's kernels attend to whole contexts: refused naming the flag,
    unless the served context fits one window; `auto` on a GPU takes torch SDPA instead."""
    from shardserve.attention.select import BackendUnavailable, choose_backend

    cfg = MistralConfig(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, sliding_window=32)
    mc = ModelConfig.from_dict(cfg.to_dict() | {"architectures": ["MistralForCausalLM"]})
    assert (mc.attention_window, mc.served_length(None)) == (32, 512)
    with pytest.raises(LayoutError, match=r"--cp-size 2: .* window is 32 tokens\): give --max-model-len 32 or less"):
        check_context(EngineConfig(), mc, cp=2)
    check_context(EngineConfig(max_model_len=32), mc, cp=2)
    with pytest.raises(BackendUnavailable, match="--attention-backend triton has no sliding-window attention"):
        choose_backend("triton", torch.device("cpu"), torch.float32, window=32)
    assert choose_backend("auto", torch.device("cuda"), torch.bfloat16, window=32).name == "torch"


# google/gemma-3-1b-it's config.json as the Hub has it (the keys this engine reads), with the
# 4B-27B's linear scaling of the global layers.
GEMMA3_HUB = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
              "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
              "head_dim": 256, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
              "rope_local_base_freq": 10000, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
              "sliding_window": 512, "sliding_window_pattern": 6, "max_position_embeddings": 32768,
              "vocab_size": 262144, "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": None,
              "final_logit_softcapping": None, "eos_token_id": [1, 106], "bos_token_id": 2}


@pytest.mark.parametrize("spelling", ["hub", "transformers5"])
def test_gemma3_read_as_transformers_reads_it(spelling):
    """Which layers keep the 512-token window (every sixth attends fully), each kind's RoPE base,
    the scaling on the global layers only, the query scale and the activation, from the Hub's
    keys and from transformers 5's rewrite of them (rope_parameters per layer type)."""
    d = GEMMA3_HUB if spelling == "hub" else Gemma3TextConfig.from_dict(GEMMA3_HUB).to_dict()
    if spelling == "transformers5":
        d = d | {"architectures": ["Gemma3ForCausalLM"]}
        assert "rope_local_base_freq" not in d and "sliding_attention" in d["rope_parameters"]
    ref = Gemma3TextConfig.from_dict(GEMMA3_HUB)
    mc = ModelConfig.from_dict(d)
    assert [mc.windowed(i) for i in range(26)] == [t == "sliding_attention" for t in ref.layer_types]
    assert mc.full_layers == (5, 11, 17, 23) and mc.attention_window == 512
    assert (mc.rope_theta, mc.window_rope_theta) == (1e6, 1e4) == (
        ref.rope_parameters["full_attention"]["rope_theta"], ref.rope_parameters["sliding_attention"]["rope_theta"])
    assert (mc.rope_scaling.kind, mc.rope_scaling.factor) == ("linear", 8.0)
    assert (mc.query_pre_attn_scalar, mc.mlp_activation, mc.tie_word_embeddings) == (256, "gelu_pytorch_tanh", True)
    assert mc.eos_token_ids == (1, 106) and mc.served_length(None) == 32768


@pytest.mark.parametrize("change,named", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention True"),
    ({"hidden_activation": "relu"}, "hidden_activation 'relu'"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "yarn", "factor": 2.0}}}, "rope_type 'yarn' on Gemma"),
    ({"sliding_window_pattern": 0}, "sliding_window_pattern 0"),
])
def test_gemma3_options_not_implemented_are_refused(change, named):
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_dict(GEMMA3_HUB | change)


def test_a_gelu_mixture_of_experts_is_refused(tiny_model):
    with pytest.raises(ValueError, match="hidden_act 'gelu_pytorch_tanh' in a mixture of experts"):
        ModelConfig.from_dict(config_dict(tiny_model, "mixtral") | {"hidden_act": "gelu_pytorch_tanh"})


def test_gemma_in_float16_is_refused(tiny_model):
    """Gemma's activations overflow float16 (vLLM refuses it too): --dtype float16 is refused
    before loading; `auto` where a GPU lacks bfloat16 takes float32 instead (resolve_dtype)."""
    from shardserve.loader.model_path import resolve_checkpoint
    from shardserve.loader.weights import resolve_dtype

    for kind in ("gemma2", "gemma3"):
        path, _ = tiny_model(kind)
        with pytest.raises(ValueError, match=r"--dtype float16: Gemma\dForCausalLM's activations overflow float16"):
            resolve_dtype(EngineConfig(model=path, dtype="float16"), resolve_checkpoint(path))
    path, _ = tiny_model("llama")
    assert resolve_dtype(EngineConfig(model=path, dtype="float16"), resolve_checkpoint(path)).dtype == "float16"


def test_softcapped_scores_refused_where_no_kernel_caps_them(tiny_model):
    """Gemma 2's score cap: Triton's kernels and the context-parallel ring have none, refused by
    name; `auto` on a GPU takes the torch backend (whose attention writes the cap out)."""
    from shardserve.attention.select import BackendUnavailable, choose_backend

    mc = ModelConfig.from_dict(config_dict(tiny_model, "gemma2"))
    assert (mc.attn_logit_softcap, mc.final_logit_softcap) == (5.0, 3.0)
    with pytest.raises(BackendUnavailable, match=r"triton has no attention logit softcapping .* caps its scores at 5"):
        choose_backend("triton", torch.device("cpu"), torch.float32, softcap=5.0)
    assert choose_backend("auto", torch.device("cuda"), torch.bfloat16, softcap=5.0).name == "torch"
    with pytest.raises(LayoutError, match=r"--cp-size 2: context parallelism has no attention logit softcapping"):
        check_context(EngineConfig(max_model_len=16), mc, cp=2)
