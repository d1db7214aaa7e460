"""A multi-node resume reads the checkpoint on every node: each must see the very file rank 0 sees, or the
ranks would start from different states (or some from none). The first process of every node describes the
files it would resume from (size and SHA-256 of the content, or absent); a node whose view differs from rank
0's stops the run (exit 2) with a message naming the path there."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

from imgcls.core.errors import ConfigError
import imgcls.runtime.distributed as dist_utils
from imgcls.runtime.launcher import host_name

CHUNK = 1 << 20


def resume_files(resume: Optional[str], run_dir: Path) -> list[Path]:
    """The files `--resume` may read: the named checkpoint, or for `auto` last.pt and its previous state."""
    if not resume:
        return []
    if resume == "auto":
        return [run_dir / "last.pt", run_dir / "last.prev.pt"]
    return [Path(resume)]


def file_view(path: Path) -> Optional[tuple[int, str]]:
    """(size in bytes, SHA-256 of the content) of `path`, None when it is not there."""
    try:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
        return path.stat().st_size, digest.hexdigest()
    except FileNotFoundError:
        return None


def describe_view(hostname: str, files: list[Path]) -> dict:
    """This rank's view: its host, and for each file (by name) its path here and `file_view`."""
    return {"host": hostname, "files": {path.name: (str(path), file_view(path)) for path in files}}


def view_differences(views: list[Optional[dict]]) -> list[str]:
    """One line per rank and file that it sees otherwise than rank 0 (every rank's `describe_view`, None for
    a rank that left it to its node's first process)."""
    def seen(view) -> str:
        return "absent" if view is None else f"{view[0]} bytes, sha256 {view[1][:12]}"

    reference, lines = views[0], []
    for rank, view in enumerate(views[1:], start=1):
        for name, (path, here) in (view or {"files": {}})["files"].items():
            path0, there = reference["files"].get(name, ("", None))
            if here != there:
                lines.append(f"rank {rank} on {view['host']} sees {path}: {seen(here)}; rank 0 on "
                             f"{reference['host']} sees {path0}: {seen(there)}")
    return lines


def check_same_view(views: list[Optional[dict]]) -> None:
    lines = view_differences(views)
    if lines:
        raise ConfigError("--resume: the ranks do not see the same checkpoint, so they would not continue one "
                          "state:\n  " + "\n  ".join(lines) + "\nKeep output.dir (and a --resume path) on a "
                          "file system every node shares, at the same path on every node")


def check_shared_checkpoint(resume: Optional[str], run_dir: Path, dist) -> None:
    """Under DDP with `--resume` (or a restart's auto resume): every node sees rank 0's checkpoint files, or
    every rank stops with the same ConfigError. The first process of each node reads the files for its node
    (rank 0 is one of them). Call on all ranks at the same point."""
    if not dist.enabled or not resume:
        return
    view = describe_view(host_name(), resume_files(resume, run_dir)) if dist.local_rank == 0 or dist.is_main else None
    check_same_view(dist_utils.all_gather_objects(view))
