"""Gemma 3's images split over ranks: the vision encoder replicated on every tensor rank of the first
pipeline stage, the image tokens' two-way attention on every stage; transformers' greedy tokens at
TP 2, PP 2 and DP 2 (the router carries the images to a replica). Context parallelism refuses
images in one line, before anything runs."""

from __future__ import annotations

import pytest
from PIL import Image
from vlm_util import hf_greedy, make_vlm, no_placeholder, pixels

from shardserve import LLM
from shardserve.tokenizer.images import resize_rgb

NEW = 6


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("vlm"))
    model, vision = make_vlm(path)
    image = [vision.boi_token_id] + [vision.image_token_id] * vision.mm_tokens_per_image + [vision.eoi_token_id]
    ids = [[5, 9, 14, 3, 77, 21, 8, 40, 2, 11] + image + [6, 7, 8, 9, 10] + image + list(range(20, 34)),
           [1, 2, 3] + image + list(range(40, 62))]
    images = [[pixels(21, 60), pixels(22, 48)], [pixels(23, 52)]]
    ref = [hf_greedy(model, p, [resize_rgb(Image.fromarray(x), vision.image_size) for x in ims], NEW)[0]
           for p, ims in zip(ids, images)]
    prompts = [{"prompt_token_ids": p, "multi_modal_data": {"image": [Image.fromarray(x) for x in ims]}}
               for p, ims in zip(ids, images)]
    return path, prompts, ref, no_placeholder(vision, model.config.text_config.vocab_size, NEW)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tp_size": 2}, {"pp_size": 2}, {"dp_size": 2}], ids=["tp2", "pp2", "dp2"])
def test_images_on_a_layout_match_transformers(vlm, layout):
    path, prompts, ref, greedy = vlm
    with LLM(path, num_pages=64, page_size=4, show_progress=False, **layout) as llm:
        assert [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == ref


@pytest.mark.slow
def test_context_parallelism_refuses_images(vlm):
    path, prompts, _, greedy = vlm
    # (the model's window is 16 tokens, which context parallelism serves only within)
    with LLM(path, cp_size=2, num_pages=64, page_size=4, max_model_len=16, show_progress=False) as llm:
        why = r"^images: context parallelism \(--cp-size\) does not attend over images$"
        with pytest.raises(ValueError, match=why):
            llm.generate(prompts, greedy, use_tqdm=False)
        text = {"prompt_token_ids": list(range(20, 28))}  # and serves text on
        assert len(llm.generate([text], greedy, use_tqdm=False)[0].token_ids) == NEW
