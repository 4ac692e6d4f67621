"""A chat prompt with images, laid out as Gemma 3's processor lays it out: each image marker the
chat template rendered (`<start_of_image>`) becomes a blank line, the marker, the image's
placeholder tokens and `<end_of_image>`, then a blank line; the images themselves are decoded and
resized here, so the engine receives pixels ready for its encoder (multimodal.ImageInput)."""

from __future__ import annotations

from PIL import Image

from shardserve.arch_config import VisionConfig
from shardserve.loader.model_path import Checkpoint
from shardserve.model_config import ModelConfig
from shardserve.multimodal import ImageInput
from shardserve.tokenizer.images import ImageError, decode_image_url, image_digest, resize_rgb


def image_prompt(tok, ckpt: Checkpoint) -> ImagePrompt | None:
    """How a vision-language model's prompts hold images (None: the model reads text only). Read
    from config.json alone: the tokenizer processes never import torch."""
    vision = ModelConfig.from_dir(ckpt.path).vision if tok is not None and not ckpt.is_gguf else None
    return ImagePrompt(tok, vision) if vision is not None else None


class ImagePrompt:
    """Gemma 3's image layout for tokenizer `tok` (whose vocabulary holds the marker tokens)."""

    def __init__(self, tok, vision: VisionConfig):
        self.tok, self.vision = tok, vision
        boi, eoi, image = tok.convert_ids_to_tokens([vision.boi_token_id, vision.eoi_token_id, vision.image_token_id])
        self.marker = boi
        self.sequence = f"\n\n{boi}{image * vision.mm_tokens_per_image}{eoi}\n\n"

    def encode(self, text: str, images: list, add_special: bool = False) -> tuple[list[int], list[ImageInput]]:
        """The token ids of prompt `text` holding one marker per image (PIL images, or data: URLs),
        in order, and the images placed on their placeholders."""
        found = text.count(self.marker)
        if found != len(images):
            raise ImageError(f"the prompt holds {found} image marker(s) ({self.marker}) for {len(images)} image(s)"
                             + (": images belong in user messages' content" if found < len(images) else ""))
        pixels = self._pixels(images)
        ids = self.tok.encode(text.replace(self.marker, self.sequence), add_special_tokens=add_special)
        return ids, place_images(ids, pixels, self.vision)

    def encode_prompt(self, text: str | None, ids: list[int] | None, images: list
                      ) -> tuple[list[int], list[ImageInput]]:
        """vLLM's prompt dict with images: its text (markers expanded; special tokens added, as the
        processor adds them) or its token ids (each image's placeholder run in place already)."""
        if text is not None:
            return self.encode(text, images, add_special=True)
        return list(ids), place_images(list(ids), self._pixels(images), self.vision)

    def _pixels(self, images: list) -> list:
        """Each image (a PIL image, or a data: URL) decoded and resized for the encoder."""
        out = []
        for im in images:
            if isinstance(im, str):
                im = decode_image_url(im)
            elif not isinstance(im, Image.Image):
                raise ImageError(f"an image is a PIL image or a data: URL, got {type(im).__name__}")
            out.append(resize_rgb(im, self.vision.image_size))
        return out


def chat_ids(tok, images: ImagePrompt | None, text: str, urls: list[str]) -> tuple[list[int], list[ImageInput]]:
    """A rendered chat's token ids (its template carries any BOS) and, where it has image parts
    (normalize_messages keeps them only for a model that reads them), its images placed on them."""
    if urls:
        return images.encode(text, urls)
    return tok.encode(text, add_special_tokens=False), []


def place_images(ids: list[int], pixels: list, vision: VisionConfig) -> list[ImageInput]:
    """Each image (uint8 [size, size, 3] arrays, in order) on its run of placeholder tokens."""
    token, length = vision.image_token_id, vision.mm_tokens_per_image
    starts = [i for i, t in enumerate(ids) if t == token and (i == 0 or ids[i - 1] != token)]
    runs = [(s, next((j for j in range(s, len(ids)) if ids[j] != token), len(ids)) - s) for s in starts]
    if len(runs) != len(pixels) or any(n != length for _, n in runs):
        raise ValueError(f"the prompt holds image placeholder runs of {[n for _, n in runs]} tokens for "
                         f"{len(pixels)} image(s) of {length} tokens each")
    return [ImageInput(s, length, vision.image_size, p.tobytes(), image_digest(p)) for (s, _), p in zip(runs, pixels)]
