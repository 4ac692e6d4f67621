"""Gemma 3's image encoder (models/vision.py) and image preprocessing (tokenizer/images.py) against
transformers on a tiny random Gemma3ForConditionalGeneration: the processor's pixel values and
get_image_features' projected rows; data: URLs decoded, bad ones refused in one line."""

from __future__ import annotations

import base64
import copy
import io

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_models import COMMON
from transformers import Gemma3Config, SiglipVisionConfig
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from vlm_util import VISION, make_vlm

from shardserve.arch_config import SIGLIP_DEFAULTS, VisionConfig
from shardserve.loader.safetensors_loader import iter_safetensors
from shardserve.models.vision import Gemma3VisionEncoder, vision_weight_name
from shardserve.tokenizer import images
from shardserve.tokenizer.images import ImageError, decode_image_url, image_digest, resize_rgb

SIZE = VISION["image_size"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers' model, our encoder loaded from its saved checkpoint)."""
    path = str(tmp_path_factory.mktemp("gemma3_vision"))
    model, vision = make_vlm(path)
    ours = Gemma3VisionEncoder(vision, torch.float32, torch.device("cpu"))
    params, loaded = dict(ours.named_parameters()), set()
    for src in iter_safetensors(path):
        if (name := vision_weight_name(src.name)) is not None:
            p = params[name]
            p.weight_loader(p, src, None)
            loaded.add(name)
    assert loaded == set(params)
    return model, ours


def _image(w: int, h: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, len(mode)), dtype=np.uint8), mode)


@pytest.mark.parametrize("image", [_image(37, 53), _image(100, 20, seed=1), _image(9, 9, "RGBA", seed=2),
                                   _image(64, 40, seed=3).convert("L")], ids=["37x53", "100x20", "rgba", "gray"])
def test_pixels_and_features_match_transformers(tiny, image):
    model, ours = tiny
    theirs = Gemma3ImageProcessorPil(size={"height": SIZE, "width": SIZE})(images=[image], return_tensors="pt")
    pixels = torch.from_numpy(resize_rgb(image, SIZE)).unsqueeze(0)
    assert pixels.dtype == torch.uint8 and pixels.shape == (1, SIZE, SIZE, 3)
    torch.testing.assert_close(ours.normalize(pixels), theirs["pixel_values"], atol=1e-6, rtol=0)
    with torch.no_grad():
        want = model.model.get_image_features(theirs["pixel_values"]).pooler_output
    got = ours(pixels)
    assert got.shape == want.shape == (1, 4, COMMON["hidden_size"])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_batch_rows_equal_each_image_alone(tiny):
    _, ours = tiny
    a, b = (torch.from_numpy(resize_rgb(_image(w, h, seed=w), SIZE)) for w, h in ((37, 53), (100, 20)))
    both = ours(torch.stack([a, b]))
    assert torch.equal(both[0], ours(a[None])[0]) and torch.equal(both[1], ours(b[None])[0])
    assert ours(torch.stack([a, b])[:0]).shape == (0, 4, COMMON["hidden_size"])


def test_bfloat16_matches_transformers(tiny):
    model, ours = tiny
    image = _image(50, 31, seed=4)
    theirs = Gemma3ImageProcessorPil(size={"height": SIZE, "width": SIZE})(images=[image], return_tensors="pt")
    half = Gemma3VisionEncoder(ours.cfg, torch.bfloat16, torch.device("cpu"))
    half.load_state_dict(ours.state_dict())
    hf = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad():
        want = hf.model.get_image_features(theirs["pixel_values"]).pooler_output
    got = half(torch.from_numpy(resize_rgb(image, SIZE))[None])
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)  # bfloat16's tolerance (bit-equal on the CPU)


def test_weight_names():
    assert vision_weight_name("model.vision_tower.encoder.layers.0.mlp.fc1.weight") == \
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight"
    assert vision_weight_name("vision_tower.vision_model.post_layernorm.bias") == \
        "vision_tower.vision_model.post_layernorm.bias"
    assert vision_weight_name("model.multi_modal_projector.mm_soft_emb_norm.weight") == \
        "multi_modal_projector.mm_soft_emb_norm.weight"
    assert vision_weight_name("vision_tower.head.probe") is None
    assert vision_weight_name("language_model.model.embed_tokens.weight") is None


def test_sparse_config_takes_transformers_defaults():
    cfg = VisionConfig.from_hf({"vision_config": {"model_type": "siglip_vision_model", "patch_size": 14},
                                "text_config": {}})
    d = SiglipVisionConfig()
    assert {k: getattr(d, k) for k in SIGLIP_DEFAULTS} == SIGLIP_DEFAULTS
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.image_size,
            cfg.layer_norm_eps, cfg.num_channels) == (d.hidden_size, d.intermediate_size, d.num_hidden_layers,
                                                      d.num_attention_heads, d.image_size, d.layer_norm_eps,
                                                      d.num_channels)
    g = Gemma3Config()
    assert cfg.mm_tokens_per_image == g.mm_tokens_per_image == cfg.tokens_per_image == 256
    assert cfg.text_hidden_size == g.text_config.hidden_size
    p = Gemma3ImageProcessorPil()
    assert cfg.image_mean == tuple(p.image_mean) and cfg.image_std == tuple(p.image_std)
    with pytest.raises(ValueError, match="does not pool"):
        VisionConfig.from_hf({"vision_config": {"patch_size": 14}, "mm_tokens_per_image": 8})


def _data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def test_data_urls(monkeypatch):
    image = _image(30, 17, seed=5)
    back = decode_image_url(_data_url(image))
    assert back.size == (30, 17) and np.array_equal(np.asarray(back), np.asarray(image))
    assert image_digest(resize_rgb(back, 28)) == image_digest(resize_rgb(image, 28)) < 2**63
    assert image_digest(resize_rgb(back, 28)) != image_digest(resize_rgb(_image(30, 17, seed=6), 28))
    bad = ["data:image/png;base64,@@not base64@@", "http://example.com/cat.png", "data:text/plain;base64,aGk=",
           "data:image/png;base64," + base64.b64encode(b"not an image at all").decode(),
           "data:image/png;base64," + base64.b64encode(base64.b64decode(_data_url(image)[22:])[:60]).decode()]
    for url in bad:
        with pytest.raises(ImageError) as e:
            decode_image_url(url)
        assert "\n" not in str(e.value) and str(e.value)
    monkeypatch.setattr(images, "MAX_PIXELS", 30 * 16)
    with pytest.raises(ImageError, match="over the limit"):
        decode_image_url(_data_url(image))
