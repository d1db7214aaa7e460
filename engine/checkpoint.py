"""Crash-safe checkpoint files, plain-data RNG state and bare state_dicts (the file level; what goes into
last.pt and best.pt is `engine.checkpointer`'s).

Writes go to a temp file in the same folder, are flushed and fsynced, then `os.replace`d over the
target and the folder is fsynced, so a crash at any byte leaves the previous file whole. Loading is
`core.safe_load.load_checkpoint` (`weights_only=True` with no fallback).
"""
from __future__ import annotations

import os
import random
import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from timm.utils import unwrap_model



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
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with signals_deferred():
        # Temp files of an earlier save that was killed (SIGKILL, power loss); one writer per path.
        for stale in path.parent.glob(f".{path.name}.*.tmp"):
            stale.unlink(missing_ok=True)
        if keep_previous and path.exists():
            _keep_previous(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(obj, f)  # straight to the file: no in-memory copy of the whole checkpoint first
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _keep_previous(path: Path) -> None:
    previous = path.with_name(f"{path.stem}.prev{path.suffix}")
    staging = path.with_name(f".{previous.name}.tmp")
    try:
        if staging.exists():
            staging.unlink()
        os.link(path, staging)
    except OSError:
        import shutil

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
