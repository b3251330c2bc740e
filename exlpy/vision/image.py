"""Images from what users hand over (PIL images, file paths, bytes, data: URLs), decoded and checked once.

Anything that is not a usable image becomes an ImageError naming the input: a file that does not decode, a
zero-size image, one past the limits (MAX_SIDE per side as exllamav2, MAX_PIXELS in all: a decompression bomb
is refused from its header, before its pixels are decoded).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from exlpy.errors import ImageError

MAX_SIDE = 16384  # exllamav2's vision_max_size
MAX_PIXELS = 100_000_000  # 100 megapixels


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - pillow is a dependency of the vision extra
        raise ImageError("images need Pillow: pip install 'exlpy[vision]' (or pip install pillow)") from None
    return Image


def _check_size(width: int, height: int, what: str) -> None:
    if width <= 0 or height <= 0:
        raise ImageError(f"{what} has no pixels ({width}x{height})")
    if width > MAX_SIDE or height > MAX_SIDE:
        raise ImageError(f"{what} is {width}x{height}: a side exceeds the maximum of {MAX_SIDE} pixels")
    if width * height > MAX_PIXELS:
        raise ImageError(f"{what} is {width}x{height} = {width * height / 1e6:.1f} megapixels, more than the limit "
                         f"of {MAX_PIXELS // 1_000_000} megapixels")


def decode_data_url(url: str) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL (ImageError for any other URL or bad base64)."""
    if not url.startswith("data:"):
        raise ImageError(f"not a data: URL: {url[:40]!r}")
    head, sep, payload = url.partition(",")
    if not sep or ";base64" not in head:
        raise ImageError(f"image data URL must be base64-encoded (data:image/png;base64,...), got {head[:40]!r}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"image data URL holds invalid base64: {e}") from None


def load_image(image: Any, what: str = "image") -> Any:
    """An RGB PIL image from a PIL image, a path (str / os.PathLike), raw bytes, or a data: URL string."""
    Image = _pil()
    if isinstance(image, Image.Image):
        _check_size(image.width, image.height, what)
        img = image
    else:
        if isinstance(image, str) and image.startswith("data:"):
            image = decode_data_url(image)
        if isinstance(image, (bytes, bytearray, memoryview)):
            src: Any = io.BytesIO(bytes(image))
            name = f"{what} ({len(image)} bytes)"
        elif isinstance(image, (str, os.PathLike)):
            src = os.fspath(image)
            name = f"{what} file {src}"
            if not os.path.isfile(src):
                raise ImageError(f"{name} does not exist or is not a regular file")
        else:
            raise ImageError(f"{what} must be a PIL image, a file path, bytes or a data: URL, got "
                             f"{type(image).__name__}")
        try:
            with warnings.catch_warnings():  # PIL's own bomb warning: the limits below decide, with a typed error
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                img = Image.open(src)
                _check_size(img.width, img.height, name)  # from the header, before decoding the pixels
                img.load()
        except ImageError:
            raise
        except Image.DecompressionBombError as e:
            raise ImageError(f"{name} is too large to decode: {e}") from None
        except (OSError, SyntaxError, ValueError) as e:  # PIL's UnidentifiedImageError is an OSError
            raise ImageError(f"{name} does not decode as an image: {e}") from None
        what = name
    return to_rgb(img)


def to_rgb(img: Any) -> Any:
    """RGB as transformers' convert_to_rgb makes it: transparency composited onto white (as exllamav2 does)."""
    Image = _pil()
    if img.mode == "RGB":
        return img
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return img.convert("RGB")


def image_array(img: Any) -> Any:
    """The pixels of a PIL image as a uint8 NumPy array [H, W, C] (PIL copies them out: ~1 ms for 1024x1024, so
    the image path does it once, for the hash and the upload both)."""
    import numpy as np

    return np.ascontiguousarray(np.asarray(img, dtype=np.uint8))


def image_digest(img: Any, array: Any = None) -> bytes:
    """A content hash of an RGB PIL image (size and pixels; `array`: its image_array if already made): the key of
    the embedding cache. SHA-256 over the pixel buffer (SHA-256 has CPU instructions where BLAKE2 does not, so a
    1024x1024 image hashes in about 2 ms instead of 3-20)."""
    h = hashlib.sha256()
    h.update(f"{img.mode}|{img.size}|".encode())
    h.update(memoryview(image_array(img) if array is None else array).cast("B"))
    return h.digest()[:16]


_hasher: ThreadPoolExecutor | None = None
_hasher_lock = threading.Lock()


def digest_soon(img: Any, array: Any) -> Future[bytes]:
    """image_digest computed on a worker thread (hashlib lets go of the GIL over large buffers), so that the caller
    can launch the image's preprocessing on a GPU meanwhile."""
    global _hasher
    with _hasher_lock:
        if _hasher is None:
            _hasher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="exlpy-image-hash")
    return _hasher.submit(image_digest, img, array)
