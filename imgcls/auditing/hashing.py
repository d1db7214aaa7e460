"""Per-image facts for the audit, computed in DataLoader workers: the SHA-256 of the file's bytes (exact
copies), a 64-bit perceptual hash (imagehash's pHash of the image decoded exactly as training decodes it:
EXIF orientation, 16-bit and alpha handling, by `data.images`), a 32x32 grayscale thumbnail that confirms
near matches pixel by pixel (auditing.pixel_match), and the stored size, mode and format.

A file that cannot be opened or decoded gets its reason instead (the message training would log).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

import imagehash
from torch.utils.data import DataLoader, Dataset

from imgcls.data.file_list import describe_failure
from imgcls.auditing.colour import chroma
from imgcls.auditing.pixel_match import reencode_score, thumbnail
from imgcls.data.bands import first_band_view, is_npy, is_tiff, read_bands
from imgcls.data.images import ImageDecodeError, decode_rgb, open_image, oriented_size
from imgcls.data.transforms import read_file_bytes, reads_bands


@dataclass
class ImageFacts:
    sha256: str = ""
    phash: int = 0          # 64 bits, imagehash.phash (8x8 DCT signs of a 32x32 grayscale)
    width: int = 0          # displayed (EXIF orientation applied)
    height: int = 0
    mode: str = ""          # as stored ('RGB', 'L', 'RGBA', 'I;16', ...)
    format: str = ""
    error: Optional[str] = None
    thumb: bytes = b""      # auditing.pixel_match.thumbnail: confirms a pHash candidate pixel by pixel
    reencode: float = 1.0   # auditing.pixel_match.reencode_score: what a harmless copy of it scores
    chroma: float = 0.0     # auditing.colour.chroma: 0 for a grayscale image, however stored


def image_facts(path: str, channels: int = 3, value_range=None) -> ImageFacts:
    if reads_bands(channels, value_range):
        return band_facts(path, channels, value_range)
    try:
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        img = open_image(path)
        mode, fmt, (width, height) = img.mode, img.format or "", oriented_size(img)
        rgb = decode_rgb(img, path)
    except (ImageDecodeError, OSError) as err:
        return ImageFacts(error=describe_failure(path, err))
    return ImageFacts(digest, int(str(imagehash.phash(rgb)), 16), width, height, mode, fmt, thumb=thumbnail(rgb),
                      reencode=reencode_score(rgb), chroma=chroma(rgb))


def hash_view_words(channels: int, value_range) -> str:
    """What the perceptual hashes and thumbnails are computed on, for the report."""
    if not reads_bands(channels, value_range):
        return "the image as training decodes it (8-bit RGB)"
    return (f"the first of {channels} band(s), stretched from its own minimum to its maximum (data.channels="
            f"{channels}): near copies are judged on that band alone")


def band_facts(path: str, channels: int, value_range) -> ImageFacts:
    """`image_facts` of a file read as N bands: its first band, stretched to 8 bits between its own extremes
    (so a 16-bit band whose values span a few 8-bit steps still has structure to hash), as a grayscale image."""
    try:
        name, buf = read_file_bytes(path)
        digest = hashlib.sha256(buf).hexdigest()
        array = read_bands(buf, name, channels, value_range)
    except (ImageDecodeError, OSError) as err:
        return ImageFacts(error=describe_failure(path, err))
    view = first_band_view(array)
    fmt = "NPY" if is_npy(buf) else "TIFF" if is_tiff(buf) else ""
    return ImageFacts(digest, int(str(imagehash.phash(view)), 16), array.shape[1], array.shape[0],
                      f"{channels} band(s)", fmt, thumb=thumbnail(view), reencode=reencode_score(view))


class FactsDataset(Dataset):
    def __init__(self, files: list[str], channels: int = 3, value_range=None):
        self.files = files
        self.channels, self.value_range = channels, value_range

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> ImageFacts:
        return image_facts(self.files[i], self.channels, self.value_range)


def _as_list(batch):
    return batch


def compute_facts(files: list[str], num_workers: int, progress=None, channels: int = 3,
                  value_range=None) -> list[ImageFacts]:
    """`image_facts` of every file, in order, `num_workers` loader processes decoding in parallel;
    `progress(n)` is called with the number of files done in each batch."""
    batch = 32
    loader = DataLoader(FactsDataset(files, channels, value_range), batch_size=batch, shuffle=False,
                        collate_fn=_as_list,
                        num_workers=num_workers if len(files) > batch else 0,
                        prefetch_factor=4 if num_workers and len(files) > batch else None)
    out: list[ImageFacts] = []
    for facts in loader:
        out.extend(facts)
        if progress is not None:
            progress(len(facts))
    return out
