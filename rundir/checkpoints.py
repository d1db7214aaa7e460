"""The checkpoint format of a training run, written and restored: what goes into last.pt and best.pt, and
loading last.pt's state back into the run. (What may change on resume, and the run directory's policy:
`rundir.resume`; reading a checkpoint back for eval.py / infer.py:
`model_files.checkpoint_files`.)

last.pt: `model` (the trained weights, a bare state_dict), `classes`, `config`, `preprocessing`, `epoch`,
`step`, `metrics`, and the training state: `batch_in_epoch`, `optimizer`, `scheduler`, `scaler`, `rng`,
`train_state`, `world_size`, under torchrun `elastic_run_id`, `data_fingerprint` (`data.fingerprint`), and with
EMA `model_ema`. Both record `data_source` (the data format, a `data.val_fraction` split's file lists, CSV lists'
digests), and with tracking on `tracking_run_id` (the tracking run --resume reopens and eval.py adds to). best.pt: the
evaluated weights (the EMA when on) under `model`, with the same metadata and no training state.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from core.config import Config
from core.errors import CheckpointError, DiskFullError, NonFiniteError
from model_files.checkpoint_files import preprocessing_record
from rundir.atomic_files import bare_state_dict, rng_state, save_atomic, set_rng_state
from rundir.restart import run_id_fields
from rundir.state import TrainState
from runtime.launcher import launch_info
from runtime.distributed import run_on_main
from tasks import task_of
from tracking.training import RUN_ID_KEY

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


@dataclass
class TrainingParts:
    """What last.pt saves and restores besides the bookkeeping."""

    model: torch.nn.Module           # the bare trained model
    eval_model: torch.nn.Module      # what validation runs and best.pt holds (the EMA when on)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    ema: Optional[torch.nn.Module] = None


class Checkpointer:
    """Writes last.pt (with last.prev.pt) and best.pt of a run; only rank 0 writes."""

    def __init__(self, run_dir: Path, is_main: bool, cfg: Config, classes: list[str], world_size: int,
                 parts: TrainingParts, data_source: Optional[dict] = None, fingerprint: Optional[dict] = None):
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self.cfg = cfg
        self.classes = classes
        self.world_size = world_size
        self.parts = parts
        self.data_source = data_source
        self.fingerprint = fingerprint  # data.listing.fingerprint.data_fingerprint of the run's splits
        self.saved_state: Optional[TrainState] = None  # what last.pt on disk holds (restored or last saved)
        self.tracking_run_id: Callable[[], Optional[str]] = lambda: None  # the tracking run, once it exists
        self.last_extras: Optional[Callable[[], dict]] = None  # more of last.pt (distillation: the teacher's record)

    def _common(self, weights: torch.nn.Module, state: TrainState, metrics: Optional[dict]) -> dict:
        return {"format_version": FORMAT_VERSION, "model": bare_state_dict(weights), "classes": list(self.classes),
                "config": self.cfg.to_dict(), "preprocessing": preprocessing_record(self.cfg),
                "epoch": state.epoch, "step": state.step, "metrics": dict(metrics or {}),
                # the CPU threads the run computed with: a resume, eval.py and infer.py take the same by
                # default, since sums over another thread count round differently in the last digits
                "threads": torch.get_num_threads(), **data_source_fields(self.data_source),
                **({RUN_ID_KEY: run_id} if (run_id := self.tracking_run_id()) else {})}

    def last_contents(self, state: TrainState) -> dict:
        p = self.parts
        ckpt = self._common(p.model, state, None)
        ckpt.update({"batch_in_epoch": state.batch_in_epoch, "optimizer": p.optimizer.state_dict(),
                     "scheduler": p.scheduler.state_dict(), "scaler": p.scaler.state_dict(), "rng": rng_state(),
                     "train_state": dataclasses.asdict(state), "world_size": self.world_size,
                     **run_id_fields(launch_info())})
        if self.fingerprint is not None:
            ckpt["data_fingerprint"] = self.fingerprint
        if p.ema is not None:
            # A bare state_dict, like `model`, so timm's load_checkpoint(use_ema=True) also reads it.
            ckpt["model_ema"] = bare_state_dict(p.ema.module)
        if self.last_extras is not None:
            ckpt.update(self.last_extras())
        return ckpt

    def best_contents(self, state: TrainState, metrics: dict) -> dict:
        return self._common(self.parts.eval_model, state, metrics) | task_of(self.cfg).model_file_extras(metrics)

    def save_last(self, state: TrainState) -> None:
        """Call on every rank at the same point: all agree on refusing non-finite weights, and all stop when
        rank 0 finds the disk full."""
        self.refuse_nonfinite("last.pt", state.step)
        run_on_main(self.is_main, lambda: save_atomic(self.last_contents(state), self.run_dir / "last.pt",
                                                      keep_previous=True), shared=(DiskFullError,))
        self.saved_state = TrainState(**dataclasses.asdict(state))

    def save_best(self, state: TrainState, metrics: dict) -> None:
        self.refuse_nonfinite("best.pt", state.step)
        run_on_main(self.is_main, lambda: save_atomic(self.best_contents(state, metrics), self.run_dir / "best.pt"),
                    shared=(DiskFullError,))

    def refuse_nonfinite(self, name: str, step: int) -> None:
        """Non-finite weights are never saved: the file keeps the last good state."""
        tensors = [t for t in (*self.parts.model.parameters(), *self.parts.model.buffers()) if t.is_floating_point()]
        if tensors and not all_finite(tensors):
            raise NonFiniteError(f"the weights became non-finite by optimizer step {step}; {name} was not "
                                 f"written and keeps the last good state (lower optim.lr or set train.clip_grad_norm)")

    def restore(self, ckpt: dict) -> TrainState:
        """Load last.pt's weights, optimizer, scheduler, scaler and RNG into the run; returns its state.
        A part that does not load (a damaged or foreign file that `check_resume_compatible` let through)
        is a CheckpointError (exit 2) naming it."""
        p = self.parts
        parts = [("model", lambda: p.model.load_state_dict(ckpt["model"])),
                 ("model_ema", lambda: p.ema is None or p.ema.module.load_state_dict(ckpt["model_ema"])),
                 ("optimizer", lambda: p.optimizer.load_state_dict(ckpt["optimizer"])),
                 ("scheduler", lambda: p.scheduler.load_state_dict(ckpt["scheduler"])),
                 ("scaler", lambda: p.scaler.load_state_dict(ckpt["scaler"])),
                 ("rng", lambda: set_rng_state(ckpt["rng"]))]
        for name, load in parts:
            try:
                load()
            except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as err:
                reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
                raise CheckpointError(f"--resume: the checkpoint's '{name}' does not load into this run "
                                      f"({type(err).__name__}: {reason}); the file is damaged or was not "
                                      f"written by this train.py") from err
        state = TrainState.from_saved(ckpt["train_state"])
        self.saved_state = TrainState(**dataclasses.asdict(state))
        log.info("resumed at epoch %d, batch %d, optimizer step %d", state.epoch + 1, state.batch_in_epoch, state.step)
        return state


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of `tensors` is finite (one host sync). A tensor's sum is finite only if all its
    elements are, and summing is ~10x cheaper than an elementwise isfinite per tensor; a sum that overflows
    (finite elements near the float limit) is settled by the exact check."""
    sums = torch.stack([t.sum(dtype=torch.float32) for t in tensors])
    if bool(torch.isfinite(sums).all()):
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


def data_source_fields(data_source: Optional[dict]) -> dict:
    """The checkpoint's record of where its samples came from (data.listing.sources.DataSources.identity)."""
    return {"data_source": dict(data_source)} if data_source else {}

