"""Crash-safe checkpoint files, plain-data RNG state and bare state_dicts (the file level; what goes into
last.pt and best.pt is `rundir.checkpoints`'s).

Writes go to a temp file in the same folder (named after its host and process, so that a later save
removes only the temp files of writers that are gone), are flushed and fsynced, then `os.replace`d over
the target and the folder is fsynced, so a crash at any byte leaves the previous file whole. A full disk
is a DiskFullError saying how much was needed. Loading is `core.safe_load.load_checkpoint`
(`weights_only=True` with no fallback).
"""
from __future__ import annotations

import errno
import glob
import os
import random
import re
import secrets
import shutil
import signal
import socket
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.utils.serialization.config as serialization_config
from timm.utils import unwrap_model

from imgcls.core.errors import DiskFullError
from imgcls.rundir.resume_hint import continue_command


@contextmanager
def signals_deferred():
    """Hold SIGTERM/SIGINT until the block ends, so a second signal cannot interrupt a save."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending = []
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.getsignal(sig)
        signal.signal(sig, lambda s, f: pending.append(s))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in pending:
            handler = previous[sig]
            if callable(handler):
                handler(sig, None)


def save_atomic(obj, path: str | os.PathLike, keep_previous: bool = False) -> None:
    """Write `obj` to `path` so that `path` is, at every instant, either the old or the new file whole.

    keep_previous: first make the current file also available as `<stem>.prev<suffix>` (a hard link,
    or a copy where links are not supported), so a later damaged write still leaves a good state.
    The file gets the permissions of any new file (0666 less the umask). A full disk raises DiskFullError
    saying how much the file needed; the old file is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with signals_deferred():
        remove_stale_temp_files(path)
        if keep_previous and path.exists():
            _keep_previous(path)
        tmp = path.with_name(f".{path.name}.{_OWNER}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to any file
        try:
            with os.fdopen(fd, "wb") as f, serialization_config.patch({"save.compute_crc32": False}):
                # straight to the file: no in-memory copy of the whole checkpoint first. No CRC-32 per
                # record: torch.load never checks it, and computing it was a quarter of the save's time
                # (docs/performance.md). Zip tools that verify CRCs (`unzip -t`, zipfile's read) report zeros
                torch.save(obj, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as err:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            if _disk_full(err):
                free = shutil.disk_usage(path.parent).free
                raise DiskFullError(f"no space left on device in {path.parent} (needed ~{_mib(tensor_bytes(obj))} MB "
                                    f"for {path.name}, {_mib(free)} MB free); {path.name} keeps its previous "
                                    f"state. Free some space (or move output.dir) and continue with: "
                                    f"{continue_command(path.parent / 'last.pt')}") from err
            raise
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


# Temp files are named .<target>.<host>.<pid>.<random>.tmp, so a save removes only those whose writer is gone.
_OWNER = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:64] or "host"


def remove_stale_temp_files(path: Path) -> None:
    """Remove temp files of `path` left by a save that was killed (SIGKILL, power loss): those whose writer is
    this process (which has no save in flight here) or a process of this host that no longer exists. Files of
    a live process, of another host, or named otherwise are left alone."""
    prefix = f".{path.name}."
    for stale in path.parent.glob(f"{glob.escape(prefix)}*.tmp"):
        parts = stale.name[len(prefix):-len(".tmp")].rsplit(".", 2)
        if len(parts) != 3 or parts[0] != _OWNER or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid == os.getpid() or not _process_exists(pid):
            stale.unlink(missing_ok=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _disk_full(err: BaseException) -> bool:
    """Whether a full disk (or an exhausted quota) is behind `err`; torch.save reports one as a RuntimeError
    ("unexpected pos") whose context is the OSError."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        err = err.__cause__ or err.__context__
    return False


def tensor_bytes(obj) -> int:
    """The bytes of the tensors in a nested dict / list (about a checkpoint's size on disk)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _mib(n: int) -> int:
    return max(1, round(n / 2**20))


def _keep_previous(path: Path) -> None:
    previous = path.with_name(f"{path.stem}.prev{path.suffix}")
    staging = path.with_name(f".{previous.name}.tmp")
    try:
        if staging.exists():
            staging.unlink()
        os.link(path, staging)
    except OSError:
        shutil.copyfile(path, staging)
    os.replace(staging, previous)


def bare_state_dict(model: torch.nn.Module) -> dict:
    """The state_dict of the underlying model: no `module.` (DDP) or `_orig_mod.` (compile) prefixes."""
    inner = unwrap_model(model)
    return {k: v.detach().clone().cpu() for k, v in inner.state_dict().items()}


# ---------------------------------------------------------------- RNG state as plain data


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "python": _to_plain(random.getstate()),
        "numpy": {"key": np_state[0], "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                  "cached_gaussian": float(np_state[4]), "state": torch.from_numpy(np_state[1].astype(np.int64))},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # This process's own device: under DDP every rank is seeded alike and draws alike, so rank 0's
        # stream (the one saved) is every rank's.
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_to_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["key"], n["state"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if isinstance(state.get("cuda"), torch.Tensor) and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _to_plain(value):
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    return value


def _to_tuple(value):
    if isinstance(value, list):
        return tuple(_to_tuple(v) for v in value)
    return value
