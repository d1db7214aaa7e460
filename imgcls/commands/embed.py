"""embed.py's and search.py's work: vectors and their index, nearest neighbours.

embed.py's work: the pooled pre-logits vectors of a file list, streamed into an embedding folder
(embeddings.npy, paths.csv) with its similarity index (index.faiss, index.json); files the folder already
holds are not embedded again.

search.py's work: embed the query images with the index's model, through embed.py's pass, and write
the K nearest indexed images of each (a table on stdout, CSV or JSON)."""
from __future__ import annotations

import csv
import logging
import os
import sys
from pathlib import Path
from typing import Optional

import numpy as np

from imgcls.commands.infer import fixed_batch_size
from imgcls.commands.output_roles import check_embed_outputs, check_search_outputs
from imgcls.core.errors import ConfigError
from imgcls.core.files import print_table, write_json
from imgcls.data.datasets import expand_inputs, inference_batches
from imgcls.embedding.embedder import Embedder
from imgcls.embedding.index import (INDEX_FILE, METRIC, IndexInfo, PathRow, VectorWriter, check_index_file,
                                    check_index_model, load_index, neighbour_rows, read_info, read_rows, read_vectors,
                                    update_index, write_rows)

log = logging.getLogger(__name__)


def check_embed_output(output: str, inputs: list[str], paths: list[str], checkpoint: str) -> Path:
    """The output folder: not a file, holding no input (image, list, model) and apart from the input folders."""
    folder = Path(output)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--output {output}: is a file; name a folder (embed.py writes embeddings.npy, paths.csv "
                          f"and index.* into it)")
    check_embed_outputs(inputs, paths, checkpoint, output)
    return folder


def check_same_model(previous: Optional[IndexInfo], embedder: Embedder, folder: Path) -> None:
    """ConfigError (exit 2) naming both models when the folder's vectors came from another model."""
    if previous is not None and previous.digest != embedder.digest:
        raise ConfigError(f"--output {folder} holds vectors of {previous.checkpoint} (sha256 {previous.digest[:16]}), "
                          f"not of --checkpoint {embedder.model_file.path} (sha256 {embedder.digest[:16]}): vectors "
                          f"of two models do not compare; write to a new folder")


def check_kept_vectors(folder: Path, previous: Optional[IndexInfo]):
    """The folder's vectors (memory-mapped) when it holds an index, ConfigError (exit 2) when embeddings.npy
    does not hold the count index.json says (a damaged folder is not grown)."""
    if previous is None:
        return None
    kept = read_vectors(folder)
    if kept is None or len(kept) != previous.count or kept.ndim != 2 or kept.shape[1] != previous.dim:
        raise ConfigError(f"--output {folder}: index.json says {previous.count} vector(s) of {previous.dim}, "
                          f"embeddings.npy holds {'none' if kept is None else 'x'.join(map(str, kept.shape))}; "
                          f"write to a new folder")
    return kept


def fingerprint(path: str) -> Optional[tuple[int, int]]:
    """(size, mtime_ns) of a file, None when it is gone."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_size, stat.st_mtime_ns


def current_rows(folder: Path, previous: Optional[IndexInfo]) -> list[PathRow]:
    """The folder's vector rows whose files are still there, unchanged since they were embedded: the row of a
    file deleted, moved away or rewritten is dropped (a search must not answer it)."""
    if previous is None:
        return []
    rows, seen = [], set()
    for row in read_rows(folder):
        if row.index is None:
            continue
        if row.index >= previous.count or row.index in seen:
            raise ConfigError(f"--output {folder}: paths.csv gives row {row.index} to {row.path!r}, but "
                              f"embeddings.npy holds rows 0 to {previous.count - 1}, each once; write to a new folder")
        seen.add(row.index)
        now = fingerprint(row.path)
        if now is not None and (row.size is None or now == (row.size, row.mtime_ns)):
            rows.append(row)
    return rows


def distinct_files(paths: list[str]) -> list[str]:
    """Each file once: `0/../0/x.png`, `./0/x.png` and a link to it are one file (the first spelling kept)."""
    seen, out = set(), []
    for path in paths:
        key = os.path.realpath(path)
        if key not in seen:
            seen.add(key)
            out.append(path)
    return out


def run_embed(inputs: list[str], checkpoint: str, output: str, batch_size: Optional[int], amp: Optional[str],
              num_workers: int, device_setting: str = "auto") -> int:
    """Embed every input file not yet in `output`; returns the exit status (0: the folder holds vectors,
    1: no file could be read)."""
    paths = distinct_files(expand_inputs(inputs))
    folder = check_embed_output(output, inputs, paths, checkpoint)
    previous = read_info(folder)
    kept = check_kept_vectors(folder, previous)
    if previous is not None and (folder / INDEX_FILE).is_file():
        check_index_file(folder, previous)
    kept_rows = current_rows(folder, previous)
    embedder = Embedder.open(checkpoint, device_setting, amp)
    check_same_model(previous, embedder, folder)
    dropped = 0 if previous is None else previous.count - len(kept_rows)
    known = {os.path.realpath(r.path) for r in kept_rows}
    new = [p for p in paths if os.path.realpath(p) not in known]
    if previous is not None:
        print(f"{folder}: {previous.count} vector(s) already" +
              (f", {dropped} of files gone or changed dropped" if dropped else "") +
              f"; {len(new)} of {len(paths)} input file(s) are new", file=sys.stderr)
    if not new and not dropped:
        print(f"nothing to embed: every input file is in {folder}", file=sys.stderr)
        return 0 if previous.count else 1
    batch_size = fixed_batch_size(embedder.model_file, batch_size)
    log.info("embedding %d file(s) in batches of %d on %s", len(new), batch_size, embedder.runtime.device)
    loader = inference_batches(new, embedder.transform, batch_size, num_workers, embedder.runtime.device)
    folder.mkdir(parents=True, exist_ok=True)
    writer = VectorWriter(folder, len(new))
    try:
        embedder.run(loader, writer)
        vectors, rows = writer.finish(kept, np.array([r.index for r in kept_rows], dtype=np.int64)
                                      if kept is not None else None)
    finally:
        writer.discard()
    kept_rows = [PathRow(r.path, i, "", r.size, r.mtime_ns) for i, r in enumerate(kept_rows)]
    new_rows = [PathRow(p, row, writer.errors.get(i, ""), *(fingerprint(p) or (None, None)))
                for i, (p, row) in enumerate(zip(new, rows))]
    write_rows(folder, kept_rows + new_rows)
    info = IndexInfo(embedder.name, int(vectors.shape[1]), METRIC, len(vectors), "", str(embedder.model_file.path),
                     embedder.digest)
    update_index(folder, vectors, info, None if dropped else previous)
    failed = [r for r in new_rows if r.index is None]
    for r in failed:
        log.warning("could not read %s: %s", r.path, r.error)
    print(f"embedded {len(new) - len(failed)} of {len(new)} file(s)" +
          (f"; {len(failed)} could not be read" if failed else "") +
          f"; {folder} holds {info.count} vector(s) of {info.dim} ({info.kind} index, {info.metric})", file=sys.stderr)
    return 0 if info.count else 1


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
    paths = expand_inputs(queries)
    check_search_outputs(queries, paths, index_dir, checkpoint, output)
    index = load_index(folder)
    model_path = query_model(folder, index.info.checkpoint, checkpoint)
    check_search_outputs(queries, paths, index_dir, model_path, output)
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
    print_table(format_table(rows))
    if output:
        write_search_rows(rows, output)
    print(f"searched {len(paths) - len(failed)} of {len(paths)} query file(s) in {index.info.count} vector(s) "
          f"({index.info.kind} index)" + (f"; wrote {output}" if output else ""), file=sys.stderr)
    return 0 if len(failed) < len(paths) else 1


def format_table(rows: list[dict]) -> str:
    """search.py's table: the query column as wide as its longest path, so the header sits over its rows."""
    width = max([40] + [len(r["query"]) for r in rows])
    lines = [f"{'query':<{width}} {'rank':>4} {'score':>8}  path"]
    for r in rows:
        if r["error"] is not None:
            lines.append(f"{r['query']:<{width}} error: {r['error']}")
        else:
            lines.append(f"{r['query']:<{width}} {r['rank']:>4} {r['score']:>8.4f}  {r['path']}")
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
