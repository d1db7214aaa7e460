"""An export's eval preprocessing with PIL and NumPy, as data.transforms.EvalTransform and
data.transforms.normalize_batch do it with torch: the shorter side resized to `img_size / crop_pct`
(antialiased, the recorded interpolation), a centre crop of `img_size`, then (x / 255 - mean) / std.

Pixels: every image goes through the same PIL calls as the torch path (the draft decode that keeps the crop,
the cut of a very long image around its centre, PIL's resize and crop), so the uint8 crop is the same, bit
for bit.
The normalisation is the torch path's float32 multiply-then-add, so equal inputs give equal floats.
"""
from __future__ import annotations

import io
import math
from typing import Optional

import numpy as np
from PIL import Image

from core.errors import ImageDecodeError
from data.images import centre_box, decode_rgb, open_image, oriented_size
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
        pil = open_image(io.BytesIO(body), name=SOURCE_NAME)
        width, height = oriented_size(pil)
        if self.max_pixels is not None and width * height > self.max_pixels:
            raise BadImage("decompression_bomb", f"{width}x{height} = {width * height} pixels, above the limit of "
                                                 f"{self.max_pixels} (PIL.Image.MAX_IMAGE_PIXELS)")
        box = centre_box(width, height)
        short = min(width, height)
        need = (math.ceil((box[2] - box[0]) * self.resize_to / short),
                math.ceil((box[3] - box[1]) * self.resize_to / short))
        image = decode_rgb(pil, SOURCE_NAME, need)
        if box != (0, 0, width, height):  # scaled to a draft decode's size
            sx, sy = image.width / width, image.height / height
            image = image.crop((math.floor(box[0] * sx), math.floor(box[1] * sy),
                                max(1, math.ceil(box[2] * sx)), max(1, math.ceil(box[3] * sy))))
        size = resized_short_side(image.width, image.height, self.resize_to)
        if size != image.size:
            image = image.resize(size, resample=self.resample)
        image = image.crop(centre_crop_box(image.width, image.height, self.img_size))
        return np.ascontiguousarray(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1))

    def normalise(self, batch: np.ndarray) -> np.ndarray:
        return normalise(batch, self.mean, self.std)
