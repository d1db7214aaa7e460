"""CSV file lists (`data.format: csv`): a header row, one row per image, a path column and a label column
holding class names. Relative paths resolve against a base folder (`data.root`, or the CSV's own folder).

Every mistake in the file is a DataTreeError (exit 2) naming the file and its line or column; rows whose
image file does not exist are returned apart so the caller can list, count and limit them.
"""
from __future__ import annotations

import csv
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from imgcls.core.errors import DataTreeError
from imgcls.core.paths import not_a_regular_file
from imgcls.data.listing.folder import ImageIndex

log = logging.getLogger(__name__)


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


def _inside(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip(os.sep) + os.sep)


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
