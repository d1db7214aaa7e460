"""Multi-label data (`data.task: multilabel`): the tag column of a CSV list, and the index of tagged files.

A row's label field holds zero or more class names separated by `data.label_delimiter` (a space by
default, as fastai and the Kaggle Planet lists write them). Tags are stripped, empty pieces (doubled or
trailing delimiters) dropped and repeats counted once. A row with no tag is an all-negative sample. A tag
outside the class list stops the run (DataTreeError, exit 2) naming the file, the line and the closest
class name.

`TagIndex` is an `ImageIndex` whose labels are tuples of class positions; the datasets turn each into
a float multi-hot vector of the class count (`target`), which mixup / CutMix mix and BCE / ASL take as is.
"""
from __future__ import annotations

import difflib
import os
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import torch

from imgcls.core.errors import DataTreeError
from imgcls.data.listing.folder import ImageIndex


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
    `data.listing.csv_list.csv_index` with tag lists for labels."""
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
