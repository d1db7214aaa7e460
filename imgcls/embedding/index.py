"""The similarity index of an embedding folder: FAISS over the L2-normalised vectors, so inner product is
cosine. Exact (`IndexFlatIP`) up to EXACT_LIMIT vectors, where a top-10 query still answers in tens of
milliseconds on a CPU core (docs/embeddings.md has the measurements); HNSW (`IndexHNSWFlat`, inner product)
above it, whose query time grows with log(count). Both take vectors in chunks read from the memory-mapped
embeddings.npy, so a million vectors never need more than the index itself (no distance matrix), and
both grow by `add` when a folder gains files.

`index.faiss` holds the index, `index.json` what made it: model, dim, metric, count, kind, the model
file and its digest. faiss is imported only here, on the paths that build or read an index."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from imgcls.core.errors import ConfigError
from imgcls.embedding.store import partial_path

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

    from imgcls.embedding.store import read_rows

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
