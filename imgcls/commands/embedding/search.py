"""search.py's work: embed the query images with the index's model, through embed.py's pass, and write
the K nearest indexed images of each (a table on stdout, CSV or JSON)."""
from __future__ import annotations

import csv
import logging
import os
import sys
from pathlib import Path
from typing import Optional

from imgcls.commands.infer import fixed_batch_size
from imgcls.core.errors import ConfigError
from imgcls.core.outputs import write_json
from imgcls.data.file_list import expand_inputs, inference_batches
from imgcls.embedding.embedder import Embedder
from imgcls.embedding.index import load_index
from imgcls.embedding.neighbours import check_index_model, neighbour_rows

log = logging.getLogger(__name__)
COLUMNS = ["query", "rank", "path", "score", "error"]


def query_model(index_dir: Path, info_checkpoint: str, checkpoint: Optional[str]) -> str:
    """--checkpoint, else the model file index.json names (ConfigError when it is gone)."""
    path = checkpoint or info_checkpoint
    if not os.path.exists(path):
        raise ConfigError(f"--index {index_dir} was built with {info_checkpoint}, which is not there; pass "
                          f"--checkpoint with that model (or its export.py --embedding ONNX file)")
    return path


def run_search(queries: list[str], index_dir: str, top_k: int, output: Optional[str], checkpoint: Optional[str],
               batch_size: Optional[int], num_workers: int, device_setting: str = "auto") -> int:
    """Exit 0 when at least one query was read, 1 when none could be."""
    folder = Path(index_dir)
    index = load_index(folder)
    paths = expand_inputs(queries)
    model_path = query_model(folder, index.info.checkpoint, checkpoint)
    embedder = Embedder.open(model_path, device_setting)
    check_index_model(index, folder, model_path, embedder.digest)
    loader = inference_batches(paths, embedder.transform, fixed_batch_size(embedder.model_file, batch_size),
                               num_workers, embedder.runtime.device)
    found: list[tuple[int, dict]] = []  # (query's input position, row)

    def search_batch(vectors, valid, indices, reasons) -> None:
        for i, reason, ok in zip(indices, reasons, valid):
            if not ok:
                found.append((int(i), {"query": paths[i], "rank": None, "path": None, "score": None, "error": reason}))
        position = {paths[i]: int(i) for i in indices[valid]}
        for row in neighbour_rows(index, [paths[i] for i in indices[valid]], vectors[valid], top_k):
            found.append((position[row["query"]], {**row, "error": None}))

    embedder.run(loader, search_batch)
    rows = [row for _, row in sorted(found, key=lambda item: item[0])]
    failed = [r for r in rows if r["error"] is not None]
    for r in failed:
        log.warning("could not read %s: %s", r["query"], r["error"])
    print(format_table(rows))
    if output:
        write_search_rows(rows, output)
    print(f"searched {len(paths) - len(failed)} of {len(paths)} query file(s) in {index.info.count} vector(s) "
          f"({index.info.kind} index)" + (f"; wrote {output}" if output else ""), file=sys.stderr)
    return 0 if len(failed) < len(paths) else 1


def format_table(rows: list[dict]) -> str:
    lines = [f"{'query':<40} {'rank':>4} {'score':>8}  path"]
    for r in rows:
        if r["error"] is not None:
            lines.append(f"{r['query']:<40} error: {r['error']}")
        else:
            lines.append(f"{r['query']:<40} {r['rank']:>4} {r['score']:>8.4f}  {r['path']}")
    return "\n".join(lines)


def write_search_rows(rows: list[dict], output: str) -> None:
    if output.lower().endswith(".json"):
        write_json(rows, output)
        return
    target = Path(output)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in r.items()} for r in rows)
    os.replace(tmp, target)
