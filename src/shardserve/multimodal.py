"""Images in a prompt (Gemma 3's), as the engine carries them: each one a run of placeholder tokens
in the prompt, whose embeddings the vision encoder's output replaces on the first pipeline stage.

Three rules follow from what the model computes (transformers' Gemma 3: the tokens of one image
attend to each other both ways, and to text before them causally):
- a prefill chunk never ends inside an image (`chunk_end`): its last tokens must see its first;
- each image token attends to its context through the image's end (`horizons`), not through itself;
- the prefix cache keys an image's pages by its pixels (`cache_tokens`): every image's placeholder
  tokens are the same ids, and two images must not share KV pages.
"""

from __future__ import annotations

import msgspec


class ImageInput(msgspec.Struct, array_like=True, frozen=True):
    """One image of a request: prompt positions [offset, offset + length) are its placeholders."""

    offset: int
    length: int
    size: int  # pixels: size x size RGB, uint8, row-major (the encoder's input, already resized)
    pixels: bytes
    digest: int  # of the pixels, in [0, 2**63): keys the prefix cache

    @property
    def end(self) -> int:
        return self.offset + self.length


def cache_tokens(tokens: list[int], images: tuple[ImageInput, ...] | list[ImageInput]) -> list[int]:
    """What the prefix cache keys a sequence by: its tokens, each image's placeholders replaced by a
    negative value (never a token id) drawn from the image's digest."""
    if not images:
        return tokens
    out = list(tokens)
    for im in images:
        out[im.offset : im.end] = [-1 - im.digest] * im.length
    return out


def chunk_end(images: tuple[ImageInput, ...] | list[ImageInput], start: int, end: int) -> int:
    """Where a chunk of positions [start, end) may end: before an image it would cut (or, where the
    chunk starts inside that image, after it: the caller checks that the budget allows it)."""
    for im in images:
        if im.offset < end < im.end:
            return im.offset if im.offset > start else im.end
    return end


def horizons(images: tuple[ImageInput, ...] | list[ImageInput], start: int, n: int) -> list[int] | None:
    """Each of positions [start, start + n)'s context length as it attends: p + 1, but an image
    token's runs to its image's end. None where no image meets the positions."""
    met = image_rows(images, start, n)
    if not met:
        return None
    out = list(range(start + 1, start + n + 1))
    for im, row, _, count in met:
        out[row : row + count] = [im.end] * count
    return out


def image_rows(images: tuple[ImageInput, ...] | list[ImageInput], start: int, n: int
               ) -> list[tuple[ImageInput, int, int, int]]:
    """The images positions [start, start + n) meet, as (image, first row of the chunk, first of
    the image's tokens, count)."""
    out = []
    for im in images:
        lo, hi = max(im.offset, start), min(im.end, start + n)
        if lo < hi:
            out.append((im, lo - start, lo - im.offset, hi - lo))
    return out


def check_images(images: tuple[ImageInput, ...] | list[ImageInput], prompt: list[int], placeholder: int,
                 length: int, size: int) -> None:
    """Raise ValueError unless each image covers `length` placeholder tokens of the prompt, in order
    and apart, with `size` x `size` pixels; and every placeholder in the prompt is some image's."""
    covered = 0
    prev = 0
    for i, im in enumerate(images):
        if im.length != length or im.size != size or len(im.pixels) != size * size * 3:
            raise ValueError(f"image {i}: expected {length} tokens and {size}x{size} RGB pixels")
        if im.offset < prev or im.end > len(prompt) or any(t != placeholder for t in prompt[im.offset : im.end]):
            raise ValueError(f"image {i} does not lie on {length} image placeholder tokens of the prompt")
        prev, covered = im.end, covered + im.length
    if prompt.count(placeholder) != covered:
        raise ValueError(f"the prompt holds {prompt.count(placeholder)} image placeholder tokens (id {placeholder}) "
                         f"where its {len(images)} image(s) take {covered}")
