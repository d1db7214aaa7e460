"""Class-folder trees: `<root>/<split>/<class>/.../<image>`.

Hidden entries (names starting with '.') are skipped; files without an image extension are ignored;
classes are the sorted sub-folder names. Symbolic links are followed, but each real folder and file is read
once and never one outside the class folder (a loop or a link to another class would repeat or relabel
images; a link to a file elsewhere is left out like a link to a folder elsewhere); only regular files are images (a FIFO named .jpg would block its reader). What is left out for
those reasons is listed in the log.

CSV file lists (`data.format: csv`): a header row, one row per image, a path column and a label column
holding class names. Relative paths resolve against a base folder (`data.root`, or the CSV's own folder).

Every mistake in the file is a DataTreeError (exit 2) naming the file and its line or column; rows whose
image file does not exist are returned apart so the caller can list, count and limit them.

A stratified, seeded hold-out split of one labelled index (`data.val_fraction`, `data.split_seed`).

The split is a pure function of the files' paths relative to the data root, their labels, the fraction
and the seed: each class's files are ordered by a SHA-256 of (seed, relative path) and the first
round(n x fraction) of them are held out. No Python `hash()` (salted per process) and no RNG whose
stream could change between library versions, so every machine and run gets the same split, and adding
a file to one class never moves files of another.

Small real data sets that ship inside a registry package, written out as class-folder trees.

`digits`: scikit-learn's 1,797 handwritten digits (8x8 grayscale, 10 classes), every fifth image of
each class held out for validation. Nothing is downloaded.

A split's fingerprint, which `--resume` compares to know the run reads the files it was trained on.

{"files": N, "classes": {name: count}, "digest": sha256 of the sorted (path relative to the split folder,
size in bytes)}. Paths are relative, so the same files under another `data.root` match; a file added,
removed, renamed or rewritten with another size does not."""
from __future__ import annotations

import csv
import hashlib
import logging
import math
import os
import shutil
import stat
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
from PIL import Image

from imgcls.core.errors import DataTreeError
from imgcls.core.files import not_a_regular_file
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


@dataclass
class CsvRow:
    line: int      # the row's line number in the file (the header is line 1)
    path: str      # as written in the file
    label: str


def read_class_list(path: str | Path) -> list[str]:
    """`data.classes`: one class name per line, in label order; blank lines are ignored."""
    problem = not_a_regular_file(path)
    if problem:
        raise DataTreeError(f"'data.classes' = {path}: {problem}; it must name a regular file")
    try:
        names = [line.strip() for line in Path(path).read_text(encoding="utf-8-sig").splitlines()]
    except OSError as err:
        raise DataTreeError(f"'data.classes' = {path}: cannot read it: {err}") from err
    names = [n for n in names if n]
    if not names:
        raise DataTreeError(f"'data.classes' = {path}: the file holds no class names (one name per line)")
    seen = set()
    for n in names:
        if n in seen:
            raise DataTreeError(f"'data.classes' = {path}: class '{n}' is listed twice")
        seen.add(n)
    return names


def read_csv_rows(csv_path: str | Path, path_column: str, label_column: str | None,
                  allow_empty_label: bool = False) -> list[CsvRow]:
    """The rows of a CSV list, checked: the file exists and has a header naming both columns, and every row
    has a path and a label (without `label_column`: paths only, labels ''; `allow_empty_label`: a
    multi-label list, where an empty tag field is an all-negative image)."""
    csv_path = Path(csv_path)
    problem = not_a_regular_file(csv_path)
    if problem:
        raise DataTreeError(f"CSV list {csv_path}: {problem}; it must name a regular file")
    try:
        f = open(csv_path, newline="", encoding="utf-8-sig")  # utf-8-sig: spreadsheet exports start with a BOM
    except OSError as err:
        raise DataTreeError(f"CSV list {csv_path}: cannot open it: {err}") from err
    with f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header:
            raise DataTreeError(f"CSV list {csv_path} is empty: expected a header row naming the columns "
                                f"'{path_column}' and '{label_column}'")
        header = [name.strip() for name in header]
        for key, column in (("data.csv_path_column", path_column), ("data.csv_label_column", label_column)):
            if column is not None and column not in header:
                raise DataTreeError(f"CSV list {csv_path}: no column '{column}' ({key}); the header has: "
                                    f"{', '.join(header)}")
        at_path = header.index(path_column)
        at_label = header.index(label_column) if label_column is not None else at_path
        rows = []
        for fields in reader:
            if not any(field.strip() for field in fields):
                continue  # blank line
            line = reader.line_num
            if len(fields) != len(header):
                raise DataTreeError(f"CSV list {csv_path} line {line}: {len(fields)} field(s), the header has "
                                    f"{len(header)}" + (" (a path or label holding a comma must be quoted: "
                                                        "\"a/x,y.jpg\")" if len(fields) > len(header) else ""))
            path = fields[at_path].strip()
            label = fields[at_label].strip() if label_column is not None else ""
            if not path or (label_column is not None and not label and not allow_empty_label):
                empty = path_column if not path else label_column
                raise DataTreeError(f"CSV list {csv_path} line {line}: empty '{empty}'")
            rows.append(CsvRow(line, path, label))
    if not rows:
        raise DataTreeError(f"CSV list {csv_path} has a header but no rows")
    return rows


def csv_index(csv_path: str | Path, base: Path, rows: list[CsvRow], classes: list[str], known_as: str
              ) -> tuple[ImageIndex, list[str]]:
    """(the index of the rows whose file exists, the resolved paths of those that do not). A label outside
    `classes` is a DataTreeError naming the row; `known_as` says what the classes are ('training classes')."""
    position = {name: i for i, name in enumerate(classes)}
    paths, labels, missing = [], [], []
    warn_odd_rows(csv_path, base, rows)
    for row in rows:
        if row.label not in position:
            shown = ", ".join(classes[:20]) + (", ..." if len(classes) > 20 else "")
            raise DataTreeError(f"CSV list {csv_path} line {row.line}: label '{row.label}' is not one of the "
                                f"{known_as} ({shown})")
        path = row.path if os.path.isabs(row.path) else str(Path(base) / row.path)
        if not os.path.isfile(path):
            missing.append(path)
            continue
        paths.append(path)
        labels.append(position[row.label])
    return ImageIndex(Path(base), list(classes), paths, labels), missing


def warn_odd_rows(csv_path, base: Path, rows: list[CsvRow]) -> None:
    """One warning each, with the count and the first line: rows whose path leaves `base` (absolute, or `..`
    out of it; used as written, since lists made elsewhere often hold absolute paths), and rows naming a
    path already listed (each is trained on as often as it is listed)."""
    top = os.path.normpath(os.path.abspath(base))
    outside = [row for row in rows if not _inside(os.path.normpath(os.path.join(top, row.path)), top)]
    if outside:
        log.warning("CSV list %s: %d row(s) name files outside %s (absolute or '..' paths), used as written; "
                    "first: line %d '%s'", csv_path, len(outside), base, outside[0].line, outside[0].path)
    seen: dict[str, int] = {}
    repeated = []
    for row in rows:
        key = os.path.normpath(os.path.join(top, row.path))
        if key in seen:
            repeated.append((row, seen[key]))
        seen.setdefault(key, row.line)
    if repeated:
        row, first = repeated[0]
        log.warning("CSV list %s: %d row(s) repeat a path listed before (each copy counts as a sample); first: "
                    "line %d '%s' (also line %d)", csv_path, len(repeated), row.line, row.path, first)


def check_no_empty_classes(csv_path, index: ImageIndex, missing: list[str]) -> None:
    """DataTreeError naming the classes with no existing file in a training list (as the folder format
    refuses an empty class folder): a class of rows whose files are all missing is no class to learn."""
    empty = [name for name, n in zip(index.classes, index.class_counts()) if n == 0]
    if empty:
        raise DataTreeError(f"CSV list {csv_path}: class(es) with no existing image file: {', '.join(empty[:20])}"
                            + (f" ({len(missing)} row(s) name files that do not exist)" if missing else "")
                            + "; fix the paths or drop those rows (or those names from data.classes)")


def csv_paths(csv_path: str | Path, path_column: str = "path") -> list[str]:
    """The image paths a CSV list names (relative ones resolved against the CSV's folder), in row order."""
    base = Path(csv_path).parent
    return [row.path if os.path.isabs(row.path) else str(base / row.path)
            for row in read_csv_rows(csv_path, path_column, None)]


def relative_key(path: str, base: Path) -> str:
    """The machine-independent name of a file: its path under `base`, with '/' separators."""
    return Path(os.path.relpath(path, base)).as_posix()


def held_out_count(n: int, fraction: float) -> int:
    """How many of a class's `n` files go to validation: round(n x fraction) (halves up), at least one on each
    side where the class has two or more, none where it has one."""
    if n < 2:
        return 0
    return max(1, min(n - 1, math.floor(n * fraction + 0.5)))


def split_positions(keys: list[str], labels: list[int], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(training positions, validation positions) into `keys`, each in the input order."""
    by_class: dict[int, list[int]] = {}
    for position, label in enumerate(labels):
        by_class.setdefault(label, []).append(position)
    held_out: set[int] = set()
    for members in by_class.values():
        ranked = sorted(members, key=lambda p: hashlib.sha256(f"{seed}\0{keys[p]}".encode()).digest())
        held_out.update(ranked[:held_out_count(len(members), fraction)])
    train = [p for p in range(len(keys)) if p not in held_out]
    return train, sorted(held_out)


@dataclass
class SplitRecord:
    """The split as it goes into the checkpoint and the run directory: relative paths and labels per side."""

    val_fraction: float
    split_seed: int
    train: list[str]
    train_labels: list[int]
    val: list[str]
    val_labels: list[int]

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def check_split_sides(train: list, val: list, fraction: float) -> None:
    """DataTreeError (exit 2, before training) when a hold-out split leaves either side empty."""
    if not train or not val:
        empty = "validation" if not val else "training"
        raise DataTreeError(f"data.val_fraction={fraction}: the split of {len(train) + len(val)} image(s) leaves "
                            f"the {empty} side empty; use more images, another data.val_fraction, or a "
                            f"validation list (data.val_csv)")


def split_index(index: ImageIndex, base: Path, fraction: float, seed: int
                ) -> tuple[ImageIndex, ImageIndex, SplitRecord]:
    """Split `index` (paths under `base`) into training and validation indexes and their record. A class with
    a single file stays in training, named in a warning; a side left empty is a DataTreeError."""
    keys = [relative_key(p, base) for p in index.paths]
    train, val = split_positions(keys, index.labels, fraction, seed)
    check_split_sides(train, val, fraction)
    singles = [name for name, n in zip(index.classes, index.class_counts()) if n == 1]
    if singles:
        log.warning("data.val_fraction: %d class(es) have a single image, kept for training and absent from "
                    "validation: %s", len(singles), ", ".join(singles))

    def side(positions):
        return ImageIndex(index.root, list(index.classes), [index.paths[p] for p in positions],
                                [index.labels[p] for p in positions])

    record = SplitRecord(fraction, seed, [keys[p] for p in train], [index.labels[p] for p in train],
                         [keys[p] for p in val], [index.labels[p] for p in val])
    return side(train), side(val), record


def index_from_record(record: dict, side: str, base: Path, classes: list[str]) -> ImageIndex:
    """The `side` ('train' or 'val') of a saved split, its paths resolved under `base` (which may be another
    machine's copy of the data)."""
    base = Path(base)
    return ImageIndex(base, list(classes), [str(base / key) for key in record[side]],
                            list(record[f"{side}_labels"]))


def write_split_lists(run_dir: Path, record: SplitRecord, classes: list[str], label_name=None) -> list[Path]:
    """split_train.csv and split_val.csv (columns path,label; paths relative to data.root) in the run
    directory: the split readable by people, and usable again as `data.format: csv` lists. `label_name`:
    a label as written (default its class name; a multi-label index joins the tags)."""
    label_name = label_name or (lambda label: classes[label])
    written = []
    for side in ("train", "val"):
        path = Path(run_dir) / f"split_{side}.csv"
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["path", "label"])
            writer.writerows((key, label_name(label)) for key, label in
                             zip(getattr(record, side), getattr(record, f"{side}_labels")))
        written.append(path)
    return written

BUILTIN = ("digits",)


def ensure_builtin(name: str, root: str | Path) -> Path:
    """Write the data set under `root` unless it is already there; returns `root`."""
    root = Path(root)
    if (root / ".complete").exists():
        return root
    if name != "digits":
        raise ValueError(f"unknown built-in data set {name!r}; known: {', '.join(BUILTIN)}")
    if root.exists() and any(root.iterdir()):
        # Never overwrite a folder that is not ours: it may be the user's own data.
        raise DataTreeError(f"'data.root' = {root} already holds files that are not the built-in '{name}' data set; "
                            f"to train on that folder set data.builtin=null, or point data.root at an empty or "
                            f"new folder for '{name}'")
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    try:
        _write_digits(staging)
        (staging / ".complete").touch()
        if root.exists():
            root.rmdir()  # empty (checked above)
        os.replace(staging, root)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return root


def _write_digits(out: Path) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    seen = {}
    for i, (image, label) in enumerate(zip(digits.images, digits.target)):
        k = seen.get(int(label), 0)
        seen[int(label)] = k + 1
        split = "val" if k % 5 == 4 else "train"
        folder = out / split / str(int(label))
        folder.mkdir(parents=True, exist_ok=True)
        pixels = np.clip(image * (255.0 / 16.0), 0, 255).round().astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i:04d}.png")

# stat() releases the GIL: a few threads hide a network file system's latency on large splits.
_STAT_THREADS = 8


_STAT_CHUNK = 4096


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


def _sizes(paths: list[str]) -> list[int]:
    if len(paths) <= _STAT_CHUNK:
        return [_size(p) for p in paths]
    chunks = [paths[i:i + _STAT_CHUNK] for i in range(0, len(paths), _STAT_CHUNK)]
    with ThreadPoolExecutor(_STAT_THREADS) as pool:
        return [size for part in pool.map(lambda chunk: [_size(p) for p in chunk], chunks) for size in part]


def split_fingerprint(index: ImageIndex) -> dict:
    root = str(index.root).rstrip(os.sep) + os.sep
    relative = [p[len(root):] if p.startswith(root) else os.path.relpath(p, index.root) for p in index.paths]
    digest = hashlib.sha256()
    for rel, size in sorted(zip(relative, _sizes(index.paths))):
        digest.update(f"{rel}\0{size}\n".encode("utf-8", "surrogateescape"))
    return {"files": len(index), "classes": dict(zip(index.classes, index.class_counts())),
            "digest": digest.hexdigest()}


def data_fingerprint(train_index, val_index) -> dict | None:
    """The fingerprints of a run's two splits, as last.pt records them; None for shard streams, which the
    checkpoint's `data_source` record identifies (shard names, sample count) without reading every file."""
    if not (isinstance(train_index, ImageIndex) and isinstance(val_index, ImageIndex)):
        return None
    return {"train": split_fingerprint(train_index), "val": split_fingerprint(val_index)}


def fingerprint_differences(saved: dict, current: dict) -> list[str]:
    """One line per split whose files differ from the recorded ones (none for a checkpoint without a record)."""
    lines = []
    for split, name in (("train", "training"), ("val", "validation")):
        a, b = (saved or {}).get(split), current.get(split)
        if not isinstance(a, dict) or a.get("digest") == b["digest"]:
            continue
        counts_a, counts_b = a.get("classes") or {}, b["classes"]
        per_class = [f"{c}: {counts_a.get(c, 0)} -> {counts_b.get(c, 0)}" for c in sorted(set(counts_a) | set(counts_b))
                     if counts_a.get(c, 0) != counts_b.get(c, 0)]
        if a.get("files") != b["files"]:
            what = f"{a.get('files')} files -> {b['files']} files"
        else:
            what = f"the same number of files ({b['files']}), but other names or sizes"
        lines.append(f"data ({name} split): {what}" + (f" ({', '.join(per_class[:10])})" if per_class else ""))
    return lines
