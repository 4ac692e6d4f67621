"""A tiny Gemma 3 vision-language checkpoint (Gemma3ForConditionalGeneration) for the image
tests: random weights, the tiny BPE tokenizer with Gemma's three image tokens, and a chat template
that renders image parts as Gemma's does; plus transformers' greedy reference with images."""

from __future__ import annotations

import copy

import numpy as np
import torch
from PIL import Image
from tiny_models import COMMON, GEMMA3
from tiny_tokenizer import save_tiny_tokenizer
from transformers import (
    AutoTokenizer,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    SiglipVisionConfig,
)

from shardserve.arch_config import VisionConfig
from shardserve.sampling_params import SamplingParams
from shardserve.tokenizer.images import resize_rgb

VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=56,
              patch_size=14)
MARKERS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
# Gemma's layout of a user turn's parts: an image part is the marker, a text part its text.
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<start_of_image>{% else %}"
            "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_vlm(path: str) -> tuple[Gemma3ForConditionalGeneration, VisionConfig]:
    """Saved to `path`: 4 tokens per image, pooled from 4x4 patches of 56x56 pixels; the text
    model windows every other layer at 16 tokens."""
    save_tiny_tokenizer(path, COMMON["vocab_size"], added=MARKERS)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    boi, eoi, image = tok.convert_tokens_to_ids(MARKERS)
    torch.manual_seed(3)
    text = Gemma3TextConfig(**copy.deepcopy(GEMMA3) | COMMON | {"vocab_size": len(tok)})
    cfg = Gemma3Config(text_config=text, vision_config=SiglipVisionConfig(**VISION), mm_tokens_per_image=4,
                       image_token_index=image, boi_token_index=boi, eoi_token_index=eoi)
    model = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if "layer_norm" in name else 0.0))
            elif "multi_modal_projector" in name or "vision" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                p.mul_(4.0)
    model.save_pretrained(path)
    return model, VisionConfig.from_hf(cfg.to_dict())


def pixels(seed: int, size: int = 56) -> np.ndarray:
    """A random image of an odd size, resized to `size` as the engine resizes it."""
    rng = np.random.default_rng(seed)
    return resize_rgb(Image.fromarray(rng.integers(0, 256, (size + seed, size + 7, 3), dtype=np.uint8)), size)


def hf_greedy(model, ids: list[int], images: list[np.ndarray], new: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens, and its logits at every position from the prompt's last. The
    image placeholder is never chosen (transformers takes every one in the input for an image's):
    the engine's side bans it by `no_placeholder`."""
    image_id = model.config.image_token_id
    x = torch.tensor(np.stack(images)).permute(0, 3, 1, 2).double() * (1 / 255)
    pv = (x.float() - 0.5) / 0.5
    seq = list(ids)
    with torch.no_grad():
        for _ in range(new):
            t = torch.tensor([seq])
            logits = model(input_ids=t, pixel_values=pv, token_type_ids=(t == image_id).long()).logits[0, -1]
            seq.append(int(logits.index_fill(0, torch.tensor([image_id]), float("-inf")).argmax()))
        t = torch.tensor([seq[:-1]])
        logits = model(input_ids=t, pixel_values=pv, token_type_ids=(t == image_id).long()).logits[0, len(ids) - 1:]
    return seq[len(ids):], logits


def no_placeholder(vision: VisionConfig, vocab: int, new: int) -> SamplingParams:
    """Greedy for `new` tokens, never the image placeholder (as hf_greedy)."""
    allowed = [t for t in range(vocab) if t != vision.image_token_id]
    return SamplingParams(max_tokens=new, temperature=0, allowed_token_ids=allowed)
