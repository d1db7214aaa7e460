"""One training epoch, read top to bottom like torchvision's `train_one_epoch`: fetch, prepare on the
device, forward and backward (`TrainStep.accumulate`, which knows the accumulation window), and on the
last micro-batch of each window one call that finishes the update (`TrainStep.finish_window`).

The running sums stay on the device; the host reads them only at log lines, checkpoints and the epoch
end (and once per step where fp16 or `train.nonfinite: skip` must decide on the host whether to skip).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from core.errors import NonFiniteError, StopRequested
from rundir.state import EpochCounters
from training.step import TrainStep, WindowUpdate


@dataclass
class StepHooks:
    """What the caller does around optimizer steps (given the optimizer steps done so far)."""

    checkpoint_due: Callable[[int], bool]
    stop_requested: Callable[[int], bool]
    save: Callable[[dict], None]              # gets EpochCounters.snapshot() of the epoch so far
    log_step: Callable[[int, dict], None]
    log_interval: int = 10**9
    log_epoch_end: bool = True  # also log each epoch's last step, however short the epoch

    def logs_at(self, step: int, epoch_end: bool = False) -> bool:
        return step % self.log_interval == 0 or (epoch_end and self.log_epoch_end)


def no_hooks() -> StepHooks:
    """Hooks that never log, save or stop: for measuring steps."""
    return StepHooks(checkpoint_due=lambda step: False, stop_requested=lambda step: False,
                     save=lambda snapshot: None, log_step=lambda step, values: None, log_epoch_end=False)


class EpochSums:
    """Device-side running sums of an epoch: the loss over samples, the samples whose loss was non-finite,
    and the first non-finite step."""

    def __init__(self, device: torch.device):
        self.loss = torch.zeros((), dtype=torch.float64, device=device)
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=device)
        self.first_nonfinite = torch.full((), -1, dtype=torch.int64, device=device)

    def add_loss(self, loss: torch.Tensor, batch: int) -> torch.Tensor:
        """Add a micro-batch's mean loss; returns whether it was finite (a device bool). A skipped step's
        NaN must not poison the epoch's mean loss, so a non-finite loss adds 0 and its samples are counted
        apart (the mean is over the others)."""
        finite = torch.isfinite(loss)
        self.loss += torch.where(finite, loss.double(), 0.0) * batch
        self.nonfinite += (~finite).long() * batch
        return finite

    def read(self) -> tuple[float, int]:
        """(loss sum, non-finite samples) on the host: one sync."""
        loss, nonfinite = torch.stack([self.loss, self.nonfinite.double()]).tolist()
        return loss, int(nonfinite)

    def note_window(self, window_ok: torch.Tensor, step: int) -> None:
        self.first_nonfinite = torch.where(~window_ok & (self.first_nonfinite < 0), step, self.first_nonfinite)

    def raise_if_nonfinite(self) -> None:
        step = int(self.first_nonfinite)
        if step >= 0:
            raise NonFiniteError(f"non-finite loss or gradients at optimizer step {step}; the run stops and keeps "
                                 f"the last good checkpoint (set train.nonfinite=skip to skip such steps, or lower "
                                 f"optim.lr / set train.clip_grad_norm)")


class IntervalMeter:
    """Samples, data wait and loss since the last log line (the `MetricLogger.log_every` idea)."""

    def __init__(self, sums: EpochSums, counters: EpochCounters):
        self.counters = counters  # the epoch's skipped steps are counted there, once
        self.restart(sums)

    def restart(self, sums: EpochSums, now: Optional[float] = None) -> None:
        self.samples = 0
        self.skipped_at_start = self.counters.skipped_steps
        self.data_time = 0.0
        self.start = time.perf_counter() if now is None else now
        self.at_start = torch.stack([sums.loss, sums.nonfinite.double()])

    def read(self, sums: EpochSums, update: WindowUpdate) -> dict:
        """The values of a log line (one host sync), then a new interval starts. The loss is over the samples
        whose loss was finite: NaN when every step of the interval was skipped."""
        now = time.perf_counter()
        elapsed = max(now - self.start, 1e-9)
        loss, nonfinite = (torch.stack([sums.loss, sums.nonfinite.double()]) - self.at_start).tolist()
        finite = self.samples - int(nonfinite)
        values = {
            "train/loss": loss / finite if finite > 0 else float("nan"),
            "train/skipped_steps": self.counters.skipped_steps - self.skipped_at_start,
            "train/lr": update.lr_used,
            "train/grad_norm": float(update.grad_norm) if update.grad_norm is not None else None,
            "train/samples_per_s": self.samples / elapsed,
            "train/data_wait_frac": self.data_time / elapsed,
        }
        self.restart(sums, now)
        return values


def train_one_epoch(step: TrainStep, loader, num_batches: int, counters: EpochCounters, state,
                    hooks: StepHooks, on_batch: Optional[Callable[[], None]] = None) -> None:
    """Train from batch `counters.batches_done` to `num_batches`; `state.step` counts optimizer steps (applied
    or skipped), `state.skipped_steps` the skipped ones, and `state.epoch` is the epoch (0-based) being trained.
    `on_batch` runs after every micro-batch (a progress bar)."""
    step.model.train()
    step.start_epoch()
    sums = EpochSums(step.input.device)
    meter = IntervalMeter(sums, counters)
    batch_index = counters.batches_done
    data_start = time.perf_counter()
    for images, targets, replaced in loader:
        if batch_index >= num_batches:
            break
        waited = time.perf_counter() - data_start
        meter.data_time += waited
        counters.data_time += waited
        counters.note_unreadable(replaced)
        images, targets = step.input.prepare(images), step.input.labels(targets)

        loss, is_update = step.accumulate(images, targets, batch_index, num_batches, state.epoch, state.step + 1)

        batch = images.shape[0]
        sums.add_loss(loss, batch)
        counters.samples += batch
        meter.samples += batch
        batch_index += 1
        if on_batch is not None:
            on_batch()

        if is_update:
            number = state.step + 1  # steps are numbered from 1, as in the log lines ("step k/N")
            log_now = hooks.logs_at(number, epoch_end=batch_index == num_batches)
            update = step.finish_window(number, want_norm=log_now)
            if step.watches_nonfinite:
                sums.note_window(update.window_ok, number)
            # The step is done (applied or skipped) before the skip policy may stop the run, so the summary
            # counts it: "last at step k" is then steps_completed k.
            state.step = number
            counters.batches_done = batch_index
            counters.count_update(update.skipped, number, state)

            if log_now:
                sums.raise_if_nonfinite()
                hooks.log_step(state.step, meter.read(sums, update))
            counters.stop_if_too_many_in_row(number, step.max_nonfinite_in_row)
            stop = hooks.stop_requested(state.step)
            if stop or hooks.checkpoint_due(state.step):
                sums.raise_if_nonfinite()
                loss, nonfinite = sums.read()
                hooks.save(counters.snapshot(extra_loss=loss, extra_nonfinite=nonfinite))
                if stop:
                    raise StopRequested()
        data_start = time.perf_counter()

    sums.raise_if_nonfinite()
    loss, nonfinite = sums.read()
    counters.loss_sum += loss
    counters.nonfinite_samples += nonfinite
    counters.batches_done = batch_index
