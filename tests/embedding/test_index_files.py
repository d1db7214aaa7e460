"""Embedding folders a careless or hostile user hands over: index files whose lengths claim gigabytes, damaged or
forged files, outputs over the folder's own files, rows of files deleted or spelled twice. Each is refused with
one line (exit 2) before anything is allocated or written; no FAISS or numpy traceback."""
from __future__ import annotations

import csv
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import exit_code
from PIL import Image

import embed
import search

DIM = 16


def make_folder(folder: Path, count: int = 5, dim: int = DIM, digest: str = "d" * 64, kind: str = "flat") -> Path:
    """An embed.py folder written by its own functions, without a model (vectors of a fixed seed)."""
    import imgcls.embedding.index as index_module

    folder.mkdir(parents=True, exist_ok=True)
    vectors = np.random.default_rng(0).standard_normal((count, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    np.save(folder / "embeddings.npy", vectors)
    index_module.write_rows(folder, [index_module.PathRow(f"img/{i}.png", i) for i in range(count)])
    limit = index_module.EXACT_LIMIT
    index_module.EXACT_LIMIT = 0 if kind == "hnsw" else limit
    try:
        index_module.update_index(folder, vectors, index_module.IndexInfo("resnet10t", dim, "cosine", 0, "",
                                                                         "model.pt", digest), None)
    finally:
        index_module.EXACT_LIMIT = limit
    return folder


def search_run(*argv) -> int:
    return exit_code(lambda: search.main([*argv, "--num-workers", "0", "--device", "cpu"]))


def embed_run(*argv) -> int:
    return exit_code(lambda: embed.main([*argv, "--num-workers", "0", "--device", "cpu"]))


@pytest.fixture
def query(tmp_path) -> Path:
    path = tmp_path / "q.png"
    Image.new("RGB", (16, 16), (90, 30, 200)).save(path)
    return path


def edit_json(folder: Path, **changes) -> None:
    doc = json.loads((folder / "index.json").read_text())
    (folder / "index.json").write_text(json.dumps(doc | changes))


def edit_paths(folder: Path, header: list[str], rows: list[list]) -> None:
    with open(folder / "paths.csv", "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])


def faiss_bytes(folder: Path) -> bytearray:
    return bytearray((folder / "index.faiss").read_bytes())


FLAT_CODES_AT = 4 + 33  # the flat index's vector of floats: its uint64 length after the fourcc and header


DAMAGES = {
    "index.faiss truncated": lambda f: (f / "index.faiss").write_bytes(faiss_bytes(f)[:-40]),
    "index.faiss random": lambda f: (f / "index.faiss").write_bytes(np.random.default_rng(1).bytes(
        (f / "index.faiss").stat().st_size)),
    "index.faiss empty": lambda f: (f / "index.faiss").write_bytes(b""),
    "index.faiss longer": lambda f: (f / "index.faiss").write_bytes(faiss_bytes(f) + b"\0" * 64),
    "count as text": lambda f: edit_json(f, count="5"),
    "checkpoint null": lambda f: edit_json(f, checkpoint=None),
    "count 200000000": lambda f: edit_json(f, count=200_000_000),
    "count 10**12": lambda f: edit_json(f, count=10 ** 12),
    "dim 0": lambda f: edit_json(f, dim=0),
    "paths.csv without index": lambda f: edit_paths(f, ["path", "error"], [[f"img/{i}.png", ""] for i in range(5)]),
    "paths.csv index not a number": lambda f: edit_paths(f, ["index", "path"], [["x", "a.png"]]),
    "paths.csv index -1": lambda f: edit_paths(f, ["index", "path"], [[i - 1, f"{i}.png"] for i in range(5)]),
    "paths.csv index past the count": lambda f: edit_paths(f, ["index", "path"], [[i + 1, f"{i}.png"]
                                                                                  for i in range(5)]),
    "paths.csv a row twice": lambda f: edit_paths(f, ["index", "path"], [[min(i, 3), f"{i}.png"] for i in range(5)]),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_folder_is_refused_with_one_line_by_search_and_serve(damage, tmp_path, query, capsys):
    from imgcls.core.errors import ConfigError
    from imgcls.serving.server import open_index

    folder = make_folder(tmp_path / "v", kind="hnsw" if "faiss" in damage and "empty" not in damage else "flat")
    DAMAGES[damage](folder)
    capsys.readouterr()
    assert search_run(str(query), "--index", str(folder), "--checkpoint", str(query)) == 2
    message = capsys.readouterr().err
    assert "Traceback" not in message and str(folder) in message
    with pytest.raises(ConfigError):
        open_index(str(folder))  # serve.py --index at start-up


@pytest.mark.parametrize("claim", ["flat vector", "hnsw vector", "index.json count"])
def test_a_length_claiming_gigabytes_is_refused_in_bounded_memory(claim, tmp_path):
    """A 3 GiB vector length in a small index.faiss (FAISS takes lengths up to 2^40 and allocates them before
    reading), or a count of 200,000,000 in index.json: refused under a 1.5 GB address-space limit, where
    FAISS's allocation, or a row table of that count, would fail."""
    folder = make_folder(tmp_path / "v", kind=claim.split()[0])
    if claim == "index.json count":
        edit_json(folder, count=200_000_000)
    else:
        data = faiss_bytes(folder)
        at = FLAT_CODES_AT if claim == "flat vector" else 4 + 33 + 8 + 6 * 8  # hnsw: cum_nneighbor_per_level
        struct.pack_into("<Q", data, at, 3 * 2 ** 30 // 4)
        (folder / "index.faiss").write_bytes(data)
    script = textwrap.dedent(f"""
        import resource, sys
        from pathlib import Path
        from imgcls.core.errors import ConfigError
        from imgcls.embedding.index import load_index
        import faiss
        resource.setrlimit(resource.RLIMIT_AS, (1536 * 2 ** 20, resource.RLIM_INFINITY))
        try:
            load_index(Path({str(folder)!r}))
        except ConfigError as err:
            print(err, file=sys.stderr)
            sys.exit(2)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "index.faiss" in result.stderr and ("claims" in result.stderr or "cannot hold" in result.stderr)


def test_search_output_over_the_index_or_its_query_list_is_refused(tmp_path, query, capsys):
    folder = make_folder(tmp_path / "v")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    queries = tmp_path / "q.csv"
    queries.write_text(f"path\n{query}\n")
    os.symlink(folder, tmp_path / "link")
    for output, role in ((folder / "paths.csv", "index folder"), (folder / "index.json", "index folder"),
                         (tmp_path / "link" / "new.csv", "index folder"), (f"{folder}/../v/x.json", "index folder"),
                         (queries, "query list")):
        capsys.readouterr()
        assert search_run(str(queries), "--index", str(folder), "--output", str(output)) == 2
        assert role in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert queries.read_text() == f"path\n{query}\n"


def test_embed_into_the_folder_holding_its_input_list_is_refused(tmp_path, query, capsys):
    lists = tmp_path / "lst"
    lists.mkdir()
    (lists / "paths.csv").write_text(f"path\n{query}\n")
    assert embed_run(str(lists / "paths.csv"), "--checkpoint", "none.pt", "--output", str(lists)) == 2
    assert "input list" in capsys.readouterr().err
    assert (lists / "paths.csv").read_text() == f"path\n{query}\n"


@pytest.mark.parametrize("damage", ["truncated", "objects", "3 dims"])
def test_growing_a_folder_whose_embeddings_are_damaged_is_refused(damage, tmp_path, query, capsys):
    folder = make_folder(tmp_path / "v")
    npy = folder / "embeddings.npy"
    if damage == "truncated":
        npy.write_bytes(npy.read_bytes()[:-100])
    elif damage == "objects":
        np.save(npy, np.array([{"a": 1}] * 5, dtype=object), allow_pickle=True)
    else:
        np.save(npy, np.zeros((5, DIM, 1), np.float32))
    assert embed_run(str(query), "--checkpoint", "none.pt", "--output", str(folder)) == 2
    message = capsys.readouterr().err
    assert "embeddings.npy" in message and "Traceback" not in message
