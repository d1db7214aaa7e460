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
    size: Optional[int] = None      # the file's size and mtime when it was embedded (None: not recorded)
    mtime_ns: Optional[int] = None


def _row_index(text: str, where: str) -> Optional[int]:
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"{where}: index {text!r} is not a row number (a whole number >= 0); run embed.py into a "
                          f"new folder")
    return value


def read_rows(folder: Path) -> list[PathRow]:
    """paths.csv's rows (none when there is no such file); ConfigError (exit 2) for a file embed.py did not
    write: a column missing, an index that is not a row number."""
    path = folder / PATHS
    if not path.is_file():
        return []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = [c for c in ("index", "path") if c not in (reader.fieldnames or [])]
            if missing:
                raise ConfigError(f"{path}: no {' and no '.join(repr(c) for c in missing)} column; not a paths.csv "
                                  f"written by embed.py (run embed.py into a new folder)")
            return [PathRow(r["path"] or "", _row_index(r["index"] or "", f"{path} line {reader.line_num}"),
                            r.get("error") or "", _whole(r.get("size")), _whole(r.get("mtime_ns")))
                    for r in reader]
    except (UnicodeDecodeError, csv.Error) as err:
        raise ConfigError(f"{path}: not a paths.csv written by embed.py ({err})") from err


def _whole(text: Optional[str]) -> Optional[int]:
    return int(text) if text and text.isdigit() else None


def write_rows(folder: Path, rows: list[PathRow]) -> None:
    target = folder / PATHS
    tmp = partial_path(target)
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["index", "path", "error", "size", "mtime_ns"])
        writer.writerows(["" if r.index is None else r.index, r.path, r.error, "" if r.size is None else r.size,
                          "" if r.mtime_ns is None else r.mtime_ns] for r in rows)
    os.replace(tmp, target)


def read_vectors(folder: Path) -> Optional[np.ndarray]:
    """embeddings.npy memory-mapped (not read into memory); None when there is none; ConfigError (exit 2)
    when it is not a float32 [count, D] array held whole in the file (truncated, of objects, of 3 dims)."""
    path = folder / EMBEDDINGS
    if not path.is_file():
        return None
    try:
        vectors = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise ConfigError(f"{path}: not an embeddings.npy written by embed.py ({err}); run embed.py into a new "
                          f"folder") from err
    if not isinstance(vectors, np.ndarray) or vectors.dtype != np.float32 or vectors.ndim != 2:
        raise ConfigError(f"{path}: holds {getattr(vectors, 'dtype', type(vectors).__name__)} of shape "
                          f"{getattr(vectors, 'shape', '?')}, not float32 [count, D]; run embed.py into a new folder")
    return vectors


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

    def finish(self, kept: Optional[np.ndarray], selection: Optional[np.ndarray] = None
               ) -> tuple[np.ndarray, list[Optional[int]]]:
        """Write embeddings.npy as `kept` (the folder's earlier vectors, or None; only its rows `selection`
        when given) followed by this run's readable vectors; returns the new file memory-mapped and each
        input's row (None: unreadable)."""
        if kept is not None and selection is None:
            selection = np.arange(len(kept))
        old = 0 if kept is None else len(selection)
        rows, added = [], 0
        for ok in (() if self.readable is None else self.readable):
            rows.append(old + added if ok else None)
            added += int(ok)
        target = self.folder / EMBEDDINGS
        tmp = partial_path(target)
        out = open_memmap(tmp, mode="w+", dtype=np.float32,
                          shape=(old + added, self.dim if self.dim is not None else kept.shape[1]))
        try:
            self._fill(out, kept, selection)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        del out
        self.discard()
        os.replace(tmp, target)
        return np.load(target, mmap_mode="r"), rows

    def _fill(self, out: np.ndarray, kept: Optional[np.ndarray], selection: Optional[np.ndarray]) -> None:
        old = 0 if kept is None else len(selection)
        for start in range(0, old, COPY_ROWS):
            stop = min(start + COPY_ROWS, old)
            out[start:stop] = kept[selection[start:stop]]
        at = old
        for start in range(0, self.count if self.scratch is not None else 0, COPY_ROWS):
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


INFO_MAX_BYTES = 1 << 20  # index.json is a few hundred bytes; a larger one is not embed.py's


MAX_DIM = 1 << 16


INFO_TYPES = {"model": str, "dim": int, "metric": str, "count": int, "kind": str, "checkpoint": str, "digest": str}


def read_info(folder: Path) -> Optional[IndexInfo]:
    """index.json (None when there is none); ConfigError (exit 2) unless every field has embed.py's type and
    range: a count as text, a null checkpoint or a dim of 0 is a damaged or forged file."""
    path = folder / INDEX_META
    if not path.is_file():
        return None
    where = f"{path}: not an index.json written by embed.py"
    if path.stat().st_size > INFO_MAX_BYTES:
        raise ConfigError(f"{where} ({path.stat().st_size} bytes)")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"{where} ({err})") from err
    if not isinstance(doc, dict) or set(doc) != set(INFO_TYPES):
        keys = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise ConfigError(f"{where}: it holds {keys}, embed.py writes {sorted(INFO_TYPES)}")
    for key, kind in INFO_TYPES.items():
        if not isinstance(doc[key], kind) or isinstance(doc[key], bool):
            raise ConfigError(f"{where}: {key} is {doc[key]!r}, not {'a whole number' if kind is int else 'text'}")
    info = IndexInfo(**doc)
    if not 1 <= info.dim <= MAX_DIM or info.count < 0 or info.kind not in ("flat", "hnsw") or info.metric != METRIC:
        raise ConfigError(f"{where}: dim {info.dim} (1 to {MAX_DIM}), count {info.count} (>= 0), kind {info.kind!r} "
                          f"(flat or hnsw), metric {info.metric!r} ({METRIC})")
    return info


class _Reader:
    """Bounds-checked reads from a memory-mapped file: every length is checked against the bytes left before
    anything is taken, so a length that claims gigabytes costs nothing."""

    def __init__(self, path: Path):
        self.path, self.at = path, 0
        self.data = np.memmap(path, dtype=np.uint8, mode="r")

    def take(self, size: int) -> np.ndarray:
        if size < 0 or size > len(self.data) - self.at:
            raise ValueError(f"at byte {self.at} it claims {size} byte(s) where {len(self.data) - self.at} are left")
        self.at += size
        return self.data[self.at - size:self.at]

    def scalar(self, dtype: str) -> int:
        return int(self.take(np.dtype(dtype).itemsize).view(dtype)[0])

    def vector(self, dtype: str) -> np.ndarray:
        count = self.scalar("<u8")
        item = np.dtype(dtype).itemsize
        if count > (len(self.data) - self.at) // item:
            raise ValueError(f"at byte {self.at} a vector claims {count} item(s) of {item} bytes, "
                             f"{len(self.data) - self.at} bytes are left")
        return self.take(count * item).view(dtype)

    def header(self, fourcc: bytes, info: IndexInfo) -> None:
        found = self.take(4).tobytes()
        if found != fourcc:
            raise ValueError(f"{found!r} where {fourcc!r} (a {info.kind} index) begins")
        dim, count = self.scalar("<i4"), self.scalar("<i8")
        self.take(8 + 8 + 1)
        metric = self.scalar("<i4")
        if (dim, count, metric) != (info.dim, info.count, 0):
            raise ValueError(f"it holds {count} vector(s) of {dim} (metric {metric}), {INDEX_META} says {info.count} "
                             f"of {info.dim} (inner product)")

    def flat(self, info: IndexInfo) -> None:
        self.header(b"IxFI", info)
        if len(self.vector("<f4")) != info.count * info.dim:
            raise ValueError(f"its vectors are not {info.count} x {info.dim} floats")

    def hnsw_graph(self, info: IndexInfo) -> None:
        self.vector("<f8")  # assign_probas
        per_level = self.vector("<i4").astype(np.int64)  # cum_nneighbor_per_level
        levels, offsets = self.vector("<i4"), self.vector("<u8")
        neighbours = self.vector("<i4")
        entry, max_level = self.scalar("<i4"), self.scalar("<i4")
        self.take(12)  # efConstruction, efSearch, upper_beam
        n = info.count
        if (len(levels) != n or len(offsets) != n + 1 or (n and (levels.min() < 1 or levels.max() >= len(per_level)))
                or not -1 <= entry < max(n, 1) or (n and max_level != int(levels.max()) - 1)):
            raise ValueError("its graph does not describe the vectors it holds")
        if n and (np.any(np.diff(offsets.astype(np.int64)) != per_level[levels]) or int(offsets[-1]) != len(neighbours)
                  or neighbours.min() < -1 or neighbours.max() >= n):
            raise ValueError("its graph links rows it does not hold")


def check_index_file(folder: Path, info: IndexInfo) -> None:
    """ConfigError (exit 2) unless index.faiss is the kind of index embed.py writes (an exact inner-product
    index, or HNSW over one), holding the count and dim index.json says, every length within the file and
    every graph link a row: checked in bounded memory (memory-mapped), before FAISS allocates anything."""
    path = folder / INDEX_FILE
    size = path.stat().st_size
    try:
        if size < info.count * info.dim * 4 or size == 0:
            raise ValueError(f"{size} bytes cannot hold {info.count} vector(s) of {info.dim} floats")
        reader = _Reader(path)
        if info.kind == "hnsw":
            reader.header(b"IHNf", info)
            reader.hnsw_graph(info)
        reader.flat(info)
        if reader.at != size:
            raise ValueError(f"{size - reader.at} byte(s) follow the index")
    except (ValueError, OSError) as err:
        raise ConfigError(f"{path}: not the {info.kind} index embed.py writes ({err}); run embed.py into a new "
                          f"folder") from err


def read_faiss(folder: Path, info: IndexInfo):
    """index.faiss, checked first (check_index_file), so FAISS reads no more than the file holds."""
    import faiss

    check_index_file(folder, info)
    try:
        return faiss.read_index(str(folder / INDEX_FILE))
    except RuntimeError as err:
        raise ConfigError(f"{folder / INDEX_FILE}: FAISS cannot read it ({str(err).splitlines()[-1]}); run embed.py "
                          f"into a new folder") from err


def update_index(folder: Path, vectors: np.ndarray, info: IndexInfo, previous: Optional[IndexInfo]) -> None:
    """Bring the folder's index up to `vectors` (all of embeddings.npy): add the rows past the previous
    count to the index on disk when its kind still fits, else build it anew; then write index.json."""
    import faiss

    kind = kind_for(len(vectors))
    if previous is not None and previous.kind == kind and (folder / INDEX_FILE).is_file():
        index = read_faiss(folder, previous)
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
        """(scores [Q, k], rows [Q, k]); rows past the count are -1. ConfigError (exit 2) for vectors of
        another length than the index's (a model other than the one index.json names)."""
        if queries.ndim != 2 or queries.shape[1] != self.info.dim:
            raise ConfigError(f"the query model gives vectors of {queries.shape[-1]}, the index holds vectors of "
                              f"{self.info.dim} ({self.info.checkpoint}): vectors of two models do not compare")
        return self.index.search(np.ascontiguousarray(queries, dtype=np.float32), min(k, self.info.count))


def load_index(folder: Path) -> LoadedIndex:
    """The folder's index and its row -> path map; ConfigError (exit 2) when it is not an embed.py folder or
    its files disagree or are damaged (each checked before anything is allocated for it)."""
    import faiss

    info = read_info(folder)
    if info is None or not (folder / INDEX_FILE).is_file():
        raise ConfigError(f"--index {folder}: no {INDEX_META} and {INDEX_FILE} there; build one with "
                          f"embed.py PATH --checkpoint CKPT --output {folder}")
    index = read_faiss(folder, info)
    if index.ntotal != info.count or index.d != info.dim:
        raise ConfigError(f"--index {folder}: {INDEX_FILE} holds {index.ntotal} vectors of {index.d}, "
                          f"{INDEX_META} says {info.count} of {info.dim}; run embed.py on the folder again")
    if isinstance(index, faiss.IndexHNSW):
        index.hnsw.efSearch = HNSW_SEARCH_DEPTH
    paths: list[Optional[str]] = [None] * info.count
    for row in read_rows(folder):
        if row.index is None:
            continue
        if row.index >= info.count or paths[row.index] is not None:
            raise ConfigError(f"--index {folder}: {PATHS} gives row {row.index} to {row.path!r}, but the index "
                              f"holds rows 0 to {info.count - 1}, each once; run embed.py into a new folder")
        paths[row.index] = row.path
    if None in paths:
        raise ConfigError(f"--index {folder}: {PATHS} names no file for row {paths.index(None)} of {info.count}; "
                          f"run embed.py into a new folder")
    return LoadedIndex(info, index, paths)


def check_index_model(index: LoadedIndex, folder: Path, model_path, digest: str) -> None:
    """ConfigError (exit 2) naming both when the query model is not the one whose vectors the index holds."""
    info = index.info
    if digest != info.digest:
        raise ConfigError(f"the query model {model_path} (sha256 {digest[:16]}) is not the model that built --index "
                          f"{folder}: {info.checkpoint} (sha256 {info.digest[:16]}); vectors of two models do not "
                          f"compare: pass that model's file, or build the index again with embed.py")


def check_index_dim(index: LoadedIndex, folder: Path, model_path, dim: int) -> None:
    """ConfigError (exit 2) when the query model's vectors are not of the index's length: an index.json
    whose digest names this model over another model's vectors (forged or mixed by hand)."""
    if dim != index.info.dim:
        raise ConfigError(f"--index {folder} holds vectors of {index.info.dim}, the model {model_path} gives vectors "
                          f"of {dim}: they come from another model; build the index again with embed.py")


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
