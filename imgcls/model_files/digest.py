"""Which model made a set of vectors: the sha256 of the checkpoint file, which an export written with
export.py --embedding records (`source_digest`), so an index built from a checkpoint is searched with its
export, and a retrained or another model is told apart (search.py exits 2)."""
from __future__ import annotations

import hashlib
from pathlib import Path

from imgcls.model_files.model_file import ModelFile

CHUNK_BYTES = 1 << 20


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def model_digest(loaded: ModelFile) -> str:
    """The recorded source checkpoint's digest for an --embedding export; else the file's own (a timm
    folder: its files' digests, in name order)."""
    if loaded.source_digest:
        return loaded.source_digest
    if loaded.path.is_dir():
        digest = hashlib.sha256()
        for item in sorted(p for p in loaded.path.iterdir() if p.is_file()):
            digest.update(f"{item.name}:{file_sha256(item)}\n".encode())
        return digest.hexdigest()
    return file_sha256(loaded.path)
