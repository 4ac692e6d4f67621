"""Writing tiny GGUF files from a transformers config, as llama.cpp's converter lays them out."""

from __future__ import annotations

from gguf import GGUFWriter


def gguf_writer(path: str, arch: str, cfg, kv_heads: int | None = None, theta: float | None = None) -> GGUFWriter:
    """A writer for `arch` with the metadata every architecture here reads, from `cfg` (`kv_heads`:
    the head_count_kv to write where it is not the config's; `theta`: the RoPE base, where the
    config's rope_parameters hold one per layer kind)."""
    w = GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads if kv_heads is None else kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(theta if theta is not None else cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    return w


def finish(w: GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_cpp_permute(weight, n_heads: int):
    """llama.cpp's converter's Q/K row order for llama (LlamaModel.permute, the forward direction)."""
    return (weight.reshape(n_heads, 2, weight.shape[0] // n_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))
