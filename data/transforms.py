"""Fixed-size transforms that turn a file into a uint8 CHW tensor, and the per-batch normalisation.

Training: RandomResizedCrop (`data.scale`, `data.ratio`) to `img_size`, horizontal flip, an optional
auto-augment policy (`data.auto_augment`: torchvision.transforms.v2's RandAugment, TrivialAugmentWide,
AutoAugment's ImageNet policy or AugMix, on the uint8 crop), optional colour jitter. Evaluation: resize
the shorter side to `size / crop_pct`, centre crop `size` (`data.eval_img_size`, else `img_size`). Both
return square uint8 tensors; the float cast and normalisation happen once per batch (`normalize_batch`),
on the training device.

Decode path (measured, benchmark.py --mode loader): the file is read once and its JPEG header parsed
in Python (`data.images.parse_jpeg_header`, a tenth of the cost of PIL's open); the training crop is
drawn from that size first. When what is kept still fits at 1/4 or 1/8 scale, PIL's draft decoding
decodes at that scale; otherwise `torchvision.io.decode_jpeg` decodes the full image (the same
libjpeg-turbo pixels as PIL, faster, no PIL image copies). The result is resized as a uint8
channels-last tensor (torch's vectorised antialiased resize, equal to PIL's to +-1). CMYK, XMP-only
orientation, truncated and non-JPEG files go through PIL (`data.images.decode_rgb`, opened from the bytes
already read: one open per file), so the pixel policy (EXIF orientation, modes, refusal of broken files)
holds.

Every transform takes a file path or the file's bytes (a WebDataset sample's image): the same decode path
and pixel policy either way.
"""
from __future__ import annotations

import functools
import io
import math
import os
import random

import torch
from PIL import Image
try:  # deprecated since torchvision 0.29 (in favour of torchcodec); without it PIL decodes every file
    from torchvision.io import ImageReadMode, decode_jpeg
except ImportError:  # pragma: no cover
    decode_jpeg = None
from torchvision.transforms import InterpolationMode
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from core.errors import ImageDecodeError
from data.images import JpegHeader, decode_rgb, open_image, oriented_size, parse_jpeg_header, require_regular_file

TV_INTERPOLATION = {"bilinear": InterpolationMode.BILINEAR, "bicubic": InterpolationMode.BICUBIC,
                    "nearest": InterpolationMode.NEAREST}
# Antialiased uint8 resizing that torch does natively (vectorised on x86); nearest goes through torchvision.
_TORCH_MODES = {InterpolationMode.BILINEAR: "bilinear", InterpolationMode.BICUBIC: "bicubic"}


AUGMIX_SEVERITY = (1, 10)  # the range torchvision's AugMix accepts

# data.auto_augment: name -> (magnitude, num_ops, interpolation mode) -> the policy (a new policy is one entry
# here and one name in core/config.py's data.auto_augment)
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
                 auto_augment=None):
        self.img_size = img_size
        self.scale = tuple(scale)
        self.ratio = tuple(ratio)
        self.hflip = hflip
        self.interpolation = TV_INTERPOLATION[interpolation]
        self.auto_augment = auto_augment
        j = color_jitter
        self.jitter = v2.ColorJitter(brightness=j, contrast=j, saturation=j) if j > 0 else None

    def __call__(self, path, seed: int | None = None) -> torch.Tensor:
        rng = random.Random(seed)
        source = read_source(path)
        width, height = source.size
        top, left, h, w = sample_crop(width, height, self.scale, self.ratio, rng)
        # The decoded image only has to keep the crop at >= img_size pixels.
        need = (math.ceil(width * self.img_size / w), math.ceil(height * self.img_size / h))
        image = None
        if source.jpeg is not None and not draft_reduces(need, (width, height)):
            image = decode_jpeg_tensor(source.jpeg, (height, width))
        if image is None:
            image = F.pil_to_tensor(source.rgb(min_size=need))
        out = resized_crop(image, (width, height), (left, top, left + w, top + h), self.img_size, self.interpolation)
        if self.hflip > 0 and rng.random() < self.hflip:
            out = F.horizontal_flip(out)
        if self.auto_augment is not None:
            # The resize leaves a channels-last view; some of the policies' ops (autocontrast, colour) are 2-6x
            # slower on it than on a packed CHW copy (RandAugment: ~15% of its cost), and the pixels are the same.
            out = self.auto_augment(out.contiguous())
        if self.jitter is not None:
            out = self.jitter(out)
        return out


def draft_reduces(need: tuple[int, int], size: tuple[int, int]) -> bool:
    """Whether PIL's JPEG draft mode can decode at 1/4 scale or less and still keep `need` pixels.

    At 1/2 scale the draft decode saves too little (the entropy decoding is the same) to pay for PIL's own
    per-file costs (a second header parse, chunked reads, an RGBX copy): on ImageNet-sized photos the full
    tensor decode was 4-7% faster per image; from 1/4 scale on the draft wins."""
    return 4 * need[0] <= size[0] and 4 * need[1] <= size[1]


_JPEG_START, _JPEG_END = b"\xff\xd8", b"\xff\xd9"


class SourceImage:
    """An image file read once (one open, one read): the whole file's bytes, its displayed size, and either
    the bytes as a uint8 tensor with the parsed header (a JPEG the tensor decoder can take) or, for
    everything else, the file opened by PIL from those bytes (header read, pixels not yet decoded)."""

    def __init__(self, name, buf, jpeg: torch.Tensor | None, header: JpegHeader | None):
        self.name = name
        self.buf = buf
        self.jpeg = jpeg
        self.header = header
        self._pil = None if header is not None else open_image(io.BytesIO(buf), name=name)
        self.size = header.oriented_size if header is not None else oriented_size(self._pil)

    def rgb(self, min_size: tuple[int, int] | None = None) -> Image.Image:
        """Decode through PIL with the pixel policy (`data.images.decode_rgb`)."""
        pil = self._pil if self._pil is not None else open_image(io.BytesIO(self.buf), name=self.name)
        self._pil = None
        return decode_rgb(pil, self.name, min_size)  # from memory: no file left open to close


def read_source(path) -> SourceImage:
    """`path` (or an image's bytes) as a SourceImage. ImageDecodeError when the file cannot be read or not
    even PIL can open it."""
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
    jpeg, header = None, None
    if decode_jpeg is not None and bytes(buf[:2]) == _JPEG_START:
        parsed = parse_jpeg_header(memoryview(buf))
        if parsed is not None and parsed.components in (1, 3):
            # torch.frombuffer wants a writable buffer (a shard's sample arrives as bytes)
            writable = buf if isinstance(buf, (bytearray, memoryview)) and not memoryview(buf).readonly \
                else bytearray(buf)
            jpeg, header = torch.frombuffer(writable, dtype=torch.uint8), parsed
    return SourceImage(path if isinstance(path, (str, os.PathLike)) else "<image bytes>", buf, jpeg, header)


def decode_jpeg_tensor(data: torch.Tensor, oriented_hw: tuple[int, int] | None = None) -> torch.Tensor | None:
    """JPEG bytes (a uint8 tensor) -> uint8 RGB CHW tensor with the EXIF orientation applied, or None where PIL
    must decide: no end-of-image marker (truncated or trailing data), a decoder error, or a result whose
    (height, width) is not `oriented_hw` (the header and the decoder read the orientation differently)."""
    if decode_jpeg is None:
        return None
    try:
        if bytes(data[-2:].numpy()) != _JPEG_END:
            return None
        image = decode_jpeg(data, mode=ImageReadMode.RGB, apply_exif_orientation=True)
    except (RuntimeError, OSError, ValueError):
        return None
    if oriented_hw is not None and tuple(image.shape[-2:]) != tuple(oriented_hw):
        return None
    return image


def resized_crop(image: torch.Tensor, full_size: tuple[int, int], box, size: int, interpolation) -> torch.Tensor:
    """Crop `box` (left, top, right, bottom in `full_size` pixels) out of `image`, which may be a reduced
    decode of that size, and resize it to size x size (antialiased, uint8 in and out)."""
    sx, sy = image.shape[-1] / full_size[0], image.shape[-2] / full_size[1]
    left, top = int(round(box[0] * sx)), int(round(box[1] * sy))
    right = max(left + 1, min(image.shape[-1], int(round(box[2] * sx))))
    bottom = max(top + 1, min(image.shape[-2], int(round(box[3] * sy))))
    # A packed channels-last copy of the crop takes torch's vectorised uint8 path: ~20% faster than resizing
    # the strided view, same pixels.
    crop = image[:, top:bottom, left:right].unsqueeze(0).contiguous(memory_format=torch.channels_last)
    if interpolation in _TORCH_MODES:  # straight to torch: v2's dispatch costs a third of a small resize
        return torch.nn.functional.interpolate(crop, size=(size, size), mode=_TORCH_MODES[interpolation],
                                               antialias=True, align_corners=False)[0]
    return F.resize(crop, [size, size], interpolation=interpolation, antialias=True)[0]


class EvalTransform:
    """path -> uint8 tensor: shorter side to img_size / crop_pct, then a centre crop of img_size (the eval
    size: `data.eval_img_size` when set)."""

    def __init__(self, img_size: int, crop_pct: float, interpolation: str):
        self.img_size = img_size
        self.resize_to = int(math.floor(img_size / crop_pct))
        self.interpolation = TV_INTERPOLATION[interpolation]

    def __call__(self, path) -> torch.Tensor:
        source = read_source(path)
        width, height = source.size
        short = min(width, height)
        need = (math.ceil(width * self.resize_to / short), math.ceil(height * self.resize_to / short))
        if source.jpeg is not None and not draft_reduces(need, (width, height)):
            image = decode_jpeg_tensor(source.jpeg, (height, width))
            if image is not None:
                return self.from_tensor(image)
        return self.from_image(source.rgb(min_size=need))

    def from_tensor(self, image: torch.Tensor) -> torch.Tensor:
        """The same resize and crop on a uint8 CHW tensor (torch's antialiased resize matches PIL's to +-1)."""
        batch = image.unsqueeze(0).contiguous(memory_format=torch.channels_last)
        batch = F.resize(batch, self.resize_to, interpolation=self.interpolation, antialias=True)
        return F.center_crop(batch, self.img_size)[0].contiguous()

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
