"""Fixed-size transforms that turn a file into a uint8 CHW tensor, and the per-batch normalisation.

Training: RandomResizedCrop (`data.scale`, `data.ratio`) to `img_size`, horizontal flip, an optional
auto-augment policy (`data.auto_augment`: torchvision.transforms.v2's RandAugment, TrivialAugmentWide,
AutoAugment's ImageNet policy or AugMix, on the uint8 crop), optional colour jitter. Evaluation: resize
the shorter side to `size / crop_pct`, centre crop `size` (`data.eval_img_size`, else `img_size`). Both
return square uint8 tensors; the float cast and normalisation happen once per batch (`normalize_batch`),
on the training device.

Decode path (measured in docs/performance.md, "The decode path"): the file is read once and PIL opens it from those
bytes (the header only: size and EXIF orientation); the training crop is drawn from that size first, and
a JPEG is decoded at the smallest of PIL's draft scales (1/2, 1/4, 1/8) that still keeps the crop at
>= img_size pixels. `data.images.decode_rgb` applies the pixel policy (EXIF orientation, modes, refusal
of broken files). Training resizes the crop as a uint8 channels-last tensor (torch's vectorised
antialiased resize); evaluation resizes and crops in PIL.

Evaluation bounds its work by its output, whatever the shape: an image whose long side is more than
`MAX_EVAL_ASPECT` times its short side is first centre-cropped along the long side to that ratio. The
centre crop the evaluation keeps spans `crop_pct` of the short side, so the cut keeps every pixel it
looks at (only their sub-pixel placement may differ); without it a 400000x1 PNG would be resized to
14,400,000 x 36 pixels on the way to a 32 px crop.

Every transform takes a file path or the file's bytes (a WebDataset sample's image): the same decode path
and pixel policy either way.

`data.channels` other than 3 (or a declared `data.value_range`): files are read as N float bands on the 0..255
scale (`data.images`), cropped, resized and flipped in torch with the same draws, and returned as float32 CHW
tensors; `normalize_batch` treats both sample types alike. With 3 channels nothing here changes.
"""
from __future__ import annotations

import functools
import io
import math
import os
import random

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import InterpolationMode, v2
from torchvision.transforms.v2 import functional as F

from imgcls.core.errors import ImageDecodeError
from imgcls.data.eval_preprocessing import EvalPreprocessing, centre_region, resize_size
from imgcls.data.images import (centre_box, decode_jpeg_array, decode_plain_jpeg, decode_rgb, is_npy, open_image,
                                oriented_size, plain_jpeg_size, read_bands, require_regular_file)

TV_INTERPOLATION = {"bilinear": InterpolationMode.BILINEAR, "bicubic": InterpolationMode.BICUBIC,
                    "nearest": InterpolationMode.NEAREST}
# Antialiased uint8 resizing that torch does natively (vectorised on x86); nearest goes through torchvision.
_TORCH_MODES = {InterpolationMode.BILINEAR: "bilinear", InterpolationMode.BICUBIC: "bicubic"}


AUGMIX_SEVERITY = (1, 10)  # the range torchvision's AugMix accepts

# data.auto_augment: name -> (magnitude, num_ops, interpolation mode) -> the policy (a new policy is one entry
# here and one name in data/settings.py's data.auto_augment)
AUTO_AUGMENT_POLICIES = {
    "randaugment": lambda magnitude, num_ops, mode: v2.RandAugment(num_ops=num_ops, magnitude=magnitude,
                                                                   interpolation=mode),
    "trivialaugment": lambda magnitude, num_ops, mode: v2.TrivialAugmentWide(interpolation=mode),
    "autoaugment": lambda magnitude, num_ops, mode: v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET,
                                                                   interpolation=mode),
    "augmix": lambda magnitude, num_ops, mode: v2.AugMix(
        severity=min(max(magnitude, AUGMIX_SEVERITY[0]), AUGMIX_SEVERITY[1]), interpolation=mode),
}


def auto_augment_policy(name: str | None, magnitude: int, num_ops: int, interpolation: str):
    """torchvision.transforms.v2's policy for `data.auto_augment` (None: off), on uint8 CHW tensors.

    `magnitude` is RandAugment's (bins 0..30) and AugMix's severity (clipped to 1..10); `num_ops` is
    RandAugment's ops per image. The policies draw from torch's default generator."""
    if name is None:
        return None
    # The policies' affine ops (rotate, shear, translate) take nearest or bilinear on tensors, not bicubic
    # (torchvision's tensor affine): a bicubic run's crops stay bicubic, its policy ops are bilinear.
    mode = TV_INTERPOLATION["bilinear" if interpolation == "bicubic" else interpolation]
    if name not in AUTO_AUGMENT_POLICIES:
        raise ValueError(f"unknown auto-augment policy {name!r}; one of {', '.join(AUTO_AUGMENT_POLICIES)}")
    return AUTO_AUGMENT_POLICIES[name](magnitude, num_ops, mode)


class TrainTransform:
    """(path, seed) -> uint8 tensor. The crop and flip come from `random.Random(seed)`; the auto-augment
    policy and colour jitter from the torch RNG, which the caller seeds with the same per-sample seed
    (`data.datasets.TrainDataset`), so the output is a function of (file, seed)."""

    def __init__(self, img_size: int, scale, ratio, hflip: float, color_jitter: float, interpolation: str,
                 auto_augment=None, channels: int = 3, value_range=None):
        self.img_size = img_size
        self.channels, self.value_range = channels, value_range
        self.scale = tuple(scale)
        self.ratio = tuple(ratio)
        self.hflip = hflip
        self.interpolation = TV_INTERPOLATION[interpolation]
        self.auto_augment = auto_augment
        j = color_jitter
        self.jitter = v2.ColorJitter(brightness=j, contrast=j, saturation=j) if j > 0 else None

    def __call__(self, path, seed: int | None = None) -> torch.Tensor:
        rng = random.Random(seed)
        if reads_bands(self.channels, self.value_range):
            return self.bands(path, rng)
        source = read_source(path)
        width, height = source.size
        top, left, h, w = sample_crop(width, height, self.scale, self.ratio, rng)
        # The decoded image only has to keep the crop at >= img_size pixels (a JPEG's draft scale).
        need = (math.ceil(width * self.img_size / w), math.ceil(height * self.img_size / h))
        crop = source.crop_tensor((left, top, left + w, top + h), min_size=need)
        crop_size = (crop.shape[-1], crop.shape[-2])
        out = resized_crop(crop, crop_size, (0, 0, *crop_size), self.img_size, self.interpolation)
        if self.hflip > 0 and rng.random() < self.hflip:
            out = F.horizontal_flip(out)
        if self.auto_augment is not None:
            # The resize leaves a channels-last view; some of the policies' ops (autocontrast, colour) are 2-6x
            # slower on it than on a packed CHW copy (RandAugment: ~15% of its cost), and the pixels are the same.
            out = self.auto_augment(out.contiguous())
        if self.jitter is not None:
            out = self.jitter(out)
        return out

    def bands(self, path, rng: random.Random) -> torch.Tensor:
        """The N-band path: the same crop and flip draws on the float array (colour policies are refused for it
        by data.settings)."""
        array = read_band_array(path, self.channels, self.value_range)
        height, width = array.shape[:2]
        top, left, h, w = sample_crop(width, height, self.scale, self.ratio, rng)
        crop = torch.from_numpy(np.ascontiguousarray(array[top:top + h, left:left + w])).permute(2, 0, 1)
        out = resized_crop(crop, (w, h), (0, 0, w, h), self.img_size, self.interpolation)
        if self.hflip > 0 and rng.random() < self.hflip:
            out = F.horizontal_flip(out)
        return out.contiguous()

    def blank(self, size: int) -> torch.Tensor:
        return blank_image(self.channels, self.value_range, size)


def reads_bands(channels: int, value_range) -> bool:
    """Whether files are read as float bands (`data.images`) rather than as today's 8-bit RGB."""
    return channels != 3 or value_range is not None


def blank_image(channels: int, value_range, size: int) -> torch.Tensor:
    """The zero image that stands in for an unreadable file: the pipeline's channels and sample type."""
    dtype = torch.float32 if reads_bands(channels, value_range) else torch.uint8
    return torch.zeros(channels, size, size, dtype=dtype)


def blank_for(transform, size: int) -> torch.Tensor:
    """`transform`'s zero image (an 8-bit RGB one for a transform that does not say)."""
    if hasattr(transform, "blank"):
        return transform.blank(size)
    return torch.zeros(3, size, size, dtype=torch.uint8)


def read_band_array(path, channels: int, value_range) -> np.ndarray:
    name, buf = read_file_bytes(path)
    return read_bands(buf, name, channels, value_range)


class SourceImage:
    """An image file read once (one open, one read): the whole file's bytes and its displayed size, from the
    header alone: libjpeg-turbo's for a plain JPEG (`data.images.plain_jpeg_size`), else PIL's open (pixels
    not yet decoded)."""

    def __init__(self, name, buf):
        self.name = name
        self.buf = buf
        self._plain = plain_jpeg_size(buf)
        self._pil = None if self._plain is not None else open_image(io.BytesIO(buf), name=name)
        self.size = self._plain or oriented_size(self._pil)

    def _plain_array(self, min_size: tuple[int, int] | None) -> np.ndarray | None:
        """A plain JPEG's decode by libjpeg-turbo (None for other files, or when it reports an error: PIL then
        opens the file, and decodes or refuses it)."""
        if self._plain is not None:
            array = decode_jpeg_array(self.buf, self._plain, min_size)
            self._plain = None
            if array is None:
                self._pil = open_image(io.BytesIO(self.buf), name=self.name)
            return array
        return decode_plain_jpeg(self._pil, self.buf, min_size) if self._pil is not None else None

    def crop_tensor(self, box, min_size: tuple[int, int] | None = None) -> torch.Tensor:
        """The pixels of `box` (left, top, right, bottom in displayed pixels) as a uint8 CHW tensor, from a
        decode at least `min_size` large: a plain JPEG's by libjpeg-turbo into an array
        (`data.images.decode_plain_jpeg`), the rest through PIL; the same pixels either way."""
        array = self._plain_array(min_size)
        if array is not None:
            self._pil = None
            left, top, right, bottom = decoded_box((array.shape[1], array.shape[0]), self.size, box)
            return torch.from_numpy(array[top:bottom, left:right]).permute(2, 0, 1)
        image = self.rgb(min_size=min_size)
        # Only the crop's pixels become a tensor (the copy out of PIL costs as much as the resize).
        return F.pil_to_tensor(image.crop(decoded_box(image.size, self.size, box)))

    def rgb(self, min_size: tuple[int, int] | None = None) -> Image.Image:
        """The decode at least `min_size` large as a PIL image: a plain JPEG's by libjpeg-turbo (the same pixels
        as PIL's decode for ~2/3 of its CPU time), the rest through PIL with the pixel policy
        (`data.images.decode_rgb`)."""
        array = self._plain_array(min_size)
        if array is not None:
            self._pil = None
            return Image.fromarray(array, "RGB")
        pil = self._pil if self._pil is not None else open_image(io.BytesIO(self.buf), name=self.name)
        self._pil = None
        return decode_rgb(pil, self.name, min_size)  # from memory: no file left open to close


class ArraySource:
    """A `.npy` array read by the 8-bit RGB path: its (H, W, 3) bands as an RGB image, a wider type scaled to
    8 bits as 16-bit images are there."""

    def __init__(self, name, buf):
        self.array = read_bands(buf, name, 3)
        self.size = (self.array.shape[1], self.array.shape[0])

    def rgb(self, min_size: tuple[int, int] | None = None) -> Image.Image:
        return Image.fromarray(np.clip(self.array, 0, 255).round().astype(np.uint8), "RGB")


def read_source(path) -> SourceImage | ArraySource:
    """`path` (or an image's bytes) as a SourceImage. ImageDecodeError when the file cannot be read or not
    even PIL can open it."""
    name, buf = read_file_bytes(path)
    if is_npy(buf):
        return ArraySource(name, buf)
    return SourceImage(name, buf)


def read_file_bytes(path) -> tuple:
    """(a name for messages, the bytes) of a file path or of an image's bytes."""
    if isinstance(path, (bytes, bytearray, memoryview)):
        buf = path
    else:
        require_regular_file(path)  # ImageDecodeError for a FIFO, which open() would wait on for ever
        try:
            with open(path, "rb") as f:
                buf = bytearray(os.fstat(f.fileno()).st_size)
                buf = memoryview(buf)[:f.readinto(buf) or 0]
        except OSError as err:
            raise ImageDecodeError(f"{path}: {type(err).__name__}: {err.strerror or err}") from err
    return path if isinstance(path, (str, os.PathLike)) else "<image bytes>", buf


def decoded_box(decoded_size: tuple[int, int], full_size: tuple[int, int], box) -> tuple[int, int, int, int]:
    """`box` (left, top, right, bottom in `full_size` pixels) in the pixels of a decode of `decoded_size`
    (a reduced draft decode, or the full size), at least one pixel each way."""
    sx, sy = decoded_size[0] / full_size[0], decoded_size[1] / full_size[1]
    left, top = int(round(box[0] * sx)), int(round(box[1] * sy))
    right = max(left + 1, min(decoded_size[0], int(round(box[2] * sx))))
    bottom = max(top + 1, min(decoded_size[1], int(round(box[3] * sy))))
    return left, top, right, bottom


def resized_crop(image: torch.Tensor, full_size: tuple[int, int], box, size: int, interpolation) -> torch.Tensor:
    """Crop `box` (left, top, right, bottom in `full_size` pixels) out of `image`, which may be a reduced
    decode of that size, and resize it to size x size (antialiased, uint8 in and out)."""
    left, top, right, bottom = decoded_box((image.shape[-1], image.shape[-2]), full_size, box)
    # A packed channels-last copy of the crop takes torch's vectorised uint8 path: ~20% faster than resizing
    # the strided view, same pixels.
    crop = image[:, top:bottom, left:right].unsqueeze(0).contiguous(memory_format=torch.channels_last)
    if interpolation in _TORCH_MODES:  # straight to torch: v2's dispatch costs a third of a small resize
        return torch.nn.functional.interpolate(crop, size=(size, size), mode=_TORCH_MODES[interpolation],
                                               antialias=True, align_corners=False)[0]
    return F.resize(crop, [size, size], interpolation=interpolation, antialias=True)[0]


# The longest side evaluation resizes, in multiples of the short side (a longer one is cut first).
class EvalTransform:
    """path -> uint8 tensor: data.eval_preprocessing's description (shorter side to img_size / crop_pct, then
    a centre crop of img_size, the eval size: `data.eval_img_size` when set) with torchvision on the PIL image.
    An image longer than `MAX_EVAL_ASPECT` to 1 is first cut to that ratio around its centre, so the work is
    bounded by the output size whatever the shape."""

    def __init__(self, img_size: int, crop_pct: float, interpolation: str, channels: int = 3, value_range=None):
        self.img_size = img_size
        self.resize_to = resize_size(img_size, crop_pct)
        self.interpolation = TV_INTERPOLATION[interpolation]
        self.channels, self.value_range = channels, value_range

    def blank(self, size: int | None = None) -> torch.Tensor:
        return blank_image(self.channels, self.value_range, size or self.img_size)

    @classmethod
    def of(cls, preprocessing: EvalPreprocessing) -> "EvalTransform":
        return cls(preprocessing.img_size, preprocessing.crop_pct, preprocessing.interpolation)

    def __call__(self, path) -> torch.Tensor:
        if reads_bands(self.channels, self.value_range):
            return self.from_array(read_band_array(path, self.channels, self.value_range))
        source = read_source(path)
        return self.from_image(centre_region(*source.size, self.resize_to, source.rgb))

    def from_array(self, array: np.ndarray) -> torch.Tensor:
        """The N-band path: an (H, W, N) float array cut as `__call__` cuts an image, resized and cropped in
        torch (antialiased, float)."""
        left, top, right, bottom = centre_box(array.shape[1], array.shape[0])
        crop = torch.from_numpy(np.ascontiguousarray(array[top:bottom, left:right])).permute(2, 0, 1)
        out = F.resize(crop, self.resize_to, interpolation=self.interpolation, antialias=True)
        return F.center_crop(out, self.img_size).contiguous()

    def from_image(self, img: Image.Image) -> torch.Tensor:
        img = F.resize(img, self.resize_to, interpolation=self.interpolation, antialias=True)
        img = F.center_crop(img, self.img_size)
        return F.pil_to_tensor(img)


def sample_crop(width: int, height: int, scale, ratio, rng: random.Random) -> tuple[int, int, int, int]:
    """RandomResizedCrop's box (top, left, height, width), drawn as torchvision draws it (area fraction uniform
    in `scale`, aspect ratio log-uniform in `ratio`, 10 tries, then the largest centred box with the ratio
    clamped), but from a Python RNG: torchvision's tensor draws cost ~8 tensor ops per try, a few % of a
    small image's whole pipeline."""
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def normalize_batch(images: torch.Tensor, mean, std, dtype=torch.float32, channels_last: bool = False) -> torch.Tensor:
    """uint8 NCHW -> normalised float, once per batch, on whatever device `images` is on.

    One output allocation, filled by a cast-and-copy (which also sets the memory format) and two in-place
    passes: about a third of the CPU time of `(x.float() - mean) / std`, which allocates three times.
    """
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    scale, shift = _affine(tuple(mean), tuple(std), images.device)
    out = torch.empty(images.shape, dtype=torch.float32, device=images.device, memory_format=memory_format)
    out.copy_(images).mul_(scale).add_(shift)
    return out if dtype == torch.float32 else out.to(dtype)


@functools.lru_cache(maxsize=8)
def _affine(mean: tuple, std: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """x * scale + shift == (x / 255 - mean) / std; made once per device, not copied there every step."""
    std_t = torch.tensor(std, dtype=torch.float32)
    scale = (1.0 / (255.0 * std_t)).view(1, -1, 1, 1)
    shift = (-torch.tensor(mean, dtype=torch.float32) / std_t).view(1, -1, 1, 1)
    return scale.to(device), shift.to(device)
