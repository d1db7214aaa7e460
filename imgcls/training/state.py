"""The run's bookkeeping: `TrainState` (saved in last.pt) and `EpochCounters` (one epoch's totals, saved
mid-epoch so a resumed epoch reports the same totals)."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from imgcls.core.errors import NonFiniteError
from imgcls.tasks import best_record, deciding_metric, is_improvement
from imgcls.tasks.base import nonfinite_metrics

log = logging.getLogger(__name__)


@dataclass
class EpochCounters:
    """Totals of the epoch so far; `batches_done` is also where a resumed epoch starts."""

    batches_done: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    nonfinite_samples: int = 0  # samples of micro-batches whose loss was non-finite (left out of loss_sum)
    data_time: float = 0.0  # seconds this process waited for the loader
    skipped_steps: int = 0
    nonfinite_in_row: int = 0
    unreadable: set = field(default_factory=set)  # training-split indices of files that could not be read

    def note_unreadable(self, replaced: torch.Tensor) -> None:
        """`replaced` (CPU, from the loader): per sample the index of the unreadable file it stands in for, or -1."""
        if (replaced >= 0).any():
            self.unreadable.update(int(i) for i in replaced[replaced >= 0])

    def count_update(self, skipped: bool, step: int, batches_done: int) -> None:
        """After optimizer step `step`, which ended at batch `batches_done` (skipped or not): a skipped update
        is counted in the epoch's totals and logged."""
        self.batches_done = batches_done
        if not skipped:
            self.nonfinite_in_row = 0
            return
        self.skipped_steps += 1
        self.nonfinite_in_row += 1
        log.warning("step %d: non-finite loss or gradients, update skipped (%d in a row)", step, self.nonfinite_in_row)

    def stop_if_too_many_in_row(self, step: int, max_in_row: int) -> None:
        """NonFiniteError when `max_in_row` updates in a row were skipped (train.max_nonfinite_in_row)."""
        if self.nonfinite_in_row >= max_in_row:
            raise NonFiniteError(f"{self.nonfinite_in_row} optimizer steps in a row had non-finite loss or "
                                 f"gradients (last at step {step}); stopping (train.max_nonfinite_in_row)")

    def snapshot(self, extra_loss: float = 0.0, extra_nonfinite: int = 0) -> dict:
        """Plain data for last.pt, with the device-side sums not yet added (`extra_*`) included."""
        out = dataclasses.asdict(self)
        out["loss_sum"] = self.loss_sum + extra_loss
        out["nonfinite_samples"] = self.nonfinite_samples + extra_nonfinite
        out["unreadable"] = sorted(self.unreadable)
        return out

    def mean_loss(self) -> float:
        """The epoch's training loss over the samples whose loss was finite (NaN when none was)."""
        finite = self.samples - self.nonfinite_samples
        return self.loss_sum / finite if finite > 0 else float("nan")

    @classmethod
    def restore(cls, saved: dict) -> "EpochCounters":
        values = dict(saved)
        values["unreadable"] = set(values.get("unreadable", []))
        return cls(**values)


@dataclass
class TrainState:
    """Bookkeeping that goes into last.pt beside the model, optimizer, scheduler, scaler and RNG."""

    epoch: int = 0               # epochs completed
    step: int = 0                # optimizer steps done
    batch_in_epoch: int = 0      # batches of epoch `epoch` already consumed
    best_value: Optional[float] = None
    best_epoch: int = 0
    best_metrics: dict = field(default_factory=dict)
    bad_epochs: int = 0
    stopped_early: bool = False
    skipped_files: list = field(default_factory=list)
    skipped_steps: int = 0       # optimizer steps skipped (non-finite), counted as they happen
    train_samples: int = 0
    train_time_s: float = 0.0
    epoch_snapshot: dict = field(default_factory=dict)  # EpochCounters.snapshot() of a mid-epoch save, else {}

    def finish_step(self, step: int, skipped: bool, counters: EpochCounters, batches_done: int) -> None:
        """Optimizer step `step` is done (applied, or `skipped`), ending at batch `batches_done` of the epoch."""
        self.step = step
        self.skipped_steps += int(skipped)
        counters.count_update(skipped, step, batches_done)

    def save_mid_epoch(self, snapshot: dict) -> None:
        """A save inside epoch `epoch`: where it is and the epoch's totals so far (EpochCounters.snapshot)."""
        self.batch_in_epoch = snapshot["batches_done"]
        self.epoch_snapshot = snapshot

    def skip_files(self, paths: list[str]) -> None:
        """Training files found unreadable (each counted once)."""
        self.skipped_files.extend(p for p in paths if p not in self.skipped_files)

    def add_training(self, seconds: float, samples: int) -> None:
        """This process trained `samples` images in `seconds` (the epoch's training, or its resumed part)."""
        self.train_time_s += seconds
        self.train_samples += samples

    def finish_epoch(self) -> None:
        """Epoch `epoch` is trained and validated: the next starts at its first batch."""
        self.epoch, self.batch_in_epoch, self.epoch_snapshot = self.epoch + 1, 0, {}

    def record_validation(self, epoch: int, metrics: dict, metric: str, min_delta: float,
                          patience: Optional[int]) -> bool:
        """Best-metric and early-stopping bookkeeping after validating epoch `epoch` (0-based); True when it is
        the best so far (the caller saves best.pt). Patience counts validations; a validation with a non-finite
        number (a diverged model) is never the best; where `metric` is undefined for the split, the loss decides."""
        metric = deciding_metric(metrics, metric)
        improved = not nonfinite_metrics(metrics) and is_improvement(metrics[metric], self.best_value, metric,
                                                                     min_delta)
        if improved:
            self.best_value, self.best_epoch, self.bad_epochs = metrics[metric], epoch + 1, 0
            self.best_metrics = best_record(metrics)
        else:
            self.bad_epochs += 1
            if patience is not None and self.bad_epochs >= patience:
                self.stopped_early = True
        return improved

    @classmethod
    def from_saved(cls, saved: dict) -> "TrainState":
        """The state last.pt recorded."""
        return cls(**saved)

    def epoch_counters(self) -> EpochCounters:
        """The counters to continue the current epoch with (fresh at an epoch start)."""
        return EpochCounters.restore(self.epoch_snapshot) if self.batch_in_epoch else EpochCounters()
