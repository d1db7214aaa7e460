"""Fixed-size transforms that turn a file into a uint8 CHW tensor, and the per-batch normalisation.

Training: RandomResizedCrop (`data.scale`, `data.ratio`) to `img_size`, horizontal flip, optional
colour jitter. Evaluation: resize the shorter side to `img_size / crop_pct`, centre crop. Both decode
JPEGs at the smallest draft scale that still covers what is kept, and both return
`img_size x img_size` uint8 tensors; the float cast and normalisation happen once per batch
(`normalize_batch`), on the training device.
"""
from __future__ import annotations

import math

import torch
from PIL import Image
from torchvision.transforms import InterpolationMode, RandomResizedCrop
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from data.images import load_rgb, open_image, oriented_size

PIL_RESAMPLE = {"bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC, "nearest": Image.NEAREST}
TV_INTERPOLATION = {"bilinear": InterpolationMode.BILINEAR, "bicubic": InterpolationMode.BICUBIC,
                    "nearest": InterpolationMode.NEAREST}


class TrainTransform:
    """path -> uint8 tensor; all randomness comes from the torch RNG, which the caller seeds per sample."""

    def __init__(self, img_size: int, scale, ratio, hflip: float, color_jitter: float, interpolation: str):
        self.img_size = img_size
        self.scale = tuple(scale)
        self.ratio = tuple(ratio)
        self.hflip = hflip
        self.resample = PIL_RESAMPLE[interpolation]
        j = color_jitter
        self.jitter = v2.ColorJitter(brightness=j, contrast=j, saturation=j) if j > 0 else None

    def __call__(self, path) -> torch.Tensor:
        width, height = oriented_size(open_image(path))
        top, left, h, w = RandomResizedCrop.get_params(_size_only(width, height), self.scale, self.ratio)
        # The decoded image only has to keep the crop at >= img_size pixels.
        need = (math.ceil(width * self.img_size / w), math.ceil(height * self.img_size / h))
        img = load_rgb(path, min_size=need)
        sx, sy = img.width / width, img.height / height
        box = (left * sx, top * sy, (left + w) * sx, (top + h) * sy)
        img = img.resize((self.img_size, self.img_size), self.resample, box=box)
        out = F.pil_to_tensor(img)
        if self.hflip > 0 and torch.rand(1).item() < self.hflip:
            out = F.horizontal_flip(out)
        if self.jitter is not None:
            out = self.jitter(out)
        return out


class EvalTransform:
    """path -> uint8 tensor: shorter side to img_size / crop_pct, then a centre crop of img_size."""

    def __init__(self, img_size: int, crop_pct: float, interpolation: str):
        self.img_size = img_size
        self.resize_to = int(math.floor(img_size / crop_pct))
        self.interpolation = TV_INTERPOLATION[interpolation]

    def __call__(self, path) -> torch.Tensor:
        width, height = oriented_size(open_image(path))
        short = min(width, height)
        need = (math.ceil(width * self.resize_to / short), math.ceil(height * self.resize_to / short))
        return self.from_image(load_rgb(path, min_size=need))

    def from_image(self, img: Image.Image) -> torch.Tensor:
        img = F.resize(img, self.resize_to, interpolation=self.interpolation, antialias=True)
        img = F.center_crop(img, self.img_size)
        return F.pil_to_tensor(img)


def _size_only(width: int, height: int) -> torch.Tensor:
    """A stand-in image for `RandomResizedCrop.get_params`, which only reads the size (no memory)."""
    return torch.empty(1, 1, 1).expand(1, height, width)


def normalize_batch(images: torch.Tensor, mean, std, dtype=torch.float32, channels_last: bool = False) -> torch.Tensor:
    """uint8 NCHW -> normalised float, once per batch, on whatever device `images` is on."""
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    images = images.to(dtype=torch.float32, memory_format=memory_format)
    mean_t = torch.tensor(mean, device=images.device, dtype=torch.float32).view(1, -1, 1, 1) * 255.0
    std_t = torch.tensor(std, device=images.device, dtype=torch.float32).view(1, -1, 1, 1) * 255.0
    return ((images - mean_t) / std_t).to(dtype)
