"""The nearest indexed images of query vectors, as rows (`query`, `rank`, `path`, `score`), and the check
that queries are embedded by the model that built the index."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from imgcls.core.errors import ConfigError
from imgcls.embedding.index import LoadedIndex


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
