"""An export's eval preprocessing with PIL and NumPy, as data.transforms.EvalTransform and
data.transforms.normalize_batch do it with torch: the shorter side resized to `img_size / crop_pct`
(antialiased, the recorded interpolation), a centre crop of `img_size`, then (x / 255 - mean) / std.

Pixels: a PNG, WebP, ... and a JPEG that PIL's draft decodes (from 1/4 scale down, or one whose header the
torch path leaves to PIL) go through the same PIL calls as the torch path, so the uint8 crop is the same,
bit for bit. A JPEG the torch path decodes at full size with torchvision's decoder and resizes with torch's
uint8 resize is decoded by PIL and resized by PIL (bilinear, bicubic: equal to +-1 per channel value,
docs/container.md) or, nearest, by torch's own index rule (equal).
The normalisation is the torch path's float32 multiply-then-add, so equal inputs give equal floats.
"""
from __future__ import annotations

import io
import math
from typing import Optional

import numpy as np
from PIL import Image

from core.errors import ImageDecodeError
from data.images import decode_rgb, draft_reduces, open_image, oriented_size, parse_jpeg_header
from serving.errors import BadImage, classify_decode_error

SOURCE_NAME = "<image bytes>"   # how the torch path names a request's image in its messages
PIL_RESAMPLING = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC,
                  "nearest": Image.Resampling.NEAREST}
PREPROCESSING_KEYS = ("img_size", "crop_pct", "interpolation", "mean", "std")


def resized_short_side(width: int, height: int, short_to: int) -> tuple[int, int]:
    """(width, height) with the shorter side `short_to` and the longer one scaled and truncated, as
    torchvision's resize to an int size computes it."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(short_to * long / short)
    return (short_to, new_long) if width <= height else (new_long, short_to)


def centre_crop_box(width: int, height: int, size: int) -> tuple[int, int, int, int]:
    """PIL's (left, top, right, bottom) of torchvision's centre crop of `size` (the image holds it)."""
    top = int(round((height - size) / 2.0))
    left = int(round((width - size) / 2.0))
    return left, top, left + size, top + size


def torch_nearest_indices(in_size: int, out_size: int) -> np.ndarray:
    """The source index of each output pixel in torch's `nearest` interpolation: floor(i * in / out) in
    float32, clamped (it differs from PIL's nearest, which samples pixel centres)."""
    scale = np.float32(in_size) / np.float32(out_size)
    return np.minimum(np.floor(np.arange(out_size, dtype=np.float32) * scale).astype(np.int64), in_size - 1)


def normalise(batch: np.ndarray, mean, std) -> np.ndarray:
    """uint8 [N, 3, S, S] -> float32 (x / 255 - mean) / std, as x * scale + shift in float32 (normalize_batch's
    arithmetic, so the result matches it bit for bit)."""
    std32 = np.asarray(std, dtype=np.float32)
    scale = (np.float32(1.0) / (np.float32(255.0) * std32)).reshape(1, -1, 1, 1)
    shift = (-np.asarray(mean, dtype=np.float32) / std32).reshape(1, -1, 1, 1)
    out = batch.astype(np.float32)
    out *= scale
    out += shift
    return out


class EvalPreprocess:
    """bytes -> uint8 [3, img_size, img_size] (`decode`); uint8 batch -> model input (`normalise`)."""

    def __init__(self, img_size: int, crop_pct: float, interpolation: str, mean, std,
                 max_pixels: Optional[int] = None):
        if interpolation not in PIL_RESAMPLING:
            raise ValueError(f"interpolation {interpolation!r}: one of {', '.join(PIL_RESAMPLING)}")
        self.img_size = int(img_size)
        self.resize_to = int(math.floor(img_size / crop_pct))
        self.resample = PIL_RESAMPLING[interpolation]
        self.interpolation = interpolation
        self.mean, self.std = list(mean), list(std)
        self.max_pixels = max_pixels

    @classmethod
    def from_record(cls, record: dict, max_pixels: Optional[int] = None) -> "EvalPreprocess":
        """From an export's `preprocessing` metadata (export.py writes every key)."""
        return cls(*(record[key] for key in PREPROCESSING_KEYS), max_pixels=max_pixels)

    def decode(self, body: bytes) -> np.ndarray:
        """One request's image: BadImage when the bytes are empty, not an image, truncated, or above
        `max_pixels` (as serving.model.decode_image)."""
        if not body:
            raise BadImage("empty_body", "the request carried no image bytes")
        try:
            return self._decode(body)
        except (ImageDecodeError, OSError) as err:
            message = str(err).removeprefix(f"{SOURCE_NAME}: ")
            raise BadImage(classify_decode_error(message), message) from err

    def _decode(self, body: bytes) -> np.ndarray:
        header = parse_jpeg_header(memoryview(body)) if body[:2] == b"\xff\xd8" else None
        if header is not None and header.components not in (1, 3):
            header = None  # the torch path leaves these JPEGs (CMYK, ...) to PIL as well
        pil = open_image(io.BytesIO(body), name=SOURCE_NAME)
        width, height = header.oriented_size if header is not None else oriented_size(pil)
        if self.max_pixels is not None and width * height > self.max_pixels:
            raise BadImage("decompression_bomb", f"{width}x{height} = {width * height} pixels, above the limit of "
                                                 f"{self.max_pixels} (PIL.Image.MAX_IMAGE_PIXELS)")
        short = min(width, height)
        need = (math.ceil(width * self.resize_to / short), math.ceil(height * self.resize_to / short))
        # the torch path decodes such a JPEG at full size (torchvision's decoder): no draft here either
        full_size = header is not None and not draft_reduces(need, (width, height))
        image = decode_rgb(pil, SOURCE_NAME, None if full_size else need)
        size = resized_short_side(image.width, image.height, self.resize_to)
        if full_size and self.interpolation == "nearest" and size != image.size:
            pixels = np.asarray(image, dtype=np.uint8)
            rows, columns = torch_nearest_indices(image.height, size[1]), torch_nearest_indices(image.width, size[0])
            pixels = pixels[rows][:, columns]
            image = Image.fromarray(pixels)
        elif size != image.size:
            image = image.resize(size, resample=self.resample)
        image = image.crop(centre_crop_box(image.width, image.height, self.img_size))
        return np.ascontiguousarray(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1))

    def normalise(self, batch: np.ndarray) -> np.ndarray:
        return normalise(batch, self.mean, self.std)
