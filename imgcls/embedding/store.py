"""An embedding folder's vectors and rows: `embeddings.npy` (float32 [count, D], one L2-normalised row per
readable image) and `paths.csv` (`index`, `path`, `error`; an unreadable file has an error and no index).

Vectors stream to disk as batches come (a memory-mapped .npy of the known number of inputs); the final
file is written beside it and renamed into place, so a reader never sees half of it."""
from __future__ import annotations

import csv
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
from numpy.lib.format import open_memmap

EMBEDDINGS = "embeddings.npy"
PATHS = "paths.csv"
COPY_ROWS = 65536  # rows copied at a time when the final file is assembled (bounded memory)


def partial_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


@dataclass
class PathRow:
    path: str
    index: Optional[int] = None   # the row in embeddings.npy (None: unreadable)
    error: str = ""


def read_rows(folder: Path) -> list[PathRow]:
    """paths.csv's rows (none when there is no such file)."""
    path = folder / PATHS
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [PathRow(r["path"], int(r["index"]) if r["index"] else None, r.get("error") or "")
                for r in csv.DictReader(f)]


def write_rows(folder: Path, rows: list[PathRow]) -> None:
    target = folder / PATHS
    tmp = partial_path(target)
    with open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["index", "path", "error"])
        writer.writerows(["" if r.index is None else r.index, r.path, r.error] for r in rows)
    os.replace(tmp, target)


def read_vectors(folder: Path) -> Optional[np.ndarray]:
    """embeddings.npy memory-mapped (not read into memory); None when there is none."""
    path = folder / EMBEDDINGS
    return np.load(path, mmap_mode="r") if path.is_file() else None


@dataclass
class VectorWriter:
    """Batches of vectors for `count` inputs, written to a memory-mapped scratch file as they come;
    `finish` appends the readable ones to what the folder held."""

    folder: Path
    count: int
    scratch: Optional[np.memmap] = None
    readable: Optional[np.ndarray] = None
    errors: dict = field(default_factory=dict)

    def __call__(self, vectors: np.ndarray, valid: np.ndarray, indices: np.ndarray, reasons: list) -> None:
        if self.scratch is None:
            self.scratch = open_memmap(partial_path(self.folder / ("new-" + EMBEDDINGS)), mode="w+",
                                       dtype=np.float32, shape=(self.count, vectors.shape[1]))
            self.readable = np.zeros(self.count, dtype=bool)
        self.scratch[indices] = vectors
        self.readable[indices] = valid
        self.errors.update((int(i), reason) for i, reason in zip(indices, reasons) if reason)

    @property
    def dim(self) -> Optional[int]:
        return None if self.scratch is None else self.scratch.shape[1]

    def finish(self, kept: Optional[np.ndarray]) -> tuple[np.ndarray, list[Optional[int]]]:
        """Write embeddings.npy as `kept` (the folder's earlier vectors, or None) followed by this run's
        readable vectors; returns the new file memory-mapped and each input's row (None: unreadable)."""
        old = 0 if kept is None else len(kept)
        rows, added = [], 0
        for ok in self.readable:
            rows.append(old + added if ok else None)
            added += int(ok)
        target = self.folder / EMBEDDINGS
        tmp = partial_path(target)
        out = open_memmap(tmp, mode="w+", dtype=np.float32, shape=(old + added, self.dim))
        try:
            self._fill(out, kept, old)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        del out
        self.discard()
        os.replace(tmp, target)
        return np.load(target, mmap_mode="r"), rows

    def _fill(self, out: np.ndarray, kept: Optional[np.ndarray], old: int) -> None:
        for start in range(0, old, COPY_ROWS):
            stop = min(start + COPY_ROWS, old)
            out[start:stop] = kept[start:stop]
        at = old
        for start in range(0, self.count, COPY_ROWS):
            chunk = self.scratch[start:start + COPY_ROWS][self.readable[start:start + COPY_ROWS]]
            out[at:at + len(chunk)] = chunk
            at += len(chunk)
        out.flush()

    def discard(self) -> None:
        if self.scratch is not None:
            name = self.scratch.filename
            del self.scratch
            self.scratch = None
            Path(name).unlink(missing_ok=True)
