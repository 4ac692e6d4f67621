"""A tiny Llama that always answers one script, whatever the prompt: a real checkpoint whose greedy
output the tests know in advance (reasoning splits, stop sequences, whole conversations through
the agent APIs), where a random model's text would be noise.

How: every attention and MLP output projection is zero, so the hidden state after the last layer
is the last token's embedding; the LM head's row for each token of the script is the embedding
of the token before it. So each token predicts its successor in the script (its own embedding
matches itself best), starting from the chat template's last prompt token (the newline after
`<|im_start|>assistant`), ending with `<|im_end|>`, the model's EOS.
"""

from __future__ import annotations

import torch
from tiny_tokenizer import save_tiny_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

THINK_TAGS = ["<think>", "</think>"]  # single tokens, as in Qwen3 and DeepSeek-R1
SCRIPT = "<think>Rome?</think>Paris."


def save_scripted_model(path: str, script: str = SCRIPT, vocab: int = 301, scale: float = 30.0,
                        chat_template: str | None = None) -> list[int]:
    """Writes the model and tokenizer to `path`; returns the script's token ids (EOS included).
    `chat_template` replaces the tiny one (its generation prompt must still end in a newline)."""
    save_tiny_tokenizer(path, vocab, added=THINK_TAGS)
    tok = AutoTokenizer.from_pretrained(path)
    if chat_template is not None:
        tok.chat_template = chat_template
        tok.save_pretrained(path)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    start = tok.encode("\n", add_special_tokens=False)
    ids = tok.encode(script, add_special_tokens=False) + [eos]
    chain = start + ids
    if len(set(chain[:-1])) < len(chain) - 1:
        raise ValueError(f"the script's tokens must be distinct to be a chain: {tok.convert_ids_to_tokens(chain)}")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      eos_token_id=eos, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = torch.nn.functional.normalize(torch.randn(len(tok), 64), dim=1) * 8
        model.model.embed_tokens.weight.copy_(emb)
        head = torch.zeros(len(tok), 64)
        for before, after in zip(chain, chain[1:]):
            head[after] = emb[before] / emb[before].norm() * scale
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path)
    return ids
