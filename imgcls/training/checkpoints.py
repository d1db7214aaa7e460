"""Crash-safe checkpoint files, plain-data RNG state and bare state_dicts (the file level; what goes into
last.pt and best.pt is `training.checkpoints`'s).

Writes go to a temp file in the same folder (named after its host and process, so that a later save
removes only the temp files of writers that are gone), are flushed and fsynced, then `os.replace`d over
the target and the folder is fsynced, so a crash at any byte leaves the previous file whole. A full disk
is a DiskFullError saying how much was needed. Loading is `core.safe_load.load_checkpoint`
(`weights_only=True` with no fallback).

The checkpoint format of a training run, written and restored: what goes into last.pt and best.pt, and
loading last.pt's state back into the run. (What may change on resume, and the run directory's policy:
`training.rundir`; reading a checkpoint back for eval.py / infer.py:
`model_files.checkpoint_files`.)

last.pt: `model` (the trained weights, a bare state_dict), `classes`, `config`, `preprocessing`, `epoch`,
`step`, `metrics`, and the training state: `batch_in_epoch`, `optimizer`, `scheduler`, `scaler`, `rng`,
`train_state`, `world_size`, under torchrun `elastic_run_id`, `data_fingerprint` (`data.fingerprint`), and with
EMA `model_ema`, distilled `distill`. Both record `data_source` (the data format, a `data.val_fraction` split's file lists, CSV lists'
digests), and with tracking on `tracking_run_id` (the tracking run --resume reopens and eval.py adds to). best.pt: the
evaluated weights (the EMA when on) under `model`, with the same metadata and no training state."""
from __future__ import annotations

import dataclasses
import errno
import glob
import logging
import os
import random
import re
import secrets
import shutil
import signal
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol

import numpy as np
import torch
import torch.utils.serialization.config as serialization_config
from timm.utils import unwrap_model

from imgcls.compute.distributed import run_on_main
from imgcls.config import Config
from imgcls.core.errors import CheckpointError, DiskFullError, NonFiniteError
from imgcls.model_files.checkpoint_files import preprocessing_record
from imgcls.tasks import task_of
from imgcls.training.rundir import continue_command
from imgcls.training.state import TrainState


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

log = logging.getLogger(__name__)


FORMAT_VERSION = 1


class Stateful(Protocol):
    def state_dict(self): ...
    def load_state_dict(self, state) -> None: ...


class ModuleWeights:
    """A module's weights as a part of last.pt: a bare state_dict (no DDP / compile prefixes), which timm's and
    torchvision's models load with strict=True."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def state_dict(self) -> dict:
        return bare_state_dict(self.module)

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state)


class RandomState:
    """Python's, NumPy's and torch's generators (CPU and CUDA)."""

    def state_dict(self) -> dict:
        return rng_state()

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state)


class Recorded:
    """A value last.pt records and a resume reads where it needs it (the elastic run id, a tracking run
    id): saved, never loaded back into the run."""

    def __init__(self, value_of: Callable[[], object]):
        self.value_of = value_of

    def state_dict(self):
        return self.value_of()

    def load_state_dict(self, state) -> None:
        pass


@dataclass(frozen=True)
class RunRecord:
    """What every checkpoint of a run says about it besides its state."""

    cfg: Config
    classes: list[str]
    world_size: int
    data_source: Optional[dict] = None
    fingerprint: Optional[dict] = None  # data.listing.data_fingerprint of the run's splits


class Checkpointer:
    """Writes last.pt (with last.prev.pt) and best.pt of a run and restores last.pt; only rank 0 writes.
    Everything resumable is a part in `states` (name -> `state_dict` / `load_state_dict`), saved under its
    name and restored through the same pair; a part whose `state_dict` is None is left out. `optional` names
    parts a checkpoint may lack. best.pt holds `best_model`'s weights (the EMA when on) and the parts in
    `best_states`, with no training state."""

    def __init__(self, run_dir: Path, is_main: bool, record: RunRecord, states: dict[str, Stateful],
                 best_model: torch.nn.Module, best_states: tuple[str, ...] = (), optional: tuple[str, ...] = (),
                 best_weights: Callable[[dict], dict] = lambda weights: weights):
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self.record = record
        self.states = states
        self.best_model = best_model
        self.best_states = best_states
        self.optional = optional
        self.best_weights = best_weights  # the objective's say in best.pt's weights (weight aligning)
        self.saved_state: Optional[TrainState] = None  # what last.pt on disk holds (restored or last saved)

    def _common(self, weights: dict, state: TrainState, metrics: Optional[dict]) -> dict:
        r = self.record
        return {"format_version": FORMAT_VERSION, "model": weights, "classes": list(r.classes),
                "config": r.cfg.to_dict(), "preprocessing": preprocessing_record(r.cfg),
                "epoch": state.epoch, "step": state.step, "metrics": dict(metrics or {}),
                # the CPU threads the run computed with: a resume, eval.py and infer.py take the same by
                # default, since sums over another thread count round differently in the last digits
                "threads": torch.get_num_threads(), **data_source_fields(r.data_source)}

    def _parts(self, names) -> dict:
        out = {}
        for name in names:
            value = self.states[name].state_dict()
            if value is not None:
                out[name] = value
        return out

    def last_contents(self, state: TrainState) -> dict:
        parts = self._parts(self.states)
        ckpt = self._common(parts.pop("model"), state, None)
        ckpt.update({"batch_in_epoch": state.batch_in_epoch, "train_state": dataclasses.asdict(state),
                     "world_size": self.record.world_size, **parts})
        if self.record.fingerprint is not None:
            ckpt["data_fingerprint"] = self.record.fingerprint
        return ckpt

    def best_contents(self, state: TrainState, metrics: dict) -> dict:
        weights = self.best_weights(bare_state_dict(self.best_model))
        return (self._common(weights, state, metrics) | self._parts(self.best_states)
                | task_of(self.record.cfg).model_file_extras(metrics))

    def save_last(self, state: TrainState) -> None:
        """Call on every rank at the same point: all agree on refusing non-finite weights, and all stop when
        rank 0 finds the disk full."""
        self.refuse_nonfinite("last.pt", state.step)
        run_on_main(self.is_main, lambda: save_atomic(self.last_contents(state), self.run_dir / "last.pt",
                                                      keep_previous=True), shared=(DiskFullError,))
        self.saved_state = TrainState(**dataclasses.asdict(state))

    def start_last(self, state: TrainState, after: Optional["PendingSave"] = None) -> "PendingSave":
        """save_last on a thread of rank 0, from a host copy of the contents, so the caller computes on (the next
        epoch; the calibration after the final one) and may change the weights meanwhile; written after
        `after`'s file. Call on every rank; the returned PendingSave's `wait()`, on every rank, returns once the
        file is whole (a full disk raised on every rank, as by save_last)."""
        self.refuse_nonfinite("last.pt", state.step)
        saved = TrainState(**dataclasses.asdict(state))
        return self._start(lambda: self.last_contents(state), "last.pt", True, after,
                           on_whole=lambda: setattr(self, "saved_state", saved))

    def start_best(self, state: TrainState, metrics: dict, after: Optional["PendingSave"] = None) -> "PendingSave":
        """best.pt (`best_contents`), written as start_last writes last.pt."""
        self.refuse_nonfinite("best.pt", state.step)
        return self._start(lambda: self.best_contents(state, metrics), "best.pt", False, after)

    def _start(self, contents: Callable[[], dict], name: str, keep_previous: bool, after: Optional["PendingSave"],
               on_whole: Callable[[], None] = lambda: None) -> "PendingSave":
        def begin() -> BackgroundSave:
            return BackgroundSave(tensor_copies(contents()), self.run_dir / name, keep_previous,
                                  after.writer if after else None)

        return PendingSave(name, run_on_main(self.is_main, begin), self.is_main, on_whole)

    def refuse_nonfinite(self, name: str, step: int) -> None:
        """Non-finite weights are never saved: the file keeps the last good state."""
        model = self.states["model"].module
        tensors = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
        if tensors and not all_finite(tensors):
            raise NonFiniteError(f"the weights became non-finite by optimizer step {step}; {name} was not "
                                 f"written and keeps the last good state (lower optim.lr or set train.clip_grad_norm)")

    def restore(self, ckpt: dict) -> TrainState:
        """Load every part's state from last.pt into the run; returns the run's bookkeeping.
        A part that does not load (a damaged or foreign file that `check_resume_compatible` let through)
        is a CheckpointError (exit 2) naming it."""
        for name, part in self.states.items():
            if name not in ckpt and name in self.optional:
                continue
            try:
                part.load_state_dict(ckpt[name])
            except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as err:
                reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
                raise CheckpointError(f"--resume: the checkpoint's '{name}' does not load into this run "
                                      f"({type(err).__name__}: {reason}); the file is damaged or was not "
                                      f"written by this train.py") from err
        state = TrainState.from_saved(ckpt["train_state"])
        self.saved_state = TrainState(**dataclasses.asdict(state))
        log.info("resumed at epoch %d, batch %d, optimizer step %d", state.epoch + 1, state.batch_in_epoch, state.step)
        return state


class BackgroundSave:
    """save_atomic(contents, path) on its own thread, started at once, after `after`'s write has ended (the
    files land in the order they were started); `join()` waits for it and raises its error."""

    def __init__(self, contents: dict, path: Path, keep_previous: bool = False,
                 after: Optional["BackgroundSave"] = None):
        import threading

        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._write, args=(contents, path, keep_previous, after),
                                       name=f"{path.name} writer")
        self.thread.start()

    def _write(self, contents: dict, path: Path, keep_previous: bool, after: Optional["BackgroundSave"]) -> None:
        if after is not None:
            after.thread.join()  # its error is raised by its own join()
        try:
            save_atomic(contents, path, keep_previous=keep_previous)
        except BaseException as err:  # raised in the caller's thread by join()
            self.error = err

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


class PendingSave:
    """A checkpoint (`name`) being written by rank 0's BackgroundSave (`writer`; None on the other ranks):
    `wait()`, once and on every rank, returns when the file is whole (then calls `on_whole`); a full disk is
    raised on every rank."""

    def __init__(self, name: str, writer: Optional[BackgroundSave], is_main: bool,
                 on_whole: Callable[[], None] = lambda: None):
        self.name, self.writer, self.is_main, self.on_whole = name, writer, is_main, on_whole

    def wait(self) -> None:
        run_on_main(self.is_main, lambda: self.writer.join(), shared=(DiskFullError,))
        self.on_whole()


def tensor_copies(obj):
    """`obj` (dicts, lists and tuples of tensors and plain values) with every tensor copied to host memory (an
    accelerator's memory is not doubled) and every container rebuilt: what a background write holds while the
    caller changes the originals."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: tensor_copies(value) for key, value in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(tensor_copies(value) for value in obj)
    return obj


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of `tensors` is finite (one host sync). A tensor's sum is finite only if all its
    elements are, and summing is ~10x cheaper than an elementwise isfinite per tensor; a sum that overflows
    (finite elements near the float limit) is settled by the exact check."""
    sums = torch.stack([t.sum(dtype=torch.float32) for t in tensors])
    if bool(torch.isfinite(sums).all()):
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def data_source_fields(data_source: Optional[dict]) -> dict:
    """The checkpoint's record of where its samples came from (data.sources.DataSources.identity)."""
    return {"data_source": dict(data_source)} if data_source else {}
