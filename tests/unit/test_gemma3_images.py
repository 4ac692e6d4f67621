"""Gemma 3's images (Gemma3ForConditionalGeneration) against transformers: greedy tokens and
logits of prompts holding images, whose tokens attend to each other both ways, on every prefill
path (batch-invariant paged rows, SDPA chunks with a mask, the torch backend), chunked so an
image would be cut, from the prefix cache, and through LLM.chat's image_url parts."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_models import COMMON
from vlm_util import TEMPLATE, make_vlm, no_placeholder, pixels
from vlm_util import hf_greedy as hf

from shardserve.arch_config import VisionConfig
from shardserve.config import EngineConfig
from shardserve.sampling_params import SamplingParams
from shardserve.scheduler.engine_core import EngineCore
from shardserve.tokenizer.image_prompt import place_images
from shardserve.tokenizer.images import resize_rgb

NEW = 6


def hf_greedy(model, ids, images):
    return hf(model, ids, images, NEW)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(path, transformers' model, its VisionConfig)."""
    path = str(tmp_path_factory.mktemp("gemma3_images"))
    return path, *make_vlm(path)


def prompt(v: VisionConfig, before: int, between: int, after: int, seed: int = 0) -> list[int]:
    """Text tokens, an image (boi, placeholders, eoi), text, a second image, text: 16-token
    windows reach across both."""
    g = torch.Generator().manual_seed(seed)

    def text(n):
        return torch.randint(0, COMMON["vocab_size"] - 3, (n,), generator=g).tolist()

    image = [v.boi_token_id] + [v.image_token_id] * v.mm_tokens_per_image + [v.eoi_token_id]
    return text(before) + image + text(between) + image + text(after)


def run(path: str, batch: list[tuple[list[int], list[np.ndarray]]], v: VisionConfig, **cfg):
    from engine_util import record_logits

    core = EngineCore(EngineConfig(model=path, show_progress=False, **cfg))
    seen = record_logits(core)
    greedy = no_placeholder(v, core.model_cfg.vocab_size, NEW)
    reqs = [core.add_request(str(i), ids, greedy, images=tuple(place_images(ids, ims, v)))
            for i, (ids, ims) in enumerate(batch)]
    while core.has_unfinished():
        core.step()
    return [r.output_token_ids for r in reqs], [torch.stack(seen[r.request_id]) for r in reqs], core, reqs


def check(vlm, batch, **cfg):
    path, model, v = vlm
    tokens, logits, core, reqs = run(path, batch, v, **cfg)
    for (ids, ims), toks, lg in zip(batch, tokens, logits):
        ref_tokens, ref_logits = hf_greedy(model, ids, ims)
        assert toks == ref_tokens
        if not core.spec:  # (a verification step samples several tokens from one row set)
            torch.testing.assert_close(lg, ref_logits, atol=1e-4, rtol=1e-4)
    return core, reqs


CASES = {
    "cpu": {},  # every prefill token a paged row, its context through its image's end
    "sdpa": {"batch_invariant": False},  # one SDPA call per chunk, with the image blocks in its mask
    "torch": {"attention_backend": "torch"},
    # 7-token budget, 4-token pages: chunks stop before each image and take it whole
    "chunked": {"max_num_batched_tokens": 7, "page_size": 4, "num_pages": 64},
    "async": {"async_scheduling": True},  # the next step planned while this one samples
    # n-gram proposals (which may copy placeholders out of the prompt: plain tokens to the target)
    "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "ngram_min": 1,
                                     "disable_by_batch_size": None}},
}


@pytest.mark.parametrize("case", CASES)
def test_images_match_transformers(vlm, case):
    v = vlm[2]
    batch = [(prompt(v, 9, 5, 14, seed=1), [pixels(1), pixels(2)]), (prompt(v, 3, 20, 2, seed=2), [pixels(3)] * 2)]
    core, _ = check(vlm, batch, **CASES[case])
    assert core.runner.window == 16 and core.runner.split_window
    if core.spec is not None:
        assert core.spec.counts.proposed > 0  # it did verify proposals


def test_prefix_cache_keys_images_by_their_pixels(vlm):
    """The same text with another image takes none of the first's image pages; with the same
    image it takes them (and gives transformers' tokens either way)."""
    v = vlm[2]
    ids = prompt(v, 8, 6, 9, seed=4)
    first, other = [pixels(5), pixels(6)], [pixels(5), pixels(7)]
    path, model, _ = vlm
    core = EngineCore(EngineConfig(model=path, show_progress=False, page_size=4, num_pages=64))
    greedy = no_placeholder(v, core.model_cfg.vocab_size, NEW)
    out = {}
    for name, ims in (("first", first), ("other", other), ("again", first)):
        req = core.add_request(name, ids, greedy, images=tuple(place_images(ids, ims, v)))
        while core.has_unfinished():
            core.step()
        assert req.output_token_ids == hf_greedy(model, ids, ims)[0]
        out[name] = req.num_cached_tokens
    second_image = ids.index(v.image_token_id, 8 + 6) - 1  # its boi
    assert out["other"] == (second_image // 4) * 4  # up to the page where the two prompts part
    assert out["again"] == (len(ids) - 1) // 4 * 4


def test_chat_with_image_url_parts(vlm):
    """LLM.chat: image_url parts (data: URLs) expanded as Gemma 3's processor does, equal to
    transformers on the same tokens; a model without images, or a bad URL, refused in one line."""
    from shardserve import LLM

    path, model, v = vlm
    png = io.BytesIO()
    Image.fromarray(pixels(8, 40)).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    conv = [{"role": "user", "content": [{"type": "text", "text": "What is this? "},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": " The capital"}]}]
    with LLM(path, num_pages=64, show_progress=False) as llm:
        greedy = no_placeholder(v, model.config.text_config.vocab_size, NEW)
        out = llm.chat(conv, greedy, use_tqdm=False, chat_template=TEMPLATE)
        ids = out.prompt_token_ids
        run_of = [i for i, t in enumerate(ids) if t == v.image_token_id]
        assert len(run_of) == 4 and ids[run_of[0] - 1] == v.boi_token_id and ids[run_of[-1] + 1] == v.eoi_token_id
        assert out.outputs[0].token_ids == hf_greedy(model, ids, [resize_rgb(Image.open(png), v.image_size)])[0]
        bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
        with pytest.raises(ValueError, match="image") as e:
            llm.chat(bad, chat_template=TEMPLATE)
        assert "\n" not in str(e.value)
        with pytest.raises(ValueError, match="2 image placeholder tokens|image placeholder"):
            llm.generate([[v.image_token_id] * 2], SamplingParams(max_tokens=1), use_tqdm=False)


@pytest.mark.parametrize("cfg, why", [
    ({"attention_backend": "triton", "max_model_len": 16},  # (Triton serves the window model within it)
     "the triton attention backend does not attend over images (--attention-backend cpu or torch does)"),
    ({"max_num_batched_tokens": 3}, "--max-num-batched-tokens 3 cannot hold an image's 4 tokens in one step"),
])
def test_engines_that_cannot_take_images_refuse_them_in_one_line(vlm, cfg, why):
    path, model, v = vlm
    core = EngineCore(EngineConfig(model=path, show_progress=False, num_pages=16, **cfg))
    ids = [3, v.boi_token_id] + [v.image_token_id] * 4 + [v.eoi_token_id, 5]
    with pytest.raises(ValueError) as e:
        core.add_request("0", ids, SamplingParams(max_tokens=2), images=tuple(place_images(ids, [pixels(1)], v)))
    assert str(e.value) == f"images: {why}"
    assert core.add_request("1", [3, 4, 5], SamplingParams(max_tokens=2)).request_id == "1"  # text goes on


def test_a_text_model_refuses_images(tiny_model):
    from shardserve import LLM

    path, _ = tiny_model("llama")
    with LLM(path, num_pages=16, show_progress=False) as llm:
        with pytest.raises(ValueError, match="^multi_modal_data: this model reads text only$"):
            llm.generate({"prompt": "Hi", "multi_modal_data": {"image": Image.fromarray(pixels(1))}})
        with pytest.raises(ValueError, match="part 1 is 'image_url': this model does not support images"):
            llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                   {"type": "image_url", "image_url": {"url": "data:,"}}]}])
