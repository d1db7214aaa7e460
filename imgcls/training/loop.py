"""One training epoch, read top to bottom like torchvision's `train_one_epoch` and nanoGPT's loop: for each
optimizer step, an inner loop over its micro-batches (fetch, prepare on the device, erase and mix, forward
and backward through the objective), then the update, the log line, the mid-epoch save and the stop check,
in that order. What it writes to and asks are the run's parts (`EpochParts`), never its caller.

The running sums stay on the device; the host reads them only at log lines, checkpoints and the epoch
end (and once per step where fp16 or `train.nonfinite: skip` must decide on the host whether to skip).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol

import torch

from imgcls.core.errors import NonFiniteError, StopRequested
from imgcls.training.schedule import window_length
from imgcls.training.state import EpochCounters, TrainState
from imgcls.training.step import TrainStep, WindowUpdate


class StepLog(Protocol):
    def batch_done(self) -> None: ...
    def log_step(self, step: int, values: dict) -> None: ...


class ProgressSaves(Protocol):
    def due(self, step: int) -> bool: ...
    def save(self, state: TrainState, snapshot: dict) -> None: ...


class StopCheck(Protocol):
    def requested(self, step: int) -> bool: ...


class Silent:
    """A log, saves and a stop check that do nothing: for measuring steps."""

    def batch_done(self) -> None:
        pass

    def log_step(self, step: int, values: dict) -> None:
        pass

    def due(self, step: int) -> bool:
        return False

    def save(self, state: TrainState, snapshot: dict) -> None:
        pass

    def requested(self, step: int) -> bool:
        return False


@dataclass(frozen=True)
class EpochParts:
    """Where an epoch's step lines go, where its mid-epoch saves go, and what says stop."""

    log: StepLog
    saves: ProgressSaves
    stop: StopCheck
    log_interval: int = 10**9
    log_epoch_end: bool = True  # also log each epoch's last step, however short the epoch

    def logs_at(self, step: int, epoch_end: bool = False) -> bool:
        return step % self.log_interval == 0 or (epoch_end and self.log_epoch_end)


class Measuring(Silent):
    """The parts of a measuring run (tune.py's sweeps): each step line goes to `on_step(step, values)`, and
    the run stops where `stop_when(step)` says; nothing is saved."""

    def __init__(self, on_step: Optional[Callable[[int, dict], None]] = None,
                 stop_when: Optional[Callable[[int], bool]] = None):
        self.on_step, self.stop_when = on_step, stop_when

    def log_step(self, step: int, values: dict) -> None:
        if self.on_step is not None:
            self.on_step(step, values)

    def requested(self, step: int) -> bool:
        return self.stop_when is not None and self.stop_when(step)


def measuring_parts(on_step: Optional[Callable[[int, dict], None]] = None,
                    stop_when: Optional[Callable[[int], bool]] = None, log_interval: int = 10**9) -> EpochParts:
    """Parts that never save: for measuring and tuning runs."""
    measuring = Measuring(on_step, stop_when)
    return EpochParts(measuring, measuring, measuring, log_interval, log_epoch_end=False)


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


def train_one_epoch(step: TrainStep, parts: EpochParts, batches, num_batches: int, state: TrainState,
                    counters: EpochCounters) -> None:
    """Train epoch `state.epoch` (0-based) from batch `counters.batches_done` to `num_batches`. `state.step`
    counts optimizer steps (applied or skipped), numbered from 1 as in the log lines ("step k/N")."""
    step.model.train()
    sums = EpochSums(step.input.device)
    meter = IntervalMeter(sums, counters)
    batches = iter(batches)
    while counters.batches_done < num_batches:
        number, first = state.step + 1, counters.batches_done
        window = window_length(first, num_batches, step.accum_steps)
        window_ok = torch.ones((), dtype=torch.bool, device=step.input.device)
        exhausted = False
        for micro in range(window):
            fetched = next_batch(batches, meter, counters)
            if fetched is None:  # a stream shorter than its announced length: the epoch ends here
                exhausted = True
                break
            images, targets = step.input.prepare(fetched[0]), step.input.labels(fetched[1])
            images, targets = step.mix(images, targets, state.epoch, number, micro)
            loss, logs = step.forward_backward(images, targets, window, sync_gradients=micro == window - 1)
            window_ok = window_ok & sums.add_loss(loss, images.shape[0])
            counters.samples += images.shape[0]
            meter.samples += images.shape[0]
            parts.log.batch_done()
        if exhausted:
            counters.batches_done = first + micro
            break
        batch_index = first + window
        log_now = parts.logs_at(number, epoch_end=batch_index == num_batches)
        update = step.update(window_ok, number, want_norm=log_now)
        if step.watches_nonfinite:
            sums.note_window(update.window_ok, number)
        # The step is done (applied or skipped) before the skip policy may stop the run, so the summary
        # counts it: "last at step k" is then steps_completed k.
        state.finish_step(number, update.skipped, counters, batch_index)
        if log_now:
            sums.raise_if_nonfinite()
            parts.log.log_step(number, meter.read(sums, update) | logs | step.objective.interval_logs())
        counters.stop_if_too_many_in_row(number, step.max_nonfinite_in_row)
        stop = parts.stop.requested(number)
        if stop or parts.saves.due(number):
            sums.raise_if_nonfinite()
            loss_sum, nonfinite = sums.read()
            parts.saves.save(state, counters.snapshot(extra_loss=loss_sum, extra_nonfinite=nonfinite))
            if stop:
                raise StopRequested()
    sums.raise_if_nonfinite()
    loss_sum, nonfinite = sums.read()
    counters.loss_sum += loss_sum
    counters.nonfinite_samples += nonfinite


def next_batch(batches: Iterator, meter: "IntervalMeter", counters: EpochCounters) -> Optional[tuple]:
    """The next (images, targets) from the loader, its wait counted; None when the loader is exhausted."""
    start = time.perf_counter()
    try:
        images, targets, replaced = next(batches)
    except StopIteration:
        return None
    waited = time.perf_counter() - start
    meter.data_time += waited
    counters.data_time += waited
    counters.note_unreadable(replaced)
    return images, targets
