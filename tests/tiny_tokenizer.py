"""A real byte-level BPE tokenizer with a 301-token vocabulary, trained in milliseconds, so the
tiny test models can take text prompts and chat messages like a real checkpoint."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello, how are you today? I am fine, thank you.",
    "What is the weather like? It is sunny and warm.",
] * 20
SPECIALS = ["<|im_start|>", "<|im_end|>"]
# Tool definitions (the request's `tools`) as Qwen2.5's template renders them: a system turn listing
# each tool's JSON inside <tools></tools> and the Hermes <tool_call> format to answer in.
TOOLS_TEMPLATE = (  # newlines in expressions: Hugging Face trims the one after a block tag
    "{% if tools %}<|im_start|>system\n# Tools\n\nYou may call one or more functions. Their signatures:\n<tools>"
    "{% for t in tools %}{{ '\\n' + t | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\nCall a function by answering\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% endif %}"
)
# Tool-use conversations as Hugging Face templates read them: an assistant's tool_calls (their
# arguments an object, hence tojson) and a tool message's tool_call_id.
CHAT_TEMPLATE = TOOLS_TEMPLATE + (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['tool_call_id'] %}[{{ m['tool_call_id'] }}] {% endif %}{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tiny_tokenizer(path: str, vocab_size: int, added: list[str] | None = None) -> None:
    """`added`: more tokens, each one token of its own text (not special: decoding keeps them), as
    Qwen3's `<think>` is."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() <= vocab_size
    tok.add_tokens(added or [])
    # No eos token: random tiny models would stop at random places; tests set stops explicitly.
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(path)
