"""An embedding folder's vectors and rows: `embeddings.npy` (float32 [count, D], one L2-normalised row per
readable image) and `paths.csv` (`index`, `path`, `error`; an unreadable file has an error and no index).

Vectors stream to disk as batches come (a memory-mapped .npy of the known number of inputs); the final
file is written beside it and renamed into place, so a reader never sees half of it.

The similarity index of an embedding folder: FAISS over the L2-normalised vectors, so inner product is
cosine. Exact (`IndexFlatIP`) up to EXACT_LIMIT vectors, where a top-10 query still answers in tens of
milliseconds on a CPU core (docs/embeddings.md has the measurements); HNSW (`IndexHNSWFlat`, inner product)
above it, whose query time grows with log(count). Both take vectors in chunks read from the memory-mapped
embeddings.npy, so a million vectors never need more than the index itself (no distance matrix), and
both grow by `add` when a folder gains files.

`index.faiss` holds the index, `index.json` what made it: model, dim, metric, count, kind, the model
file and its digest. faiss is imported only here, on the paths that build or read an index.

The nearest indexed images of query vectors, as rows (`query`, `rank`, `path`, `score`), and the check
that queries are embedded by the model that built the index."""
from __future__ import annotations

import csv
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
from numpy.lib.format import open_memmap

from imgcls.core.errors import ConfigError

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

INDEX_FILE = "index.faiss"


INDEX_META = "index.json"


EXACT_LIMIT = 200_000   # vectors; above: HNSW


HNSW_NEIGHBOURS = 32    # M: links per vector


HNSW_BUILD_DEPTH = 80   # efConstruction


HNSW_SEARCH_DEPTH = 128  # efSearch: candidates kept per query (recall against time)


ADD_ROWS = 65536        # vectors added at a time


METRIC = "cosine"


@dataclass
class IndexInfo:
    model: str          # the architecture (model.name)
    dim: int
    metric: str         # cosine: inner product of L2-normalised vectors
    count: int
    kind: str           # flat | hnsw
    checkpoint: str     # the model file the vectors came from
    digest: str         # its sha256 (an --embedding export: its source checkpoint's)


def kind_for(count: int) -> str:
    return "flat" if count <= EXACT_LIMIT else "hnsw"


def new_index(kind: str, dim: int):
    import faiss

    if kind == "flat":
        return faiss.IndexFlatIP(dim)
    index = faiss.IndexHNSWFlat(dim, HNSW_NEIGHBOURS, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = HNSW_BUILD_DEPTH
    return index


def add_vectors(index, vectors: np.ndarray, start: int = 0) -> None:
    for at in range(start, len(vectors), ADD_ROWS):
        index.add(np.ascontiguousarray(vectors[at:at + ADD_ROWS], dtype=np.float32))


def read_info(folder: Path) -> Optional[IndexInfo]:
    path = folder / INDEX_META
    if not path.is_file():
        return None
    try:
        return IndexInfo(**json.loads(path.read_text()))
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{path}: not an index.json written by embed.py ({err})") from err


def update_index(folder: Path, vectors: np.ndarray, info: IndexInfo, previous: Optional[IndexInfo]) -> None:
    """Bring the folder's index up to `vectors` (all of embeddings.npy): add the rows past the previous
    count to the index on disk when its kind still fits, else build it anew; then write index.json."""
    import faiss

    kind = kind_for(len(vectors))
    if previous is not None and previous.kind == kind and (folder / INDEX_FILE).is_file():
        index = faiss.read_index(str(folder / INDEX_FILE))
        add_vectors(index, vectors, previous.count)
    else:
        index = new_index(kind, vectors.shape[1])
        add_vectors(index, vectors)
    tmp = partial_path(folder / INDEX_FILE)
    faiss.write_index(index, str(tmp))
    os.replace(tmp, folder / INDEX_FILE)
    info.kind, info.count = kind, int(index.ntotal)
    tmp = partial_path(folder / INDEX_META)
    tmp.write_text(json.dumps(asdict(info), indent=2) + "\n")
    os.replace(tmp, folder / INDEX_META)


@dataclass
class LoadedIndex:
    info: IndexInfo
    index: object
    paths: list[str]    # by row of embeddings.npy

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores [Q, k], rows [Q, k]); rows past the count are -1."""
        return self.index.search(np.ascontiguousarray(queries, dtype=np.float32), min(k, self.info.count))


def load_index(folder: Path) -> LoadedIndex:
    """The folder's index and its row -> path map; ConfigError (exit 2) when it is not an embed.py folder or
    its files disagree."""
    import faiss


    info = read_info(folder)
    if info is None or not (folder / INDEX_FILE).is_file():
        raise ConfigError(f"--index {folder}: no {INDEX_META} and {INDEX_FILE} there; build one with "
                          f"embed.py PATH --checkpoint CKPT --output {folder}")
    index = faiss.read_index(str(folder / INDEX_FILE))
    if isinstance(index, faiss.IndexHNSW):
        index.hnsw.efSearch = HNSW_SEARCH_DEPTH
    paths = [""] * info.count
    for row in read_rows(folder):
        if row.index is not None and row.index < info.count:
            paths[row.index] = row.path
    if index.ntotal != info.count or index.d != info.dim:
        raise ConfigError(f"--index {folder}: {INDEX_FILE} holds {index.ntotal} vectors of {index.d}, "
                          f"{INDEX_META} says {info.count} of {info.dim}; run embed.py on the folder again")
    return LoadedIndex(info, index, paths)

def check_index_model(index: LoadedIndex, folder: Path, model_path, digest: str) -> None:
    """ConfigError (exit 2) naming both when the query model is not the one whose vectors the index holds."""
    info = index.info
    if digest != info.digest:
        raise ConfigError(f"the query model {model_path} (sha256 {digest[:16]}) is not the model that built --index "
                          f"{folder}: {info.checkpoint} (sha256 {info.digest[:16]}); vectors of two models do not "
                          f"compare: pass that model's file, or build the index again with embed.py")


def neighbour_rows(index: LoadedIndex, queries: list[str], vectors: np.ndarray, k: int) -> list[dict]:
    """Up to `k` rows per query, nearest first; `score` is the cosine (higher is closer)."""
    scores, rows = index.search(vectors, k)
    out = []
    for query, row_scores, row_ids in zip(queries, scores, rows):
        for rank, (score, row) in enumerate(((s, r) for s, r in zip(row_scores, row_ids) if r >= 0), start=1):
            out.append({"query": query, "rank": rank, "path": index.paths[row], "score": round(float(score), 6)})
    return out


def neighbours(index: LoadedIndex, vector: np.ndarray, k: int) -> list[dict]:
    """serve.py's answer for one vector: [{"path", "score"}], nearest first."""
    return [{"path": r["path"], "score": r["score"]} for r in neighbour_rows(index, [""], vector[None], k)]
