"""`data.format: folder`: `<data.root>/<train_split>/` and `<data.root>/<val_split>/`, one sub-folder per class,
or with `data.val_fraction` the one class-folder tree `<data.root>/`, split."""
from __future__ import annotations

from pathlib import Path

from imgcls.data.listing import match_classes, read_class_list, scan_split, split_index
from imgcls.data.sources.base import DataSources, EvalSource, Source


def scan_folder(d) -> DataSources:
    root = Path(d.root).expanduser()
    classes = read_class_list(Path(d.classes).expanduser()) if d.classes else None
    named = (f"the classes in data.classes ({d.classes})", "data.classes")
    if d.val_fraction is not None:
        whole = scan_split(root)
        if classes is not None:
            whole = match_classes(whole, classes, *named)
        train, val, record = split_index(whole, root, d.val_fraction, d.split_seed)
        return DataSources(train, val, record, {"format": "folder", "split": record.to_dict()})
    if classes is None:
        train = scan_split(root / d.train_split)
        val = scan_split(root / d.val_split, classes=train.classes)
    else:  # the label order of data.classes; each split must hold exactly those class folders
        train = match_classes(scan_split(root / d.train_split), classes, *named)
        val = match_classes(scan_split(root / d.val_split), classes, *named)
    return DataSources(train, val, None, {"format": "folder"})


def split_of(d, classes: list[str], split: str) -> EvalSource:
    """A folder under the data root (eval.py --split NAME, and the validation split), labelled in `classes`."""
    root = Path(d.root).expanduser()
    return EvalSource(match_classes(scan_split(root / split), classes), str(root), split, f"{root}/{split}")


SOURCE = Source("folder", scan_folder, lambda d, classes: split_of(d, classes, d.val_split),
                base=lambda d: Path(d.root).expanduser())
