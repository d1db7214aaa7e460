"""Class-folder trees: `<root>/<split>/<class>/.../<image>`.

Hidden entries (names starting with '.') are skipped; files without an image extension are ignored;
classes are the sorted sub-folder names. Symbolic links are followed, but each real folder and file is read
once and never one outside the class folder (a loop or a link to another class would repeat or relabel
images; a link to a file elsewhere is left out like a link to a folder elsewhere); only regular files are images (a FIFO named .jpg would block its reader). What is left out for
those reasons is listed in the log.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import logging

from imgcls.core.errors import DataTreeError
from imgcls.data.images import is_image_file

log = logging.getLogger(__name__)


@dataclass
class ImageIndex:
    root: Path
    classes: list[str]
    paths: list[str]
    labels: list[int]
    skipped: list[str] = field(default_factory=list)  # "path (reason)" of links and special files left out

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def files(self) -> list[str]:
        """The files on disk the index reads (what no command may write over)."""
        return self.paths

    @property
    def image_paths(self) -> Optional[list[str]]:
        """One image file per sample, in sample order (what int8 calibration reads)."""
        return self.paths

    def class_counts(self) -> list[int]:
        counts = [0] * len(self.classes)
        for label in self.labels:
            counts[label] += 1
        return counts

    def target(self, label):
        """What the datasets return for a label: the class position itself (a multi-hot vector in TagIndex)."""
        return label

    def label_name(self, label) -> str:
        return self.classes[label]


def _special_file_kind(path: str) -> str:
    """Why an image-named entry that is not a regular file is left out."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "a broken link"
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device")):
        if test(mode):
            return kind
    return "not a regular file"


def _inside(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip(os.sep) + os.sep)


def _file_left_out(entry: os.DirEntry, path: str, top: str | None, folder, read_files: set) -> str | None:
    """Why an image-named entry is not an image of this class folder, or None. Links to files are treated as
    links to folders: one whose target lies outside the class folder (another class, outside the tree) is
    left out, and a file already read under another name (a link, a hard link) is read once."""
    if not entry.is_file():
        return _special_file_kind(path)
    if top is not None and entry.is_symlink() and not _inside(os.path.realpath(path), top):
        return f"a link to a file outside {folder}"
    info = entry.stat()
    if (info.st_dev, info.st_ino) in read_files:
        return "a second name of a file already read"
    read_files.add((info.st_dev, info.st_ino))
    return None


def list_images(folder: Path, skipped: list[str] | None = None, file_links_out: bool = False) -> list[str]:
    """Image files under `folder`, recursively, hidden entries skipped, in a stable order (that of
    `os.walk(folder, followlinks=True)` with sorted names).

    Links are followed, but a real folder or file (device, inode) is read once, and a link to a folder or a
    file outside `folder`'s real path is not followed; image-named entries that are not regular files (FIFOs, sockets,
    devices, broken links) are left out. `file_links_out`: links to files elsewhere are followed (infer.py's
    inputs, which carry no class). Each entry left out is appended to `skipped` as "path (reason)"."""
    skipped = [] if skipped is None else skipped
    top = os.path.realpath(folder)
    seen: set[tuple[int, int]] = set()
    read_files: set[tuple[int, int]] = set()
    found: list[str] = []
    stack = [str(folder)]
    while stack:
        dirpath = stack.pop()
        try:
            info = os.stat(dirpath)
            if (info.st_dev, info.st_ino) in seen:
                skipped.append(f"{dirpath} (a link to a folder already read)")
                continue
            seen.add((info.st_dev, info.st_ino))
            with os.scandir(dirpath) as listing:
                entries = sorted((e for e in listing if not e.name.startswith(".")), key=lambda e: e.name)
        except OSError as err:
            skipped.append(f"{dirpath} (cannot be read: {err.strerror or type(err).__name__})")
            continue
        subdirs = []
        for entry in entries:
            path = os.path.join(dirpath, entry.name)
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            if is_dir:
                if entry.is_symlink() and not _inside(os.path.realpath(path), top):
                    skipped.append(f"{path} (a link to a folder outside {folder})")
                else:
                    subdirs.append(path)
            elif is_image_file(entry.name):
                why = _file_left_out(entry, path, None if file_links_out else top, folder, read_files)
                if why:
                    skipped.append(f"{path} ({why})")
                else:
                    found.append(path)
        stack.extend(reversed(subdirs))
    return found


def report_skipped(where, skipped: list[str]) -> None:
    """One warning naming what a scan left out (the first 10 entries)."""
    if skipped:
        log.warning("%s: %d entr%s left out: %s%s", where, len(skipped), "y" if len(skipped) == 1 else "ies",
                    "; ".join(skipped[:10]), "; ..." if len(skipped) > 10 else "")


def scan_split(split_dir: Path, classes: list[str] | None = None) -> ImageIndex:
    split_dir = Path(split_dir)
    if not split_dir.is_dir():
        raise DataTreeError(f"split folder {split_dir} does not exist")
    found = sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith("."))
    if not found:
        raise DataTreeError(f"{split_dir} holds no class folders (expected one sub-folder per class)")
    if classes is not None and found != classes:
        raise DataTreeError(class_difference(split_dir, found, classes, "the training classes", "training"))
    paths, labels, empty, skipped = [], [], [], []
    for label, name in enumerate(found):
        images = list_images(split_dir / name, skipped)
        if not images:
            empty.append(name)
        paths.extend(images)
        labels.extend([label] * len(images))
    report_skipped(split_dir, skipped)
    if empty:
        raise DataTreeError(f"{split_dir}: class folder(s) with no image files: {', '.join(empty)}")
    return ImageIndex(split_dir, found, paths, labels, skipped)


def class_difference(where, found: list[str], wanted: list[str], wanted_name: str, wanted_short: str) -> str:
    """The message for a split whose class folders are not the `wanted` ones."""
    missing = sorted(set(wanted) - set(found))
    extra = sorted(set(found) - set(wanted))
    return (f"{where}: its class folders differ from {wanted_name}; missing here: {missing or 'none'}; "
            f"not in {wanted_short}: {extra or 'none'}")


def match_classes(index: ImageIndex, classes: list[str], wanted_name: str = "the checkpoint's classes",
                  wanted_short: str = "the checkpoint") -> ImageIndex:
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
    return ImageIndex(index.root, list(classes), list(index.paths), [remap[label] for label in index.labels],
                            list(index.skipped))
