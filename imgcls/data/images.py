"""Reading an image file into an RGB PIL image, the same way in training, evaluation and inference.

Policy: EXIF orientation applied; 16-bit and 32-bit grayscale scaled to 8 bits (PIL's own
`convert('RGB')` clips them to white); alpha (RGBA, LA, PA, palette transparency) composited on a
white background; CMYK and YCbCr converted; JPEGs may be decoded at a reduced size (`draft`) when
the caller only needs a smaller image.

Reading a file as N bands (`data.channels` other than 3, or a declared `data.value_range`): an (H, W, N)
float32 array on the 0..255 scale of the 8-bit pipeline, so the per-batch normalisation is the same for every
depth and nothing is clipped or quantised on the way.

Sources: `.npy` arrays ((H, W), (H, W, N), or (N, H, W) when only the first axis holds N), TIFFs through
`tifffile` (any number of samples or pages as bands, any depth), everything else through PIL (grayscale stays
one band, 16-bit and float kept as they are, RGB(A) 3 (4) bands). Scaling: by `data.value_range` [low, high]
when declared, else by the sample type's range (uint16 by 65535, int16 from -32768 to 32767, ...); floats are
taken to lie in [0, 1]. A file whose band count is not `data.channels` is an ImageDecodeError naming what it
has and what is asked (skipped and counted like any unreadable file).

Hostile headers are refused before anything is decoded: a TIFF or array declaring more than MAX_BANDS bands,
more pixels than PIL accepts, or more than MAX_SAMPLES samples in all.

Data policies the training run applies: how many unreadable files a split may have, and what to
tell a user whose model waits for data."""
from __future__ import annotations

import io
import logging
import math
import os
import stat
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from imgcls.core.errors import BadDataError, ImageDecodeError

try:  # libjpeg-turbo straight into an array (requirements.txt); without it every JPEG goes through PIL
    import simplejpeg
except ImportError:  # pragma: no cover - the PIL path is the same pixels
    simplejpeg = None


IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm", ".npy")


BACKGROUND = (255, 255, 255)


_TRANSPOSED_ORIENTATIONS = {5, 6, 7, 8}


def is_image_file(path: str | Path) -> bool:
    return str(path).lower().endswith(IMAGE_EXTENSIONS)


def require_regular_file(path: str | Path) -> None:
    """ImageDecodeError unless `path` is a regular file (or a link to one): opening a FIFO blocks until a
    writer comes, and a device or socket is no image either. Bytes in memory (a shard's sample) pass."""
    if not isinstance(path, (str, os.PathLike)):
        return
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        raise ImageDecodeError(f"{path}: {type(err).__name__}: {err.strerror or err}") from err
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode) else "a special file"
        raise ImageDecodeError(f"{path}: not a regular file ({kind})")


def open_image(path, name=None) -> Image.Image:
    """Open lazily (header only): a path, or a file object whose messages say `name`. Raises ImageDecodeError
    for anything unreadable."""
    require_regular_file(path)
    try:
        return Image.open(path)
    except Exception as err:  # UnidentifiedImageError, OSError, DecompressionBomb*, ...
        # PIL names a file object by its repr ("cannot identify image file <_io.BytesIO ...>"): say the file
        message = str(err) if name is None else str(err).replace(repr(path), repr(str(name)))
        raise ImageDecodeError(f"{name or path}: {type(err).__name__}: {message}") from err


def orientation(img: Image.Image) -> int:
    """The EXIF orientation (1: upright; an unreadable tag counts as upright, as PIL's exif_transpose does)."""
    try:
        return img.getexif().get(0x0112, 1)
    except Exception:
        return 1


def oriented_size(img: Image.Image) -> tuple[int, int]:
    """(width, height) after the EXIF orientation is applied."""
    w, h = img.size
    return (h, w) if orientation(img) in _TRANSPOSED_ORIENTATIONS else (w, h)


def draft_scale(size: tuple[int, int], min_size: tuple[int, int]) -> int:
    """The reduction PIL's JPEG `draft` picks for `min_size`: the largest of 8, 4, 2, 1 that the whole
    multiples of `min_size` in `size` allow."""
    scale = min(size[0] // max(1, int(min_size[0])), size[1] // max(1, int(min_size[1])))
    return next((s for s in (8, 4, 2, 1) if scale >= s), 1)


def decode_plain_jpeg(img: Image.Image, buf, min_size: tuple[int, int] | None = None) -> np.ndarray | None:
    """[H, W, 3] uint8 of a plain JPEG (colour, upright) that PIL opened from the bytes `buf`, decoded by
    libjpeg-turbo straight into an array (simplejpeg) at the scale `decode_rgb`'s draft takes: the same pixels
    as `decode_rgb` for ~2/3 of its CPU time on photos (docs/performance.md, "JPEG decoding"). None where it
    does not apply (simplejpeg absent, another format or mode, an EXIF orientation, anything libjpeg-turbo
    reports, even a recoverable error): `decode_rgb` then decodes, or refuses, the file as before."""
    if simplejpeg is None or img.format != "JPEG" or img.mode != "RGB" or orientation(img) != 1:
        return None
    return decode_jpeg_array(buf, img.size, min_size)


# APP segments after which PIL may show a JPEG otherwise than its pixels are stored: an EXIF or XMP block (an
# orientation), a multi-picture index (PIL opens it as MPO)
_NOT_PLAIN_SEGMENTS = ((0xE1, b"Exif"), (0xE1, b"http://ns.adobe.com/xap/1.0/\x00"), (0xE2, b"MPF\x00"))


_STANDALONE_MARKERS = frozenset([0x01, 0xD8, *range(0xD0, 0xD8)])


def plain_jpeg_size(buf) -> tuple[int, int] | None:
    """(width, height) of a JPEG that PIL would open as a plain upright colour image (format JPEG, mode RGB,
    orientation 1), read from its header segments and libjpeg-turbo's header alone: no EXIF or XMP block, no
    multi-picture index, three colour components, within PIL's pixel limit. None for anything else, and
    wherever simplejpeg is absent: PIL then opens the file (its checks, its refusals). Opening with PIL to learn
    this cost ~6% of a training image's CPU (real-photo crops at 224 px)."""
    if simplejpeg is None or len(buf) < 4 or buf[0] != 0xFF or buf[1] != 0xD8:
        return None
    i, n = 2, len(buf)
    while i + 4 <= n:
        if buf[i] != 0xFF:
            return None
        marker = buf[i + 1]
        if marker == 0xFF or marker in _STANDALONE_MARKERS:
            i += 1 if marker == 0xFF else 2
            continue
        if marker == 0xDA:  # the scan: the header is over
            break
        end = i + 2 + ((buf[i + 2] << 8) | buf[i + 3])
        if any(marker == m and bytes(buf[i + 4:min(end, i + 4 + len(tag))]) == tag for m, tag in _NOT_PLAIN_SEGMENTS):
            return None
        i = end
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(buf)
    except (ValueError, OSError):
        return None
    limit = Image.MAX_IMAGE_PIXELS
    if colorspace not in ("YCbCr", "RGB") or width < 1 or height < 1 or (limit and width * height > limit):
        return None
    return width, height


def decode_jpeg_array(buf, size: tuple[int, int], min_size: tuple[int, int] | None = None) -> np.ndarray | None:
    """[H, W, 3] uint8 of the plain colour JPEG `buf` of `size` (width, height), decoded by libjpeg-turbo at the
    scale PIL's draft would take for `min_size`; None for anything libjpeg-turbo reports (even recoverable)."""
    scale = draft_scale(size, min_size) if min_size is not None else 1
    width, height = (size[0] + scale - 1) // scale, (size[1] + scale - 1) // scale
    try:
        array = simplejpeg.decode_jpeg(buf, colorspace="RGB", min_factor=scale, min_width=width,
                                       min_height=height, strict=True)
    except (ValueError, OSError):
        return None
    return array if array.shape == (height, width, 3) else None


def load_rgb(path: str | Path, min_size: tuple[int, int] | None = None) -> Image.Image:
    """Decode `path` as an 8-bit RGB image with the policy above.

    `min_size` (width, height in displayed orientation): the smallest size the caller needs; a JPEG
    may then be decoded at 1/2, 1/4 or 1/8 scale, never below it.
    """
    return decode_rgb(open_image(path), path, min_size)


def decode_rgb(img: Image.Image, name, min_size: tuple[int, int] | None = None) -> Image.Image:
    """`load_rgb` of an image `open_image` opened (errors name `name`)."""
    try:
        if min_size is not None and img.format == "JPEG":
            w, h = min_size
            if oriented_size(img) != img.size:
                w, h = h, w
            img.draft("RGB", (max(1, int(w)), max(1, int(h))))
        img.load()
        ImageOps.exif_transpose(img, in_place=True)  # in place: no copy of the whole image when upright
        return to_rgb(img)
    except ImageDecodeError as err:
        if str(err).startswith(f"{name}: "):
            raise
        raise ImageDecodeError(f"{name}: {err}") from err
    except Exception as err:
        raise ImageDecodeError(f"{name}: {type(err).__name__}: {err}") from err


def to_rgb(img: Image.Image) -> Image.Image:
    mode = img.mode
    if mode == "RGB":
        return img
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        return Image.fromarray(_wide_to_uint8(np.asarray(img), mode)).convert("RGB")
    if mode == "P":
        img = img.convert("RGBA") if "transparency" in img.info else img.convert("RGB")
        mode = img.mode
        if mode == "RGB":  # an opaque palette image is done here
            return img
    if mode in ("RGBA", "LA", "PA", "La", "RGBa"):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, BACKGROUND + (255,))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if mode == "L" and "transparency" in img.info:
        return to_rgb(img.convert("LA"))
    if mode in ("L", "1", "CMYK", "YCbCr", "LAB", "HSV", "RGBX"):
        return img.convert("RGB")
    raise ImageDecodeError(f"unsupported image mode {mode!r}")


def _wide_to_uint8(array: np.ndarray, mode: str) -> np.ndarray:
    array = array.astype(np.float64)
    if mode == "F":
        if array.size and not math.isfinite(float(array.min()) + float(array.max())):
            raise ImageDecodeError(not_finite(array))
        scale = 255.0 if array.size and array.max() <= 1.0 else 1.0
        return np.clip(array * scale, 0, 255).round().astype(np.uint8)
    if mode == "I" and array.size and array.max() <= 255 and array.min() >= 0:
        return array.astype(np.uint8)
    return np.clip(array / 257.0, 0, 255).round().astype(np.uint8)


# An image longer than this many times its short side is cut to that ratio around its centre before the eval
# resize: the work is bounded by the output size whatever the shape (a 400000x1 PNG of a few KB).
MAX_EVAL_ASPECT = 16


def centre_box(width: int, height: int, max_aspect: float = MAX_EVAL_ASPECT) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of the image's centre with its long side at most `max_aspect` times its
    short side: the whole image unless it is longer than that."""
    short = min(width, height)
    keep_w, keep_h = min(width, math.ceil(short * max_aspect)), min(height, math.ceil(short * max_aspect))
    left, top = (width - keep_w) // 2, (height - keep_h) // 2
    return left, top, left + keep_w, top + keep_h

NPY_MAGIC = b"\x93NUMPY"


TIFF_MAGICS = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")


MAX_BANDS = 1024


# PIL refuses images above twice its MAX_IMAGE_PIXELS as decompression bombs: the same bound here
MAX_PIXELS = 2 * (Image.MAX_IMAGE_PIXELS or 89_478_485)


MAX_SAMPLES = 1 << 28  # 1 GiB as float32


_NUMERIC_KINDS = "buif"


def is_npy(buf) -> bool:
    return bytes(buf[:6]) == NPY_MAGIC


def is_tiff(buf) -> bool:
    return bytes(buf[:4]) in TIFF_MAGICS


def read_bands(buf, name, channels: int, value_range=None) -> np.ndarray:
    """The file's bytes `buf` as an (H, W, channels) float32 array on the 0..255 scale (see the module)."""
    try:
        planes_first = False
        if is_npy(buf):
            array = _read_npy(buf, name)
        elif is_tiff(buf):
            array, planes_first = _read_tiff(buf, name)
        else:
            array = _read_pil(buf, name)
        scaled = scale_to_255(to_hwc(array, name, channels, planes_first), value_range)
        check_finite(scaled, array, name, value_range)
        return scaled
    except ImageDecodeError:
        raise
    except Exception as err:  # a corrupt header or payload, whatever the reader raises
        raise ImageDecodeError(f"{name}: {type(err).__name__}: {err}") from err


def check_shape(shape, name, bands_last=None) -> None:
    """ImageDecodeError for a declared shape that is too large to decode (before decoding). `bands_last`: the
    file says where its bands are (a TIFF's samples last, or its pages first); None: the shorter end axis."""
    dims = [int(d) for d in shape]
    if len(dims) < 2 or min(dims) < 0:
        raise ImageDecodeError(f"{name}: an image needs at least two axes, it has shape {tuple(dims)}")
    total = int(np.prod(dims, dtype=np.float64))
    if len(dims) == 2:
        bands = 1
    elif bands_last is None:
        bands = min(dims[0], dims[-1]) if len(dims) == 3 else int(np.prod(dims[:-2], dtype=np.float64))
    else:
        bands = dims[-1] if bands_last else int(np.prod(dims[:-2], dtype=np.float64))
    pixels = total // max(bands, 1)
    if bands > MAX_BANDS or pixels > MAX_PIXELS or total > MAX_SAMPLES:
        raise ImageDecodeError(f"{name}: refused before decoding: shape {tuple(dims)} declares {bands} band(s) of "
                               f"{pixels} pixels (at most {MAX_BANDS} bands, {MAX_PIXELS} pixels and "
                               f"{MAX_SAMPLES} samples)")


def _read_npy(buf, name) -> np.ndarray:
    stream = io.BytesIO(buf)
    version = np.lib.format.read_magic(stream)
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read_header(stream)  # the header only, no data
    if dtype.kind not in _NUMERIC_KINDS or dtype.hasobject:
        raise ImageDecodeError(f"{name}: a .npy of dtype {dtype} is not an image (numbers only)")
    check_shape(shape, name)
    stream.seek(0)
    return np.load(stream, allow_pickle=False)


def _read_tiff(buf, name) -> tuple[np.ndarray, bool]:
    """The first series' samples, and whether its bands come first (pages or planes: axes QYX, SYX, ...)."""
    import tifffile  # the N-band path only

    with tifffile.TiffFile(io.BytesIO(buf)) as tif:
        series = tif.series[0]
        check_shape(series.shape, name, bands_last=series.axes.endswith("S"))
        if series.dtype is None or np.dtype(series.dtype).kind not in _NUMERIC_KINDS:
            raise ImageDecodeError(f"{name}: TIFF samples of type {series.dtype} are not numbers")
        return series.asarray(), not series.axes.endswith("S")


def _read_pil(buf, name) -> np.ndarray:
    try:
        img = Image.open(io.BytesIO(buf))
        img.load()
    except Exception as err:
        raise ImageDecodeError(f"{name}: {type(err).__name__}: {err}") from err
    return pil_bands(img)


def pil_bands(img: Image.Image, in_place: bool = True) -> np.ndarray:
    """A loaded PIL image's samples as the N-band reading takes them: upright, palette and 1-bit expanded, other
    colour spaces as RGB, every other mode (grayscale, 16-bit, float, RGBA, CMYK) at its depth. `in_place`: the
    orientation may be applied to `img` itself (a caller's image: not)."""
    if in_place:
        ImageOps.exif_transpose(img, in_place=True)
    else:
        img = ImageOps.exif_transpose(img)
    if img.mode in ("P", "PA"):
        img = img.convert("RGBA" if "transparency" in img.info or img.mode == "PA" else "RGB")
    elif img.mode == "1":
        img = img.convert("L")
    elif img.mode in ("YCbCr", "LAB", "HSV"):
        img = img.convert("RGB")
    return np.asarray(img)


def to_hwc(array: np.ndarray, name, channels: int, planes_first: bool = False) -> np.ndarray:
    """(H, W) -> (H, W, 1); (H, W, N) as it is; (N, H, W) transposed when only its first axis holds
    `channels`, or when both do and the file says its planes come first (`planes_first`: a TIFF's pages).
    ImageDecodeError naming the bands found when they are not `channels`."""
    while array.ndim > 3 and array.shape[0] == 1:
        array = array[0]
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3:
        raise ImageDecodeError(f"{name}: shape {array.shape} is not an image ((H, W), (H, W, N) or (N, H, W))")
    if array.shape[0] == channels and (array.shape[2] != channels or planes_first):
        array = array.transpose(1, 2, 0)
    if array.shape[2] != channels:
        if planes_first and array.shape[0] <= array.shape[2]:
            array = array.transpose(1, 2, 0)  # say the bands the file stores as pages (the shorter end axis)
        raise ImageDecodeError(f"{name}: has {array.shape[2]} channel(s) (shape {array.shape}), data.channels asks "
                               f"{channels}")
    if min(array.shape[:2]) < 1:
        raise ImageDecodeError(f"{name}: an empty image (shape {array.shape})")
    return array


def scale_to_255(array: np.ndarray, value_range=None) -> np.ndarray:
    """float32 on the 0..255 scale: `value_range` [low, high] maps to [0, 255]; else uint8 as it is, other
    integers by their type's range, booleans 0/255, floats from [0, 1]. Nothing is clipped."""
    dtype = array.dtype
    if value_range is not None:
        low, high = float(value_range[0]), float(value_range[1])
    elif dtype.kind == "f":
        low, high = 0.0, 1.0
    elif dtype.kind == "b":
        low, high = 0.0, 1.0
    else:
        info = np.iinfo(dtype)
        low, high = float(info.min), float(info.max)
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow becomes inf, which check_finite refuses
        out = array.astype(np.float32)  # a copy: the in-place steps below never touch the caller's array
        if low:
            out -= np.float32(low)
        if high - low != 255.0:
            out *= np.float32(255.0 / (high - low))
    return out


def not_finite(original: np.ndarray) -> str:
    bad = int(original.size - np.count_nonzero(np.isfinite(original)))
    return f"{bad} of {original.size} samples are not finite (NaN or infinity): an image holds finite numbers"


# How far outside its declared range (data.value_range; [0, 1] for floats without one) a sample may lie, in widths
# of that range: a float file on the 0..255 scale still reads as [0, 1] (auto normalisation absorbs the scale), a
# value of 1e30, or floats on a 16-bit scale, are refused as a range the file is not on.
RANGE_SLACK = 256


# On the pipeline's 0..255 scale: the samples a file may hold
LOWEST_SAMPLE, HIGHEST_SAMPLE = -255.0 * RANGE_SLACK, 255.0 * (RANGE_SLACK + 1)


def check_finite(scaled: np.ndarray, original: np.ndarray, name="image", value_range=None) -> None:
    """ImageDecodeError when an image's samples (`scaled`, on the 0..255 scale; `original`, as the file holds
    them) are NaN or infinite, or lie more than RANGE_SLACK widths outside the declared range: such a file is a
    bad input, refused where it is read (skipped and counted), never a batch's or a run's failure. Two reductions
    (min, max) on an array already decoded; no copy."""
    if not scaled.size:
        return
    low, high = float(scaled.min()), float(scaled.max())  # NaN and inf propagate through both
    if math.isfinite(low) and math.isfinite(high) and LOWEST_SAMPLE <= low and high <= HIGHEST_SAMPLE:
        return
    declared = f"data.value_range={list(value_range)}" if value_range is not None else (
        "floats are taken to lie in [0, 1]; data.value_range declares another range" if original.dtype.kind == "f"
        else f"the {original.dtype} range")
    if original.dtype.kind == "f" and not np.isfinite(original).all():
        raise ImageDecodeError(f"{name}: {not_finite(original)}")
    raw_low, raw_high = float(original.min()), float(original.max())
    raise ImageDecodeError(f"{name}: samples from {raw_low:.6g} to {raw_high:.6g} lie more than {RANGE_SLACK} times "
                           f"its width outside the declared range ({declared}): not an image on that scale")


def first_band_view(array: np.ndarray) -> Image.Image:
    """An (H, W, N) band array's first band stretched from its own minimum to its maximum, as an 8-bit RGB image
    (a 16-bit band whose values span a few 8-bit steps keeps its structure): what the audit hashes and Grad-CAM
    overlays show for files that are not 8-bit RGB."""
    band = array[..., 0].astype(np.float32)
    low, high = float(band.min()), float(band.max())
    stretched = (band - low) * (255.0 / (high - low)) if high > low else np.zeros_like(band)
    return Image.fromarray(np.clip(stretched.round(), 0, 255).astype(np.uint8), "L").convert("RGB")

log = logging.getLogger(__name__)


# Above this share of a logging interval spent waiting for batches, the run says once what to change.
DATA_WAIT_WARN_FRAC = 0.2


def check_bad_fraction(files: list[str], total: int, split: str, limit: float) -> None:
    """BadDataError (exit 1, listing the files) when more than `limit` of a split's `total` files are unreadable."""
    if total and len(files) / total > limit:
        listing = "\n  ".join(files[:20]) + ("\n  ..." if len(files) > 20 else "")
        raise BadDataError(f"{len(files)} of {total} {split} files could not be read, more than "
                           f"data.max_bad_fraction={limit}:\n  {listing}")


def check_validation_files(unreadable: list[str], total: int, evaluated: int, limit: float) -> None:
    """After a validation pass: name the files left out, stop (BadDataError, exit 1) above `limit` of the split
    or when not one image was evaluated (nothing to compare, no best.pt)."""
    if unreadable:
        log.warning("%d validation file(s) could not be read and were left out: %s", len(unreadable),
                    ", ".join(unreadable[:10]))
        check_bad_fraction(unreadable, total, "validation", limit)
    if evaluated == 0:
        raise BadDataError(f"validation evaluated no image: none of the {len(unreadable)} validation files it read "
                           f"could be decoded, so there is nothing to compare and no best.pt")


def data_wait_advice(wait_frac: float, num_workers: int, cores: int, prefetch_factor: int) -> str:
    return (f"the model waited for data {100 * wait_frac:.0f}% of the time: the input pipeline is the bottleneck. "
            f"Try more loader workers (data.num_workers, now {num_workers}; this machine has {cores} cores), a "
            f"deeper prefetch (data.prefetch_factor, now {prefetch_factor}), pinned memory on CUDA "
            f"(data.pin_memory), a smaller data.img_size, or images stored as JPEGs near the training size "
            f"(decoding the full-size file is most of the cost). `benchmark.py --mode loader` times the "
            f"pipeline alone")
