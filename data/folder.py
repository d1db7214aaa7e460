"""Class-folder trees: `<root>/<split>/<class>/.../<image>`.

Hidden entries (names starting with '.') are skipped; files without an image extension are ignored;
classes are the sorted sub-folder names.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import logging

from core.errors import DataTreeError
from data.images import is_image_file

log = logging.getLogger("train")


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
        raise DataTreeError(class_difference(split_dir, found, classes, "the training classes", "training"))
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


def class_difference(where, found: list[str], wanted: list[str], wanted_name: str, wanted_short: str) -> str:
    """The message for a split whose class folders are not the `wanted` ones."""
    missing = sorted(set(wanted) - set(found))
    extra = sorted(set(found) - set(wanted))
    return (f"{where}: its class folders differ from {wanted_name}; missing here: {missing or 'none'}; "
            f"not in {wanted_short}: {extra or 'none'}")


def match_classes(index: ImageFolderIndex, classes: list[str], wanted_name: str = "the checkpoint's classes",
                  wanted_short: str = "the checkpoint") -> ImageFolderIndex:
    """Relabel a scanned split so that label i means `classes[i]` (a model's order).

    The folder must hold exactly those class names; the same names in another order are remapped, any
    difference is a DataTreeError (exit 2) that lists it."""
    if set(index.classes) != set(classes):
        raise DataTreeError(class_difference(index.root, index.classes, classes, wanted_name, wanted_short))
    if index.classes == classes:
        return index
    position = {name: i for i, name in enumerate(classes)}
    remap = [position[name] for name in index.classes]
    log.info("class folders are in another order than %s; labels remapped by name", wanted_name)
    return ImageFolderIndex(index.root, list(classes), list(index.paths), [remap[label] for label in index.labels])
