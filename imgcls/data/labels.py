"""How samples carry their labels: a class, or tags (label formats), and the tag-aware split.

Multi-label data (`data.task: multilabel`): the tag column of a CSV list, and the index of tagged files.

A row's label field holds zero or more class names separated by `data.label_delimiter` (a space by
default, as fastai and the Kaggle Planet lists write them). Tags are stripped, empty pieces (doubled or
trailing delimiters) dropped and repeats counted once. A row with no tag is an all-negative sample. A tag
outside the class list stops the run (DataTreeError, exit 2) naming the file, the line and the closest
class name.

`TagIndex` is an `ImageIndex` whose labels are tuples of class positions; the datasets turn each into
a float multi-hot vector of the class count (`target`), which mixup / CutMix mix and BCE / ASL take as is.

A reproducible hold-out split of tagged files (`data.val_fraction` with `data.task: multilabel`):
iterative stratification (Sechidis et al. 2011, the `iterative-stratification` package), which keeps each
tag's share of positives close to the fraction on both sides, rarest tags first.

The split is a pure function of the files' relative paths, their tags, the fraction and the seed: the
files are first ordered by a SHA-256 of (seed, relative path), as data/listing.py orders them, and the
stratifier's own tie-breaking draws come from a numpy RandomState seeded with the seed (a generator whose
stream numpy keeps fixed). The input order therefore never depends on the listing order or the machine.

How samples carry their labels, whatever source they come from. A task names its label format
(`Task.label_format`); the listing and the shard reader and writer ask the format, never the task.

- `class`: one class per sample: a folder name, a CSV label field, a shard's `.cls` number or `.txt` name.
- `tags`: any number of class names per sample: a CSV field of tags split by `data.label_delimiter`, a
  shard's `.tags` member (one name per line); the target is a multi-hot float vector."""
from __future__ import annotations

import difflib
import hashlib
import os
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from imgcls.core.errors import DataTreeError
from imgcls.data.listing import (ImageIndex, SplitRecord, check_no_empty_classes, check_split_sides, csv_index,
                                 index_from_record, relative_key, split_index)
from imgcls.tasks import get_task

# infer.py's CSV columns beside the one per class: a class of one of these names would be read as the other
RESERVED_TAGS = ("path", "labels", "probs", "error")


def parse_tags(text: str, delimiter: str) -> list[str]:
    """The tags of one label field, in order, each once; [] for an empty field. Tags are compared in Unicode
    NFC form, so the composed and decomposed spellings of one tag (e with an acute accent typed either way)
    are one class."""
    tags: list[str] = []
    for piece in unicodedata.normalize("NFC", text).split(delimiter):
        tag = piece.strip()
        if tag and tag not in tags:
            tags.append(tag)
    return tags


@dataclass
class TagIndex(ImageIndex):
    """Files with zero or more tags each: `labels[i]` is a sorted tuple of class positions."""

    delimiter: str = " "

    def class_counts(self) -> list[int]:
        """Positives per class (an image counts once in each of its classes)."""
        counts = [0] * len(self.classes)
        for label in self.labels:
            for c in label:
                counts[c] += 1
        return counts

    def untagged(self) -> int:
        """Images with no tag (all-negative samples)."""
        return sum(1 for label in self.labels if not label)

    def target(self, label) -> torch.Tensor:
        """The float32 multi-hot vector of a tuple of class positions."""
        vector = torch.zeros(len(self.classes), dtype=torch.float32)
        vector[list(label)] = 1.0
        return vector

    def label_name(self, label) -> str:
        return self.delimiter.join(self.classes[c] for c in label)


def check_tag_names(tags: list[str], where: str) -> list[str]:
    """`tags` as they may name classes, or DataTreeError (exit 2) naming `where` they came from: a tag with a
    control character (a newline split the shard writer's classes.txt into one class more than the data has)
    or one of RESERVED_TAGS (infer.py's CSV has a column of that name already)."""
    for tag in tags:
        if any(unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") for ch in tag):
            raise DataTreeError(f"{where}: tag {tag!r} holds a control character (a newline, a tab, ...); tags "
                                f"are printable names")
        if tag in RESERVED_TAGS:
            raise DataTreeError(f"{where}: tag '{tag}' is reserved ({', '.join(RESERVED_TAGS)} are infer.py's "
                                f"CSV columns beside one column per class); rename it")
    return tags


def tag_classes(rows, delimiter: str, where: str = "the training list") -> list[str]:
    """The sorted union of the tags of `rows` (the class list when `data.classes` is not set); DataTreeError
    when there is none (an all-negative list names its classes in data.classes) or a tag cannot be a class
    name (`check_tag_names`)."""
    tags = sorted({tag for row in rows for tag in parse_tags(row.label, delimiter)})
    if not tags:
        raise DataTreeError(f"{where}: no row has a tag, so the classes are unknown; an all-negative list needs "
                            f"the class names in data.classes (one per line)")
    return check_tag_names(tags, where)


def unknown_tag_message(csv_path, line: int, tag: str, classes: list[str], known_as: str) -> str:
    close = difflib.get_close_matches(tag, classes, n=1)
    shown = ", ".join(classes[:20]) + (", ..." if len(classes) > 20 else "")
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"CSV list {csv_path} line {line}: tag '{tag}' is not one of the {known_as} ({shown}){hint}"


def tag_csv_index(csv_path, base: Path, rows, classes: list[str], known_as: str, delimiter: str
                  ) -> tuple[TagIndex, list[str]]:
    """(the index of the rows whose file exists, the resolved paths of those that do not); as
    `data.listing.csv_index` with tag lists for labels."""
    position = {name: i for i, name in enumerate(classes)}
    paths, labels, missing = [], [], []
    for row in rows:
        tags = parse_tags(row.label, delimiter)
        for tag in tags:
            if tag not in position:
                raise DataTreeError(unknown_tag_message(csv_path, row.line, tag, classes, known_as))
        path = row.path if os.path.isabs(row.path) else str(Path(base) / row.path)
        if not os.path.isfile(path):
            missing.append(path)
            continue
        paths.append(path)
        labels.append(tuple(sorted(position[t] for t in tags)))
    return TagIndex(Path(base), list(classes), paths, labels, delimiter=delimiter), missing


def describe_tags(index: TagIndex) -> str:
    """The start-up line of a multi-label split."""
    counts = index.class_counts()
    per_image = sum(counts) / max(len(index), 1)
    return (f"multi-label: {len(index)} images, {per_image:.2f} tags per image, {index.untagged()} with no tag "
            f"(all-negative); fewest positives {min(counts)} ({index.classes[counts.index(min(counts))]})")

def tag_split_positions(keys: list[str], labels: list[tuple], num_classes: int, fraction: float, seed: int
                        ) -> tuple[list[int], list[int]]:
    """(training positions, validation positions) into `keys`, each in the input order."""
    from iterstrat.ml_stratifiers import MultilabelStratifiedShuffleSplit

    n = len(keys)
    if n < 2:
        check_split_sides(list(range(n)), [], fraction)
    order = sorted(range(n), key=lambda p: hashlib.sha256(f"{seed}\0{keys[p]}".encode()).digest())
    matrix = np.zeros((n, num_classes), dtype=np.int64)
    for row, p in enumerate(order):
        matrix[row, list(labels[p])] = 1
    held = max(1, min(n - 1, int(np.floor(n * fraction + 0.5))))
    splitter = MultilabelStratifiedShuffleSplit(n_splits=1, test_size=held, random_state=seed % 2**32)
    _, val_rows = next(splitter.split(np.zeros(n), matrix))
    val = sorted(order[r] for r in val_rows)
    held_out = set(val)
    return [p for p in range(n) if p not in held_out], val


def split_tag_index(index: TagIndex, base: Path, fraction: float, seed: int
                    ) -> tuple[TagIndex, TagIndex, SplitRecord]:
    """Split `index` (paths under `base`) into training and validation indexes and their record (labels as
    lists of class positions, what a checkpoint can hold)."""
    keys = [relative_key(p, base) for p in index.paths]
    train, val = tag_split_positions(keys, index.labels, len(index.classes), fraction, seed)
    check_split_sides(train, val, fraction)

    def side(positions):
        return TagIndex(index.root, list(index.classes), [index.paths[p] for p in positions],
                        [index.labels[p] for p in positions], delimiter=index.delimiter)

    record = SplitRecord(fraction, seed, [keys[p] for p in train], [list(index.labels[p]) for p in train],
                         [keys[p] for p in val], [list(index.labels[p]) for p in val])
    return side(train), side(val), record


def tag_index_from_record(record: dict, side: str, base: Path, classes: list[str], delimiter: str) -> TagIndex:
    """The `side` ('train' or 'val') of a saved multi-label split, its paths resolved under `base`."""
    base = Path(base)
    return TagIndex(base, list(classes), [str(base / key) for key in record[side]],
                    [tuple(label) for label in record[f"{side}_labels"]], delimiter=delimiter)

TAGS_KEY = "tags"


class ClassLabels:
    name = "class"
    allows_empty_label = False     # a CSV row without a label is an error
    classes_from = "training labels"
    folder_tree = True             # a class-folder tree can hold these labels

    def __init__(self, delimiter: str = " "):
        self.delimiter = delimiter  # between tags (formats with tags only)

    def classes_of(self, rows, where: str = "the training list") -> list[str]:
        """The class list of a CSV list's rows (without data.classes): its sorted labels."""
        return sorted({row.label for row in rows})

    def check_class_names(self, names: list[str], where: str) -> list[str]:
        """`names` (data.classes) as they may name classes of this format; DataTreeError naming `where`."""
        return names

    def csv_index(self, csv_path, base: Path, rows, classes: list[str], known_as: str):
        """(index, missing files) of a CSV list's rows."""
        return csv_index(csv_path, base, rows, classes, known_as)

    def check_every_class_present(self, csv_path, index, missing) -> None:
        """Every class of a training list needs a sample (an empty class is a missing folder's mistake)."""
        check_no_empty_classes(csv_path, index, missing)

    def split(self, index, base: Path, fraction: float, seed: int):
        return split_index(index, base, fraction, seed)

    def held_out(self, record: dict, side: str, base: Path, classes: list[str]):
        """One side of a recorded data.val_fraction split, labelled in `classes`."""
        return index_from_record(record, side, base, classes)

    def read_shard_label(self, sample: dict, position: dict):
        """The label of a shard sample: its `.cls` number or `.txt` class name; ValueError when it has none or
        an unknown one."""
        if "cls" in sample:
            label = int(bytes(sample["cls"]).decode().strip())
            if not 0 <= label < len(position):
                raise ValueError(f"label {label} out of range in sample {sample.get('__key__')}")
            return label
        if "txt" in sample:
            name = bytes(sample["txt"]).decode().strip()
            if name not in position:
                raise ValueError(f"class '{name}' of sample {sample.get('__key__')} is not in data.classes")
            return position[name]
        raise ValueError(f"no label (.cls or .txt) in sample {sample.get('__key__')}")

    def placeholder(self, num_classes: int):
        """The label of an unreadable sample's stand-in (masked out of every sum)."""
        return 0

    def as_listed(self, label):
        """A read label as a listing holds it (a class position)."""
        return label

    def shard_member(self, label, classes: list[str]) -> dict:
        """What the shard writer stores for a listed label."""
        return {"cls": str(label)}


class TagLabels(ClassLabels):
    name = "tags"
    allows_empty_label = True      # an image without a tag is an all-negative one
    classes_from = "tags of the training list"
    folder_tree = False

    def classes_of(self, rows, where: str = "the training list") -> list[str]:
        return tag_classes(rows, self.delimiter, where)

    def check_class_names(self, names: list[str], where: str) -> list[str]:
        """No control character, none of infer.py's own CSV columns (data.labels.check_tag_names)."""
        return check_tag_names(names, where)

    def csv_index(self, csv_path, base: Path, rows, classes: list[str], known_as: str):
        return tag_csv_index(csv_path, base, rows, classes, known_as, self.delimiter)

    def check_every_class_present(self, csv_path, index, missing) -> None:
        """A tag no image carries is an all-negative class, not a missing folder: nothing to check."""

    def split(self, index, base: Path, fraction: float, seed: int):
        return split_tag_index(index, base, fraction, seed)

    def held_out(self, record: dict, side: str, base: Path, classes: list[str]):
        return tag_index_from_record(record, side, base, classes, self.delimiter)

    def read_shard_label(self, sample: dict, position: dict) -> torch.Tensor:
        """The float multi-hot target of a sample's `.tags` member; ValueError when it has none or names a
        class outside data.classes."""
        if TAGS_KEY not in sample:
            raise ValueError(f"no .{TAGS_KEY} member in sample {sample.get('__key__')} (multi-label shards: python -m "
                             f"data.shards --from LIST.csv --multilabel)")
        names = [line.strip() for line in bytes(sample[TAGS_KEY]).decode().splitlines() if line.strip()]
        unknown = [name for name in names if name not in position]
        if unknown:
            raise ValueError(f"tag '{unknown[0]}' of sample {sample.get('__key__')} is not in data.classes")
        target = torch.zeros(len(position), dtype=torch.float32)
        target[[position[name] for name in names]] = 1.0
        return target

    def placeholder(self, num_classes: int):
        return torch.zeros(num_classes)

    def as_listed(self, label) -> tuple:
        """A multi-hot vector as a tag list's label: the tuple of class positions."""
        return tuple(int(c) for c in label.nonzero().flatten())

    def shard_member(self, label, classes: list[str]) -> dict:
        return {TAGS_KEY: "".join(f"{classes[c]}\n" for c in label)}


FORMATS = {ClassLabels.name: ClassLabels, TagLabels.name: TagLabels}


def label_format(d) -> ClassLabels:
    """The label format of a data config: the one its task names (`data.task`), with its tag delimiter."""
    return FORMATS[get_task(d.task).label_format](d.label_delimiter)
