"""One training epoch and one evaluation pass.

`train_one_epoch` reads top to bottom like torchvision's reference loop: fetch, normalise on the
device, forward under autocast, scaled backward (divided by the accumulation window), and on update
steps unscale, clip, step, schedule. Running sums stay on the device; the host syncs only at log
lines, checkpoints and the epoch end (and once per step where fp16 or `train.nonfinite: skip` must
decide whether to skip).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from data.transforms import normalize_batch
from engine.checkpoint import unwrap
from engine.distributed import all_ranks_true
from engine.metrics import MetricSums
from engine.schedule import window_length

log = logging.getLogger("train")


class NonFiniteError(Exception):
    """Training produced a non-finite loss or gradient; the run stops keeping the last good checkpoint."""


class StopRequested(Exception):
    """A signal asked the run to save and stop."""


@dataclass
class StepContext:
    """Everything a training step needs, built once by the trainer."""

    model: torch.nn.Module
    criterion: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    device: torch.device
    amp_dtype: Optional[torch.dtype]
    mean: list
    std: list
    channels_last: bool
    accum_steps: int
    clip_grad_norm: Optional[float]
    nonfinite: str
    max_nonfinite_in_row: int
    distributed: bool
    ema: Optional[torch.nn.Module] = None  # models.ema.create_ema(bare model), updated after each applied step

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def prepare(self, images: torch.Tensor) -> torch.Tensor:
        images = images.to(self.device, non_blocking=True)
        return normalize_batch(images, self.mean, self.std, channels_last=self.channels_last)


@dataclass
class EpochProgress:
    """Counters that survive a mid-epoch checkpoint, so a resumed epoch reports the same totals."""

    batches_done: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    data_time: float = 0.0  # seconds this process waited for the loader
    skipped_steps: int = 0
    nonfinite_in_row: int = 0
    bad_indices: set = field(default_factory=set)


@dataclass
class StepHooks:
    """What the trainer does at optimizer-step boundaries (given the optimizer steps done so far)."""

    checkpoint_due: Callable[[int], bool]
    stop_requested: Callable[[int], bool]
    save: Callable[[EpochProgress], None]
    log_step: Callable[[int, dict], None]


def train_one_epoch(ctx: StepContext, loader, num_batches: int, start_batch: int, progress: EpochProgress,
                    state, hooks: StepHooks, log_interval: int, bar=None) -> None:
    model, optimizer, scaler = ctx.model, ctx.optimizer, ctx.scaler
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)
    first_nonfinite = torch.full((), -1, dtype=torch.int64, device=ctx.device)
    window_ok = torch.ones((), dtype=torch.bool, device=ctx.device)
    interval = {"samples": 0, "data_time": 0.0, "start": time.perf_counter(), "loss": loss_sum.clone()}

    batch_index = start_batch
    data_start = time.perf_counter()
    for images, targets, bad in loader:
        if batch_index >= num_batches:
            break
        waited = time.perf_counter() - data_start
        interval["data_time"] += waited
        progress.data_time += waited
        if (bad >= 0).any():
            progress.bad_indices.update(int(b) for b in bad[bad >= 0])
        images = ctx.prepare(images)
        targets = targets.to(ctx.device, non_blocking=True)
        window = window_length(batch_index, num_batches, ctx.accum_steps)
        is_update = (batch_index + 1) % ctx.accum_steps == 0 or batch_index + 1 == num_batches

        sync_context = model.no_sync() if ctx.distributed and not is_update else contextlib.nullcontext()
        with sync_context:
            with ctx.autocast():
                logits = model(images)
                loss = ctx.criterion(logits, targets)
            scaler.scale(loss / window).backward()

        batch = targets.shape[0]
        detached = loss.detach()
        finite = torch.isfinite(detached)
        # A skipped step's NaN must not poison the epoch's mean loss.
        loss_sum += torch.where(finite, detached.double(), 0.0) * batch
        window_ok &= finite
        progress.samples += batch
        interval["samples"] += batch
        batch_index += 1
        if bar is not None:
            bar.update(1)

        if is_update:
            grad_norm = None
            if ctx.clip_grad_norm is not None:
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), ctx.clip_grad_norm)
                window_ok &= torch.isfinite(grad_norm)
            logging_now = (state.step + 1) % log_interval == 0
            if grad_norm is None and (logging_now or ctx.amp_dtype != torch.float16):
                # Also the non-finite check of the gradients (a finite loss can still give inf gradients);
                # it stays on the device. Under fp16 the GradScaler does that check itself.
                scaler.unscale_(optimizer)
                grad_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
                window_ok &= torch.isfinite(grad_norm)

            if ctx.distributed and ctx.amp_dtype != torch.float16:  # under fp16 the GradScaler decides
                # a loss that is non-finite on one rank only: every rank must skip (or stop at) this step
                window_ok = all_ranks_true(window_ok)
            skipped = _apply_update(ctx, window_ok)
            optimizer.zero_grad(set_to_none=True)
            if ctx.ema is not None and not skipped:
                ctx.ema.update(unwrap(model), step=state.step + 1)
            lr_used = optimizer.param_groups[0]["lr"]  # logged: the LR this step ran with, not the next one
            ctx.scheduler.step()
            if ctx.nonfinite == "stop" and ctx.amp_dtype != torch.float16:
                # Steps are numbered from 1 here, as in the log lines ("step k/N").
                first_nonfinite = torch.where(~window_ok & (first_nonfinite < 0), state.step + 1, first_nonfinite)
            _count_skips(ctx, progress, skipped, state.step + 1)
            window_ok = torch.ones((), dtype=torch.bool, device=ctx.device)
            state.step += 1
            progress.batches_done = batch_index

            if logging_now:
                _raise_if_nonfinite(first_nonfinite)
                now = time.perf_counter()
                elapsed = max(now - interval["start"], 1e-9)
                window_loss = (loss_sum - interval["loss"]).item() / max(interval["samples"], 1)
                hooks.log_step(state.step, {
                    "train/loss": window_loss,
                    "train/lr": lr_used,
                    "train/grad_norm": float(grad_norm) if grad_norm is not None else None,
                    "train/samples_per_s": interval["samples"] / elapsed,
                    "train/data_wait_frac": interval["data_time"] / elapsed,
                })
                interval = {"samples": 0, "data_time": 0.0, "start": now, "loss": loss_sum.clone()}
            stop = hooks.stop_requested(state.step)
            if stop or hooks.checkpoint_due(state.step):
                _raise_if_nonfinite(first_nonfinite)
                hooks.save(dataclasses.replace(progress, loss_sum=progress.loss_sum + loss_sum.item()))
                if stop:
                    raise StopRequested()
        data_start = time.perf_counter()

    _raise_if_nonfinite(first_nonfinite)
    progress.loss_sum += loss_sum.item()
    progress.batches_done = batch_index


def _apply_update(ctx: StepContext, window_ok: torch.Tensor) -> bool:
    """Step the optimizer; returns True when the step was skipped (fp16 overflow or nonfinite: skip)."""
    scaler = ctx.scaler
    if scaler.is_enabled():
        scale_before = scaler.get_scale()
        scaler.step(ctx.optimizer)
        scaler.update()
        return scaler.get_scale() < scale_before
    if ctx.nonfinite == "skip" and not bool(window_ok):
        return True
    ctx.optimizer.step()
    return False


def _count_skips(ctx: StepContext, progress: EpochProgress, skipped: bool, step: int) -> None:
    if not skipped:
        progress.nonfinite_in_row = 0
        return
    progress.skipped_steps += 1
    progress.nonfinite_in_row += 1
    log.warning("step %d: non-finite loss or gradients, update skipped (%d in a row)", step,
                progress.nonfinite_in_row)
    if progress.nonfinite_in_row >= ctx.max_nonfinite_in_row:
        raise NonFiniteError(f"{progress.nonfinite_in_row} optimizer steps in a row had non-finite loss or "
                             f"gradients (last at step {step}); stopping (train.max_nonfinite_in_row)")


def _raise_if_nonfinite(first_nonfinite: torch.Tensor) -> None:
    step = int(first_nonfinite)
    if step >= 0:
        raise NonFiniteError(f"non-finite loss or gradients at optimizer step {step}; the run stops and keeps "
                             f"the last good checkpoint (set train.nonfinite=skip to skip such steps, or lower "
                             f"optim.lr / set train.clip_grad_norm)")


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, device: torch.device, num_classes: int, mean, std,
             channels_last: bool, amp_dtype: Optional[torch.dtype], tta_flip: bool = False) -> tuple[MetricSums, list[int]]:
    """Sums over this rank's shard (call `sums.all_reduce()` under DDP). Returns the sums and the
    indices of files that could not be read (excluded, never substituted). A limit on the samples
    evaluated belongs to the loader's sampler (`build_eval_loader(limit_samples=...)`)."""
    was_training = model.training
    model.eval()
    sums = MetricSums(num_classes, device)
    bad: list[int] = []
    autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else contextlib.nullcontext()
    for images, targets, valid, indices in loader:
        if not bool(valid.all()):
            bad.extend(int(j) for j in indices[~valid])
        images = normalize_batch(images.to(device, non_blocking=True), mean, std, channels_last=channels_last)
        with autocast:
            logits = model(images).float()
            if tta_flip:
                # log of the mean of the two probabilities, in log space so it never underflows to -inf
                flipped = model(images.flip(3)).float()
                logits = torch.logsumexp(torch.stack([logits.log_softmax(1), flipped.log_softmax(1)]), 0) - math.log(2)
        sums.update(logits, targets.to(device, non_blocking=True), valid.to(device, non_blocking=True))
    model.train(was_training)
    return sums, bad
