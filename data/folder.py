"""Class-folder trees: `<root>/<split>/<class>/.../<image>`.

Hidden entries (names starting with '.') are skipped; files without an image extension are ignored;
classes are the sorted sub-folder names.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from data.images import is_image_file


class DataTreeError(Exception):
    """A data tree that cannot be used as it is (exit 2)."""


@dataclass
class ImageFolderIndex:
    root: Path
    classes: list[str]
    paths: list[str]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.paths)

    def class_counts(self) -> list[int]:
        counts = [0] * len(self.classes)
        for label in self.labels:
            counts[label] += 1
        return counts


def list_images(folder: Path) -> list[str]:
    """Image files under `folder`, recursively, hidden entries skipped, in a stable order."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found.extend(os.path.join(dirpath, f) for f in sorted(filenames)
                     if not f.startswith(".") and is_image_file(f))
    return found


def scan_split(split_dir: Path, classes: list[str] | None = None) -> ImageFolderIndex:
    split_dir = Path(split_dir)
    if not split_dir.is_dir():
        raise DataTreeError(f"split folder {split_dir} does not exist")
    found = sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith("."))
    if not found:
        raise DataTreeError(f"{split_dir} holds no class folders (expected one sub-folder per class)")
    if classes is not None and found != classes:
        missing = sorted(set(classes) - set(found))
        extra = sorted(set(found) - set(classes))
        raise DataTreeError(f"{split_dir}: its classes differ from the training classes; "
                            f"missing here: {missing or 'none'}; not in training: {extra or 'none'}")
    paths, labels, empty = [], [], []
    for label, name in enumerate(found):
        images = list_images(split_dir / name)
        if not images:
            empty.append(name)
        paths.extend(images)
        labels.extend([label] * len(images))
    if empty:
        raise DataTreeError(f"{split_dir}: class folder(s) with no image files: {', '.join(empty)}")
    return ImageFolderIndex(split_dir, found, paths, labels)
