"""The eval preprocessing, described once and done without torch: the shorter side resized to
`img_size / crop_pct` (antialiased, the recorded interpolation), a centre crop of `img_size`, then
(x / 255 - mean) / std. `EvalPreprocessing` is the description a model file records (`preprocessing`, read
back through model_files.stored_metadata's checks); the torch path (data.transforms.EvalTransform,
normalize_batch) reads its numbers from it, and the slim server (serving.slim) runs this module's
PIL / NumPy implementation of it.

Pixels: both decode through the same PIL calls (`centre_region`: the draft decode that keeps the crop, the
cut of a very long image around its centre), and PIL's resize and crop here equal torchvision's on a PIL
image, so the uint8 crop is the same, bit for bit. The normalisation is normalize_batch's float32
multiply-then-add, so equal inputs give equal floats.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
from PIL import Image

from imgcls.data.images import centre_box, decode_rgb, oriented_size
from imgcls.data.settings import eval_size

PIL_RESAMPLING = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC,
                  "nearest": Image.Resampling.NEAREST}


def resize_size(img_size: int, crop_pct: float) -> int:
    """The shorter side's length before the centre crop."""
    return int(math.floor(img_size / crop_pct))


def centre_region(width: int, height: int, resize_to: int, decode: Callable) -> Image.Image:
    """The decoded image (`decode(min_size)`: data.images.decode_rgb on the opened file) cut to at most
    MAX_EVAL_ASPECT around its centre, decoded at the smallest draft scale that keeps the resize's pixels."""
    box = centre_box(width, height)
    short = min(width, height)
    need = (math.ceil((box[2] - box[0]) * resize_to / short), math.ceil((box[3] - box[1]) * resize_to / short))
    image = decode(need)
    if box != (0, 0, width, height):  # scaled to a draft decode's size
        sx, sy = image.width / width, image.height / height
        image = image.crop((math.floor(box[0] * sx), math.floor(box[1] * sy),
                            max(1, math.ceil(box[2] * sx)), max(1, math.ceil(box[3] * sy))))
    return image


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
    """uint8 [N, C, S, S] -> float32 (x / 255 - mean) / std, as x * scale + shift in float32 (normalize_batch's
    arithmetic, so the result matches it bit for bit)."""
    std32 = np.asarray(std, dtype=np.float32)
    scale = (np.float32(1.0) / (np.float32(255.0) * std32)).reshape(1, -1, 1, 1)
    shift = (-np.asarray(mean, dtype=np.float32) / std32).reshape(1, -1, 1, 1)
    out = batch.astype(np.float32)
    out *= scale
    out += shift
    return out


@dataclass(frozen=True)
class EvalPreprocessing:
    """A model's eval preprocessing (checked where it is read: config for a config, the model file's
    checks for a file)."""

    img_size: int
    crop_pct: float
    interpolation: str
    mean: tuple
    std: tuple

    @classmethod
    def of(cls, data_cfg) -> "EvalPreprocessing":
        """A config's `data` section's: at `data.eval_img_size` when set (FixRes)."""
        return cls(eval_size(data_cfg), data_cfg.crop_pct, data_cfg.interpolation, tuple(data_cfg.mean),
                   tuple(data_cfg.std))

    @property
    def resize_to(self) -> int:
        return resize_size(self.img_size, self.crop_pct)

    def record(self, train_img_size: int) -> dict:
        """What a model file stores (`preprocessing`) and /health shows."""
        return {"img_size": self.img_size, "resize": self.resize_to, "crop_pct": self.crop_pct,
                "mean": list(self.mean), "std": list(self.std), "interpolation": self.interpolation,
                "train_img_size": train_img_size}

    # ---------------------------------------------------------------- PIL and NumPy

    def decode(self, pil: Image.Image, name: str) -> np.ndarray:
        """An opened image (data.images.open_image: the header read) -> uint8 [3, img_size, img_size]
        (ImageDecodeError / OSError when its pixels cannot be read)."""
        width, height = oriented_size(pil)
        image = centre_region(width, height, self.resize_to, lambda need: decode_rgb(pil, name, need))
        size = resized_short_side(image.width, image.height, self.resize_to)
        if size != image.size:
            image = image.resize(size, resample=PIL_RESAMPLING[self.interpolation])
        image = image.crop(centre_crop_box(image.width, image.height, self.img_size))
        return np.ascontiguousarray(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1))

    def normalise(self, batch: np.ndarray) -> np.ndarray:
        return normalise(batch, self.mean, self.std)
