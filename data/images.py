"""Reading an image file into an RGB PIL image, the same way in training, evaluation and inference.

Policy: EXIF orientation applied; 16-bit and 32-bit grayscale scaled to 8 bits (PIL's own
`convert('RGB')` clips them to white); alpha (RGBA, LA, PA, palette transparency) composited on a
white background; CMYK and YCbCr converted; JPEGs may be decoded at a reduced size (`draft`) when
the caller only needs a smaller image.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from PIL import Image, ImageOps

from core.errors import ImageDecodeError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm")
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


def oriented_size(img: Image.Image) -> tuple[int, int]:
    """(width, height) after the EXIF orientation is applied."""
    w, h = img.size
    try:
        orientation = img.getexif().get(0x0112, 1)
    except Exception:
        orientation = 1
    return (h, w) if orientation in _TRANSPOSED_ORIENTATIONS else (w, h)


def load_rgb(path: str | Path, min_size: tuple[int, int] | None = None) -> Image.Image:
    """Decode `path` as an 8-bit RGB image with the policy above.

    `min_size` (width, height in displayed orientation): the smallest size the caller needs; a JPEG
    may then be decoded at 1/2, 1/4 or 1/8 scale, never below it.
    """
    return decode_rgb(open_image(path), path, min_size)


def draft_reduces(need: tuple[int, int], size: tuple[int, int]) -> bool:
    """Whether PIL's JPEG draft mode can decode at 1/4 scale or less and still keep `need` pixels.

    At 1/2 scale the draft decode saves too little (the entropy decoding is the same) to pay for PIL's own
    per-file costs (a second header parse, chunked reads, an RGBX copy): on ImageNet-sized photos the full
    tensor decode was 4-7% faster per image; from 1/4 scale on the draft wins."""
    return 4 * need[0] <= size[0] and 4 * need[1] <= size[1]


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
    except ImageDecodeError:
        raise
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
        scale = 255.0 if array.size and array.max() <= 1.0 else 1.0
        return np.clip(array * scale, 0, 255).round().astype(np.uint8)
    if mode == "I" and array.size and array.max() <= 255 and array.min() >= 0:
        return array.astype(np.uint8)
    return np.clip(array / 257.0, 0, 255).round().astype(np.uint8)


# ---------------------------------------------------------------- JPEG headers without PIL

# Start-of-frame markers (baseline, extended, progressive, lossless; Huffman or arithmetic coded).
_SOF_MARKERS = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_STANDALONE_MARKERS = frozenset({0x01, *range(0xD0, 0xD8)})  # no length field
_EXIF_ID = b"Exif\0\0"
_XMP_ID = b"http://ns.adobe.com/xap/1.0/\0"


@dataclass(frozen=True)
class JpegHeader:
    width: int
    height: int
    components: int      # 1 grayscale, 3 YCbCr/RGB, 4 CMYK/YCCK
    orientation: int     # EXIF orientation, 1 (upright) when absent

    @property
    def oriented_size(self) -> tuple[int, int]:
        """(width, height) after the EXIF orientation is applied, as `oriented_size` gives for a PIL image."""
        return (self.height, self.width) if self.orientation in _TRANSPOSED_ORIENTATIONS else (self.width, self.height)


def parse_jpeg_header(buf) -> Optional[JpegHeader]:
    """Frame size, component count and EXIF orientation read from a JPEG's marker segments (bytes or a uint8
    memoryview), without decoding pixels: a tenth of the cost of opening the file with PIL.

    Returns None whenever PIL should decide instead: not a JPEG, a malformed or truncated segment list, no frame
    header before the first scan, an orientation that only XMP carries (PIL reads it, libjpeg-based decoders
    do not) or an EXIF block this parser does not follow.
    """
    n = len(buf)
    if n < 4 or buf[0] != 0xFF or buf[1] != 0xD8:
        return None
    pos, frame, orientation, xmp_orientation = 2, None, None, False
    while pos + 4 <= n:
        if buf[pos] != 0xFF:
            return None
        marker = buf[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if marker in _STANDALONE_MARKERS:
            pos += 2
            continue
        start, end = pos + 4, pos + 2 + ((buf[pos + 2] << 8) | buf[pos + 3])
        if end < start or end > n:
            return None
        if marker == 0xDA:  # start of scan: every header segment has been seen
            break
        if marker in _SOF_MARKERS:
            if frame is not None or end - start < 6:
                return None
            frame = (_u16(buf, start + 3, True), _u16(buf, start + 1, True), buf[start + 5])
        elif marker == 0xE1 and orientation is None and bytes(buf[start:start + 6]) == _EXIF_ID:
            orientation = _exif_orientation(bytes(buf[start + 6:end]))
            if orientation is None:
                return None
        elif marker == 0xE1 and bytes(buf[start:start + len(_XMP_ID)]) == _XMP_ID:
            xmp_orientation = b"tiff:Orientation" in bytes(buf[start:end])
        pos = end
    else:
        return None
    if frame is None or frame[0] == 0 or frame[1] == 0 or (xmp_orientation and not orientation):
        return None  # (PIL takes XMP's orientation when EXIF has none)
    return JpegHeader(frame[0], frame[1], frame[2], orientation or 1)


def _u16(buf, at: int, big_endian: bool) -> int:
    return (buf[at] << 8 | buf[at + 1]) if big_endian else (buf[at + 1] << 8 | buf[at])


def _u32(buf, at: int, big_endian: bool) -> int:
    hi, lo = _u16(buf, at, big_endian), _u16(buf, at + 2, big_endian)
    return (hi << 16 | lo) if big_endian else (lo << 16 | hi)


def _exif_orientation(tiff: bytes) -> Optional[int]:
    """The orientation tag (0x0112) of a TIFF block's first IFD: 0 when absent, 1 when out of range (PIL and
    libjpeg decoders then leave the image as stored), None when the block is malformed or stores it unusually."""
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return None
    big = tiff[:2] == b"MM"
    ifd = _u32(tiff, 4, big)
    if ifd + 2 > len(tiff):
        return None
    for entry in range(ifd + 2, ifd + 2 + 12 * _u16(tiff, ifd, big), 12):
        if entry + 12 > len(tiff):
            return None
        if _u16(tiff, entry, big) == 0x0112:
            if _u16(tiff, entry + 2, big) != 3 or _u32(tiff, entry + 4, big) != 1:  # one SHORT
                return None
            value = _u16(tiff, entry + 8, big)
            return value if 1 <= value <= 8 else 1
    return 0
