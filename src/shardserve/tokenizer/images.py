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
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

MAX_PIXELS = 64 * 1024 * 1024  # width * height of an image we decode (a small PNG can claim gigapixels)
MAX_FETCH_BYTES = 32 * 1024 * 1024  # an image fetched by URL
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
        raise ImageError(f"an image URL is data:image/<type>;base64,<data> or http(s), got {_shown(url)}")
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


@dataclass(frozen=True)
class MediaFetch:
    """How images given by http(s) URL are fetched (vLLM's rules): within `timeout` seconds each,
    from the hosts `domains` names (None: any host), at most MAX_FETCH_BYTES."""

    timeout: float = 5.0
    domains: frozenset[str] | None = None

    def as_data_url(self, url: str) -> str:
        """The image at `url` as a data: URL (a data: URL as it is); ImageError, one line, if not."""
        if url.startswith("data:"):
            return url
        self._check_host(url)
        try:
            with httpx.stream("GET", url, timeout=self.timeout, follow_redirects=True) as r:
                self._check_host(str(r.url))  # where a redirect led
                if r.status_code != 200:
                    raise ImageError(f"fetching the image at {_shown(url)} gave HTTP {r.status_code}")
                data = bytearray()
                for chunk in r.iter_bytes():
                    data += chunk
                    if len(data) > MAX_FETCH_BYTES:
                        raise ImageError(f"the image at {_shown(url)} is over {MAX_FETCH_BYTES} bytes")
                kind = r.headers.get("content-type", "").split(";")[0].strip()
        except httpx.TimeoutException:
            raise ImageError(f"the image at {_shown(url)} did not arrive within {self.timeout:g} s") from None
        except httpx.HTTPError as e:
            raise ImageError(f"the image at {_shown(url)} could not be fetched: {type(e).__name__}") from None
        kind = kind if kind.startswith("image/") else "image/unknown"  # PIL reads the bytes' own format
        return f"data:{kind};base64,{base64.b64encode(bytes(data)).decode()}"

    def _check_host(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ImageError(f"an image URL is a data: URL or an http(s) one, got {_shown(url)}")
        if self.domains is not None and parts.hostname not in self.domains:
            raise ImageError(f"images are fetched from the hosts --allowed-media-domains names only, not "
                             f"{parts.hostname!r}")
