"""The training step's pieces: erasing and mixing of one micro-batch, its forward and backward through the run's
objective, and the update that ends an accumulation window (unscale, gradient norm and clipping, the non-finite
decision, optimizer step, EMA, LR schedule). The epoch (`training.loop`) calls them in that order; the step
keeps no state between calls.

`build_train_step` is the one way to assemble it; the trainer, the batch-size finder, `benchmark.py` and
the tests all use it, so what they time or check is what training runs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
from timm.utils import unwrap_model

from imgcls.objectives.base import Objective
from imgcls.runtime.device import DeviceInput
from imgcls.runtime.distributed import all_ranks_true
from imgcls.tasks import task_of
from imgcls.training.mixing import BatchMixing
from imgcls.training.optim import base_lr, build_optimizer, update_carries_nonfinite
from imgcls.training.schedule import build_scheduler, observe_epoch, schedule_from_config, window_length
from imgcls.runtime.memory import explain_out_of_memory


@dataclass
class WindowUpdate:
    """What the end of an accumulation window did."""

    skipped: bool                        # no optimizer step (fp16 overflow, or train.nonfinite=skip)
    window_ok: torch.Tensor              # device bool: loss and gradients finite (agreed over ranks)
    grad_norm: Optional[torch.Tensor]    # device scalar, when it was computed
    lr_used: float                       # the LR this step ran with (the scheduler has moved on since)


@dataclass
class TrainStep:
    model: torch.nn.Module               # what runs forward (DDP- and compile-wrapped where set)
    objective: Objective                 # the loss of a micro-batch (objectives/)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    input: DeviceInput
    accum_steps: int = 1
    clip_grad_norm: Optional[float] = None
    nonfinite: str = "stop"              # train.nonfinite: stop | skip
    max_nonfinite_in_row: int = 10
    distributed: bool = False
    ema: Optional[torch.nn.Module] = None  # models.ema.create_ema(bare model), updated after applied steps
    mixing: Optional[BatchMixing] = None   # data.random_erasing, mixup / CutMix (None: all off)
    nonfinite_reaches_weights: bool = True  # a non-finite gradient makes the optimizer's update non-finite

    @property
    def fp16(self) -> bool:
        return self.input.amp_dtype == torch.float16

    @property
    def watches_nonfinite(self) -> bool:
        """The run stops at the first non-finite step (under fp16 the GradScaler skips such steps instead)."""
        return self.nonfinite == "stop" and not self.fp16

    @property
    def checks_gradients(self) -> bool:
        """Whether every step checks its gradients for non-finite values before the update (their norm, a pass
        over all gradients). train.nonfinite=skip must, to skip the right update. Under `stop` with an
        optimizer whose update carries a non-finite gradient into the weights, the loss check suffices: the
        next step's loss is non-finite, the run stops there, and no save takes non-finite weights. Lion steps
        by the sign (sign(nan) = 0): its weights stay finite while its state does not, so it is checked every
        step. Under fp16 the GradScaler checks."""
        if self.fp16:
            return False
        return self.nonfinite == "skip" or not self.nonfinite_reaches_weights

    def mix(self, images: torch.Tensor, labels: torch.Tensor, epoch: int, step_number: int, micro: int):
        """Erase and mix micro-batch `micro` of optimizer step `step_number` (the draws are a function of
        the seed, the step and `micro`); (images, labels) unchanged when both are off."""
        if self.mixing is None:
            return images, labels
        return self.mixing(images, labels, epoch, step_number, micro)

    def forward_backward(self, images: torch.Tensor, targets: torch.Tensor, window: int,
                         sync_gradients: bool) -> tuple[torch.Tensor, dict]:
        """Loss of one micro-batch (detached) and the objective's logs; its gradient, divided by the window
        length, is accumulated. Under DDP the gradient all-reduce runs only on the window's last micro-batch."""
        no_sync = self.distributed and not sync_gradients
        with explain_out_of_memory(self.model, self.optimizer, images.shape[0], self.input.device), \
                self.model.no_sync() if no_sync else contextlib.nullcontext():
            with self.input.autocast():
                loss, logs = self.objective(self.model, images, targets)
            self.scaler.scale(loss / window).backward()
        return loss.detach(), logs

    def update(self, window_ok: torch.Tensor, step_number: int, want_norm: bool) -> WindowUpdate:
        """End the accumulation window as optimizer step `step_number` (from 1); `window_ok` (a device bool)
        says whether its losses were finite. No host sync except where a skip must be decided on the host
        (fp16, or train.nonfinite=skip)."""
        grad_norm = None
        self.objective.end_window(self.distributed)
        if self.clip_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
            window_ok = window_ok & torch.isfinite(grad_norm)
        if grad_norm is None and (want_norm or self.checks_gradients):
            # Also the non-finite check of the gradients (a finite loss can still give inf gradients); it
            # stays on the device.
            self.scaler.unscale_(self.optimizer)
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
            window_ok = window_ok & torch.isfinite(grad_norm)
        if self.distributed and not self.fp16:  # under fp16 the GradScaler decides
            # a loss that is non-finite on one rank only: every rank must skip (or stop at) this step
            window_ok = all_ranks_true(window_ok)
        skipped = self._apply_update(window_ok)
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None and not skipped:
            self.ema.update(unwrap_model(self.model), step=step_number)
        lr_used = base_lr(self.optimizer)
        self.scheduler.step()
        return WindowUpdate(skipped, window_ok, grad_norm, lr_used)

    def end_epoch(self, value: float, metric: str) -> bool:
        """The epoch's validation `metric` for `schedule.name=plateau`; True when the LR decayed."""
        return observe_epoch(self.scheduler, value, metric)

    def _apply_update(self, window_ok: torch.Tensor) -> bool:
        """Step the optimizer; True when the step was skipped (fp16 overflow or nonfinite: skip)."""
        scaler = self.scaler
        if scaler.is_enabled():
            scale_before = scaler.get_scale()
            scaler.step(self.optimizer)
            scaler.update()
            return scaler.get_scale() < scale_before
        if self.nonfinite == "skip" and not bool(window_ok):
            return True
        self.optimizer.step()
        return False


@dataclass(frozen=True)
class LRPlan:
    """The LR a step runs with: `peak_lr` after `warmup_steps`, scheduled over `total_steps` (None: constant,
    what measuring a step needs); `steps_per_epoch` converts the schedule's epochs to steps. A RunPlan is one."""

    peak_lr: float
    warmup_steps: int = 0
    total_steps: Optional[int] = None
    steps_per_epoch: int = 1


def build_train_step(cfg, model: torch.nn.Module, device_input: DeviceInput, lr: LRPlan | float, *,
                     train_model: Optional[torch.nn.Module] = None, ema: Optional[torch.nn.Module] = None,
                     dist=None, accum_steps: Optional[int] = None, num_classes: Optional[int] = None,
                     objective: Optional[Objective] = None) -> TrainStep:
    """The optimizer, LR schedule, GradScaler, objective and batch mixing of `cfg` around `model` (the bare
    model, whose parameters are optimized). `lr` a number: constant. `train_model` is what runs forward (a DDP
    or compiled wrapper; default `model`); `dist` the process group's facts (None: one process);
    `accum_steps` None: `cfg`'s. `num_classes` is needed when mixing is on; `objective` None: the task's loss."""
    lr = LRPlan(lr) if isinstance(lr, (int, float)) else lr
    peak_lr, warmup_steps, total_steps = lr.peak_lr, lr.warmup_steps, lr.total_steps
    distributed, rank = (dist.enabled, dist.rank) if dist is not None else (False, 0)
    optimizer = build_optimizer(model, cfg.optim, peak_lr, fused=cfg.model.freeze is None)
    objective = objective if objective is not None else Objective(task_of(cfg).criterion(cfg.train))
    if objective.parameters():  # an objective's own trained parameters (distill.type=feature's projection)
        optimizer.add_param_group({"params": objective.parameters(), "lr": peak_lr, "lr_scale": 1.0,
                                   "weight_decay": cfg.optim.weight_decay})
    if total_steps is None:
        scheduler = build_scheduler(optimizer, 0, 1, 1.0, 1.0)
    else:
        schedule = schedule_from_config(cfg.schedule, warmup_steps, total_steps, lr.steps_per_epoch,
                                        cfg.schedule.min_lr / peak_lr)
        scheduler = build_scheduler(optimizer, warmup_steps, total_steps, cfg.schedule.warmup_start_factor,
                                    cfg.schedule.min_lr / peak_lr, schedule)
    scaler = torch.amp.GradScaler(device_input.device.type, enabled=device_input.amp_dtype == torch.float16)
    mixing = BatchMixing.from_config(cfg, num_classes or 0, rank)
    if mixing is not None and mixing.mixes and not num_classes:
        raise ValueError("build_train_step: mixup / CutMix need num_classes")
    t = cfg.train
    return TrainStep(model=train_model if train_model is not None else model, objective=objective,
                     optimizer=optimizer, scheduler=scheduler, scaler=scaler, input=device_input,
                     accum_steps=t.accum_steps if accum_steps is None else accum_steps,
                     clip_grad_norm=t.clip_grad_norm, nonfinite=t.nonfinite,
                     max_nonfinite_in_row=t.max_nonfinite_in_row, distributed=distributed, ema=ema, mixing=mixing,
                     nonfinite_reaches_weights=update_carries_nonfinite(cfg.optim))
