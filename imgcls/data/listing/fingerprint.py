"""A split's fingerprint, which `--resume` compares to know the run reads the files it was trained on.

{"files": N, "classes": {name: count}, "digest": sha256 of the sorted (path relative to the split folder,
size in bytes)}. Paths are relative, so the same files under another `data.root` match; a file added,
removed, renamed or rewritten with another size does not.
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

from imgcls.data.listing.folder import ImageIndex

# stat() releases the GIL: a few threads hide a network file system's latency on large splits.
_STAT_THREADS = 8
_STAT_CHUNK = 4096


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


def _sizes(paths: list[str]) -> list[int]:
    if len(paths) <= _STAT_CHUNK:
        return [_size(p) for p in paths]
    chunks = [paths[i:i + _STAT_CHUNK] for i in range(0, len(paths), _STAT_CHUNK)]
    with ThreadPoolExecutor(_STAT_THREADS) as pool:
        return [size for part in pool.map(lambda chunk: [_size(p) for p in chunk], chunks) for size in part]


def split_fingerprint(index: ImageIndex) -> dict:
    root = str(index.root).rstrip(os.sep) + os.sep
    relative = [p[len(root):] if p.startswith(root) else os.path.relpath(p, index.root) for p in index.paths]
    digest = hashlib.sha256()
    for rel, size in sorted(zip(relative, _sizes(index.paths))):
        digest.update(f"{rel}\0{size}\n".encode("utf-8", "surrogateescape"))
    return {"files": len(index), "classes": dict(zip(index.classes, index.class_counts())),
            "digest": digest.hexdigest()}


def data_fingerprint(train_index, val_index) -> dict | None:
    """The fingerprints of a run's two splits, as last.pt records them; None for shard streams, which the
    checkpoint's `data_source` record identifies (shard names, sample count) without reading every file."""
    if not (isinstance(train_index, ImageIndex) and isinstance(val_index, ImageIndex)):
        return None
    return {"train": split_fingerprint(train_index), "val": split_fingerprint(val_index)}


def fingerprint_differences(saved: dict, current: dict) -> list[str]:
    """One line per split whose files differ from the recorded ones (none for a checkpoint without a record)."""
    lines = []
    for split, name in (("train", "training"), ("val", "validation")):
        a, b = (saved or {}).get(split), current.get(split)
        if not isinstance(a, dict) or a.get("digest") == b["digest"]:
            continue
        counts_a, counts_b = a.get("classes") or {}, b["classes"]
        per_class = [f"{c}: {counts_a.get(c, 0)} -> {counts_b.get(c, 0)}" for c in sorted(set(counts_a) | set(counts_b))
                     if counts_a.get(c, 0) != counts_b.get(c, 0)]
        if a.get("files") != b["files"]:
            what = f"{a.get('files')} files -> {b['files']} files"
        else:
            what = f"the same number of files ({b['files']}), but other names or sizes"
        lines.append(f"data ({name} split): {what}" + (f" ({', '.join(per_class[:10])})" if per_class else ""))
    return lines
