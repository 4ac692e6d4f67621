"""Images in chat requests: decoded from `data:` URLs (as the OpenAI API sends them) and resized to the
vision encoder's square input exactly as transformers' Gemma3ImageProcessor (the PIL one) does it.

Every refusal is an `ImageError` (a ValueError) with a one-line message fit for the client.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

MAX_PIXELS = 64 * 1024 * 1024  # width * height of an image we decode (a small PNG can claim gigapixels)
_DATA_URL = re.compile(r"data:(image/[\w.+-]+)((?:;[^;,]*)*?);base64,", re.IGNORECASE)
_WHITESPACE = re.compile(rb"\s+")


class ImageError(ValueError):
    """An image in a request that cannot be used; the message is one line."""


def _shown(text: str, limit: int = 48) -> str:
    """A short one-line rendering of what the client sent."""
    return repr(text[:limit] + "..." if len(text) > limit else text)


def decode_image_bytes(data: bytes) -> Image.Image:
    """An encoded image file (PNG, JPEG, WebP, GIF: its first frame, ...) -> a loaded PIL image,
    turned upright by its EXIF orientation as transformers' load_image does."""
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > MAX_PIXELS:
            raise ImageError(f"image of {image.width}x{image.height} pixels is over the limit of {MAX_PIXELS} pixels")
        image.load()
        return ImageOps.exif_transpose(image)
    except ImageError:
        raise
    except Image.DecompressionBombError as e:
        raise ImageError(f"image is over the pixel limit: {e}") from None
    except UnidentifiedImageError:
        raise ImageError(f"the {len(data)} bytes given are not an image in a format that can be read") from None
    except Exception as e:  # the decoders raise many types (OSError, SyntaxError, struct.error, ...)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ImageError(f"not a readable image ({len(data)} bytes): {first}") from None


def decode_image_url(url: str) -> Image.Image:
    """A `data:image/<format>;base64,<data>` URL -> a loaded PIL image."""
    m = _DATA_URL.match(url)
    if m is None:
        raise ImageError(f"only data:image/...;base64 URLs are accepted for images, got {_shown(url)}")
    payload = _WHITESPACE.sub(b"", url[m.end() :].encode("ascii", "replace"))
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"the data URL's base64 payload is invalid: {e}") from None
    return decode_image_bytes(data)


def resize_rgb(image: Image.Image, size: int) -> np.ndarray:
    """uint8 [size, size, 3]: transparency composited onto white (transformers' convert_to_rgb), then
    PIL's bilinear resize to size x size (Gemma3ImageProcessor's resample, no pan and scan)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    else:
        image = image.convert("RGB")
    return np.array(image.resize((size, size), resample=Image.Resampling.BILINEAR), dtype=np.uint8)


def image_digest(pixels: np.ndarray) -> int:
    """A stable 63-bit hash of resized pixels (fits an int64): equal images share encoder results."""
    h = hashlib.blake2b(np.ascontiguousarray(pixels).tobytes(), digest_size=8)
    h.update(repr((pixels.shape, pixels.dtype.str)).encode())
    return int.from_bytes(h.digest(), "little") & (2**63 - 1)
