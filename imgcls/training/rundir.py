"""The run directory before any work: created, proven writable, and locked for one run at a time.

Rank 0 takes an exclusive POSIX record lock (`fcntl.lockf`) on `<output.dir>/.lock` and holds it until the
run ends, then removes the file (the kernel drops the lock when the process dies, so a killed run leaves an
unlocked file, never a stale lock). A record lock belongs to the process, not to the open file: the loader
workers forked from the run inherit the descriptor but not the lock, so a `kill -9` of the run frees the
directory at once, even while orphaned workers live on (an `flock` was shared with them and held until the
last one noticed). Record locks do not exclude the same process, so a second lock of one directory inside
one process is refused by a table of the directories this process holds. A second run into the same
directory exits 2 naming the holder. On a file system without locks the run warns and goes on unlocked.

A multi-node resume reads the checkpoint on every node: each must see the very file rank 0 sees, or the
ranks would start from different states (or some from none). The first process of every node describes the
files it would resume from (size and SHA-256 of the content, or absent); a node whose view differs from rank
0's stops the run (exit 2) with a message naming the path there."""
from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Optional

import imgcls.compute.distributed as dist_utils
from imgcls.compute.distributed import host_name
from imgcls.core.errors import ConfigError

log = logging.getLogger(__name__)


LOCK_NAME = ".lock"


_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


_HELD: set = set()  # (st_dev, st_ino) of the lock files this process holds


class RunDirLock:
    """An exclusive lock on a run directory; `release` (or the end of the process) lets it go."""

    def __init__(self, fd: int, path: Path, key: tuple):
        self.fd: Optional[int] = fd
        self.path = path
        self.key = key

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                # Removed while still locked: a run that opened the file meanwhile finds, once it has the
                # lock, that the name no longer leads to it, and starts over (`_lock_file`).
                self.path.unlink(missing_ok=True)
                fcntl.lockf(fd, fcntl.LOCK_UN)
            finally:
                _HELD.discard(self.key)
                os.close(fd)

    def __del__(self):
        try:
            self.release()
        except Exception:  # at interpreter exit the process's end drops the lock anyway
            pass


def _reason(err: OSError) -> str:
    if isinstance(err, FileExistsError):
        return "a file of that name is in the way"
    if isinstance(err, NotADirectoryError):
        return "a part of the path is a file"
    return err.strerror or type(err).__name__


def open_run_dir(run_dir: Path) -> Optional[RunDirLock]:
    """Create `run_dir`, check that files can be written there, and lock it. ConfigError (exit 2) naming the
    path and the reason when it cannot be used or another run holds it; None where locks are unsupported."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=run_dir)
        os.close(fd)
        os.unlink(probe)
        return _lock_file(run_dir)
    except OSError as err:
        raise ConfigError(f"'output.dir' = {run_dir}: cannot be used as the run directory ({_reason(err)}); "
                          f"pass an output.dir this user can write") from err


def _lock_file(run_dir: Path) -> Optional[RunDirLock]:
    path = run_dir / LOCK_NAME
    while True:
        try:  # this process holds it: a record lock would be granted again, and closing a second descriptor
            st = os.stat(path)  # of the file would drop the lock held through the first
            if (st.st_dev, st.st_ino) in _HELD:
                raise ConfigError(f"'output.dir' = {run_dir} is in use by another run "
                                  f"({path.read_text(errors='replace').strip()}); wait for it to end, stop it, "
                                  f"or pass another output.dir")
        except FileNotFoundError:
            pass
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        key = (os.fstat(fd).st_dev, os.fstat(fd).st_ino)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(f"'output.dir' = {run_dir} is in use by another run ({holder}); wait for it to "
                              f"end, stop it, or pass another output.dir") from None
        except OSError as err:
            os.close(fd)
            if err.errno not in _NO_LOCKS:
                raise
            log.warning("cannot lock %s (%s): this file system has no locks, so make sure no other run writes "
                        "to this output.dir", run_dir, err.strerror)
            return None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder removed the file as it ended: lock the one that is there now
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
             .encode())
    _HELD.add(key)
    return RunDirLock(fd, path, key)


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 512, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "its pid is not recorded yet"

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
