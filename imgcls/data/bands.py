"""Reading a file as N bands (`data.channels` other than 3, or a declared `data.value_range`): an (H, W, N)
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
"""
from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageOps

from imgcls.core.errors import ImageDecodeError

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
        return scale_to_255(to_hwc(array, name, channels, planes_first), value_range)
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
    ImageOps.exif_transpose(img, in_place=True)
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
        if planes_first:
            array = array.transpose(1, 2, 0)  # say the bands the file stores as pages
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
    out = array.astype(np.float32)  # a copy: the in-place steps below never touch the caller's array
    if low:
        out -= np.float32(low)
    if high - low != 255.0:
        out *= np.float32(255.0 / (high - low))
    return out


def first_band_view(array: np.ndarray) -> Image.Image:
    """An (H, W, N) band array's first band stretched from its own minimum to its maximum, as an 8-bit RGB image
    (a 16-bit band whose values span a few 8-bit steps keeps its structure): what the audit hashes and Grad-CAM
    overlays show for files that are not 8-bit RGB."""
    band = array[..., 0].astype(np.float32)
    low, high = float(band.min()), float(band.max())
    stretched = (band - low) * (255.0 / (high - low)) if high > low else np.zeros_like(band)
    return Image.fromarray(np.clip(stretched.round(), 0, 255).astype(np.uint8), "L").convert("RGB")
