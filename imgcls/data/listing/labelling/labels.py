"""How samples carry their labels, whatever source they come from. A task names its label format
(`Task.label_format`); the listing and the shard reader and writer ask the format, never the task.

- `class`: one class per sample: a folder name, a CSV label field, a shard's `.cls` number or `.txt` name.
- `tags`: any number of class names per sample: a CSV field of tags split by `data.label_delimiter`, a
  shard's `.tags` member (one name per line); the target is a multi-hot float vector.
"""
from __future__ import annotations

from pathlib import Path

import torch

from imgcls.data.listing.csv_list import check_no_empty_classes, csv_index
from imgcls.data.listing.split import index_from_record, split_index
from imgcls.data.listing.labelling.tag_split import split_tag_index, tag_index_from_record
from imgcls.data.listing.labelling.tags import check_tag_names, tag_classes, tag_csv_index
from imgcls.tasks import get_task

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
        """No control character, none of infer.py's own CSV columns (data.listing.labelling.tags.check_tag_names)."""
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
