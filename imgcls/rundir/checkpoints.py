"""The checkpoint format of a training run, written and restored: what goes into last.pt and best.pt, and
loading last.pt's state back into the run. (What may change on resume, and the run directory's policy:
`rundir.resume`; reading a checkpoint back for eval.py / infer.py:
`model_files.checkpoint_files`.)

last.pt: `model` (the trained weights, a bare state_dict), `classes`, `config`, `preprocessing`, `epoch`,
`step`, `metrics`, and the training state: `batch_in_epoch`, `optimizer`, `scheduler`, `scaler`, `rng`,
`train_state`, `world_size`, under torchrun `elastic_run_id`, `data_fingerprint` (`data.fingerprint`), and with
EMA `model_ema`, distilled `distill`. Both record `data_source` (the data format, a `data.val_fraction` split's file lists, CSV lists'
digests), and with tracking on `tracking_run_id` (the tracking run --resume reopens and eval.py adds to). best.pt: the
evaluated weights (the EMA when on) under `model`, with the same metadata and no training state.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol

import torch

from imgcls.core.config import Config
from imgcls.core.errors import CheckpointError, DiskFullError, NonFiniteError
from imgcls.model_files.checkpoint_files import preprocessing_record
from imgcls.rundir.atomic_files import bare_state_dict, rng_state, save_atomic, set_rng_state
from imgcls.rundir.state import TrainState
from imgcls.runtime.distributed import run_on_main
from imgcls.tasks import task_of

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
    fingerprint: Optional[dict] = None  # data.listing.fingerprint.data_fingerprint of the run's splits


class Checkpointer:
    """Writes last.pt (with last.prev.pt) and best.pt of a run and restores last.pt; only rank 0 writes.
    Everything resumable is a part in `states` (name -> `state_dict` / `load_state_dict`), saved under its
    name and restored through the same pair; a part whose `state_dict` is None is left out. `optional` names
    parts a checkpoint may lack. best.pt holds `best_model`'s weights (the EMA when on) and the parts in
    `best_states`, with no training state."""

    def __init__(self, run_dir: Path, is_main: bool, record: RunRecord, states: dict[str, Stateful],
                 best_model: torch.nn.Module, best_states: tuple[str, ...] = (), optional: tuple[str, ...] = ()):
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self.record = record
        self.states = states
        self.best_model = best_model
        self.best_states = best_states
        self.optional = optional
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
        return (self._common(bare_state_dict(self.best_model), state, metrics) | self._parts(self.best_states)
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

    def start_best(self, state: TrainState, metrics: dict, after: Optional["PendingSave"] = None,
                   hold: bool = False) -> "PendingSave":
        """best.pt (`best_contents`), written as start_last writes last.pt; with `hold`, the PendingSave keeps the
        copy written (`contents`, rank 0's) for a caller that will rewrite the file."""
        self.refuse_nonfinite("best.pt", state.step)
        return self._start(lambda: self.best_contents(state, metrics), "best.pt", False, after, hold=hold)

    def _start(self, contents: Callable[[], dict], name: str, keep_previous: bool, after: Optional["PendingSave"],
               on_whole: Callable[[], None] = lambda: None, hold: bool = False) -> "PendingSave":
        def begin() -> tuple[BackgroundSave, dict]:
            copies = tensor_copies(contents())
            return BackgroundSave(copies, self.run_dir / name, keep_previous, after.writer if after else None), copies

        writer, copies = run_on_main(self.is_main, begin) or (None, None)
        return PendingSave(name, writer, self.is_main, on_whole, contents=copies if hold else None)

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
    raised on every rank. `contents`: what is written, when the starter asked to hold it (rank 0; else None)."""

    def __init__(self, name: str, writer: Optional[BackgroundSave], is_main: bool,
                 on_whole: Callable[[], None] = lambda: None, contents: Optional[dict] = None):
        self.name, self.writer, self.is_main, self.on_whole = name, writer, is_main, on_whole
        self.contents = contents

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
    """The checkpoint's record of where its samples came from (data.listing.sources.registry.DataSources.identity)."""
    return {"data_source": dict(data_source)} if data_source else {}

