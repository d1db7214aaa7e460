"""Pure functions for batch arithmetic and the learning-rate schedule: a linear warmup, then cosine, step,
multistep, poly, constant or plateau decay, stepped per optimizer step (plateau decays at epoch ends)."""
from __future__ import annotations

import bisect
import logging
import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from imgcls.core.errors import ConfigError
from imgcls.tasks import is_improvement

log = logging.getLogger(__name__)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def effective_batch(batch_size: int, accum_steps: int, world_size: int) -> int:
    return batch_size * accum_steps * world_size


def scaled_lr(lr: float, effective: int, base_batch_size: int, rule: str) -> float:
    """Peak LR for an effective batch, given `lr` at `base_batch_size`."""
    ratio = effective / base_batch_size
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    if rule == "none":
        return lr
    raise ValueError(f"unknown lr scaling rule {rule!r}")


def steps_per_epoch(batches_per_epoch: int, accum_steps: int) -> int:
    """Optimizer steps in an epoch; a shorter last accumulation window still makes a step."""
    return math.ceil(batches_per_epoch / accum_steps)


def window_length(batch_index: int, batches_per_epoch: int, accum_steps: int) -> int:
    """How many micro-batches the accumulation window holding `batch_index` has (the last may be short)."""
    start = (batch_index // accum_steps) * accum_steps
    return min(accum_steps, batches_per_epoch - start)


def warmup_steps(warmup_epochs: float, steps_in_epoch: int) -> int:
    """Warmup length in optimizer steps, rounded half up; any warmup asked for lasts at least one step."""
    if warmup_epochs <= 0:
        return 0
    return max(1, math.floor(warmup_epochs * steps_in_epoch + 0.5))


def epochs_to_steps(epochs: float, steps_in_epoch: int) -> int:
    """A (fractional) epoch count in optimizer steps, rounded half up."""
    return math.floor(epochs * steps_in_epoch + 0.5)


def warmup_factor(step: int, warmup: int, start_factor: float = 0.0) -> float:
    """Linear warmup from `start_factor`: step `warmup - 1` is one increment short of the peak."""
    return start_factor + (1.0 - start_factor) * (step + 1) / (warmup + 1)


def decay_progress(step: int, warmup: int, total: int) -> float:
    """How far step `step` is through the decay after the warmup: 0 at its first step, 1 at `total`."""
    return min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))


def lr_factor(step: int, warmup: int, total: int, start_factor: float = 0.0, min_ratio: float = 0.0) -> float:
    """Multiplier of the peak LR for optimizer step `step` (0-based; the LR used by that step).

    Linear warmup from `start_factor` over `warmup` steps reaching 1.0 at step `warmup`, then a cosine
    from 1.0 down to `min_ratio` at step `total`.
    """
    if warmup > 0 and step < warmup:
        return warmup_factor(step, warmup, start_factor)
    progress = decay_progress(step, warmup, total)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def poly_factor(step: int, warmup: int, total: int, power: float, min_ratio: float = 0.0) -> float:
    """After the warmup: (1 - progress) ** power from 1.0 down to `min_ratio` at step `total`."""
    return min_ratio + (1.0 - min_ratio) * (1.0 - decay_progress(step, warmup, total)) ** power


def step_decay_factor(step: int, period: int, gamma: float) -> float:
    """x gamma every `period` steps, counted from the run's first step (torch's StepLR, per step)."""
    return gamma ** (step // period)


def multistep_factor(step: int, milestones: list[int], gamma: float) -> float:
    """x gamma at each milestone (in steps from the run's start) that `step` has reached (MultiStepLR)."""
    return gamma ** bisect.bisect_right(milestones, step)


@dataclass
class LrSchedule:
    """The `LambdaLR` lambda: warmup, then `name`'s decay. Its fields are plain numbers and lists (the
    plateau state too), so `LambdaLR.state_dict()` saves the whole schedule in last.pt and a resume
    continues it exactly. Milestones, the step period and the plateau patience are in optimizer steps /
    epochs as documented per field."""

    warmup: int
    total: int
    start_factor: float = 0.0
    min_ratio: float = 0.0
    name: str = "cosine"
    milestones: list = field(default_factory=list)  # multistep: optimizer steps
    period: int = 1                                 # step: optimizer steps between decays
    gamma: float = 0.1
    power: float = 1.0
    patience: int = 10                              # plateau: bad epochs before a decay
    reductions: int = 0                             # plateau state: decays so far
    best: Optional[float] = None                    # plateau state: best metric after the warmup
    bad_epochs: int = 0                             # plateau state

    def __call__(self, step: int) -> float:
        if self.warmup > 0 and step < self.warmup:
            return warmup_factor(step, self.warmup, self.start_factor)
        if self.name == "cosine":
            return lr_factor(step, self.warmup, self.total, self.start_factor, self.min_ratio)
        if self.name == "poly":
            return poly_factor(step, self.warmup, self.total, self.power, self.min_ratio)
        if self.name == "constant":
            return 1.0
        if self.name == "step":
            factor = step_decay_factor(step, self.period, self.gamma)
        elif self.name == "multistep":
            factor = multistep_factor(step, self.milestones, self.gamma)
        else:  # plateau
            factor = self.gamma ** self.reductions
        return max(self.min_ratio, factor)

    def observe(self, value: float, metric: str, steps_done: int) -> bool:
        """plateau: an epoch ended with `metric` = `value`; True when the LR decays. Epochs that end within
        the warmup are not counted."""
        if self.name != "plateau" or steps_done <= self.warmup:
            return False
        if is_improvement(value, self.best, metric, 0.0):
            self.best, self.bad_epochs = value, 0
            return False
        self.bad_epochs += 1
        if self.bad_epochs < self.patience:
            return False
        self.reductions, self.bad_epochs = self.reductions + 1, 0
        return True


def schedule_from_config(sched_cfg, warmup: int, total: int, steps_in_epoch: int, min_ratio: float) -> LrSchedule:
    """`schedule.*` in optimizer steps (fractional epochs converted like the warmup)."""
    s = sched_cfg
    return LrSchedule(warmup, total, s.warmup_start_factor, min_ratio, s.name,
                      [epochs_to_steps(m, steps_in_epoch) for m in s.milestones],
                      max(1, epochs_to_steps(s.step_epochs, steps_in_epoch)), s.gamma, s.power, s.plateau_patience)


def build_scheduler(optimizer: torch.optim.Optimizer, warmup: int, total: int, start_factor: float,
                    min_ratio: float, schedule: Optional[LrSchedule] = None) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR stepped once per optimizer step; `schedule` None: warmup then cosine."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule or LrSchedule(warmup, total, start_factor, min_ratio))


def observe_epoch(scheduler: torch.optim.lr_scheduler.LambdaLR, value: float, metric: str) -> bool:
    """plateau: feed the epoch's validation metric; on a decay the optimizer's LR changes now, before the
    next step (LambdaLR would only apply it at its next step()). True when the LR decayed."""
    schedule = scheduler.lr_lambdas[0]
    if not schedule.observe(value, metric, scheduler.last_epoch):
        return False
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs
    return True


def validation_due(epochs_done: int, epochs: int, val_interval: int) -> bool:
    """Validate after every `val_interval`-th epoch and always after the last one."""
    return epochs_done % val_interval == 0 or epochs_done == epochs


@dataclass
class RunPlan:
    """The run's batch and step arithmetic, fixed at start-up (the start-up line prints it)."""

    batch_size: int            # per process
    accum_steps: int
    world_size: int
    batches_per_epoch: int     # per process, after data.limit_train_batches
    effective_batch: int
    peak_lr: float
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int


def plan_run(cfg, batch_size: int, batches_in_split: int, world_size: int) -> RunPlan:
    """RunPlan for `cfg` at a per-process `batch_size` whose sampler yields `batches_in_split` batches.
    ConfigError (exit 2) when `schedule.min_lr` lies above the scaled peak LR."""
    batches = min(batches_in_split, cfg.data.limit_train_batches or batches_in_split)
    accum = cfg.train.accum_steps
    if accum > batches:
        # A window longer than the epoch would end at the epoch's last batch anyway: say what happens.
        log.warning("train.accum_steps=%d is more than the %d batches of an epoch; accumulating %d instead "
                    "(one optimizer step per epoch, effective batch %d)", accum, batches, batches,
                    effective_batch(batch_size, batches, world_size))
        accum = batches
    effective = effective_batch(batch_size, accum, world_size)
    peak = scaled_lr(cfg.optim.lr, effective, cfg.optim.base_batch_size, cfg.optim.lr_scaling)
    if cfg.schedule.min_lr > peak:
        raise ConfigError(f"'schedule.min_lr' = {cfg.schedule.min_lr} is above the peak LR {peak:.6g} "
                          f"(optim.lr {cfg.optim.lr} with {cfg.optim.lr_scaling} scaling to effective batch "
                          f"{effective}); lower schedule.min_lr")
    per_epoch = steps_per_epoch(batches, accum)
    total = per_epoch * cfg.train.epochs
    warmup = min(warmup_steps(cfg.schedule.warmup_epochs, per_epoch), total)
    return RunPlan(batch_size, accum, world_size, batches, effective, peak, per_epoch, total, warmup)


def schedule_warnings(cfg, plan: RunPlan) -> list[str]:
    """What a schedule that cannot do what it says will actually do (train.py logs each at start-up)."""
    s, epochs, total, warmup = cfg.schedule, cfg.train.epochs, plan.total_steps, plan.warmup_steps
    out = []
    if warmup > 0 and warmup >= total:
        top = warmup_factor(total - 1, warmup, s.warmup_start_factor)
        out.append(f"schedule.warmup_epochs={s.warmup_epochs:g} is as long as the whole run (train.epochs={epochs}, "
                   f"{total} steps): the LR climbs for all {total} steps, reaches {top:.3g} x the peak at the "
                   f"last one and never decays ({s.name} never starts); lower schedule.warmup_epochs")
    warmup_epochs = warmup / max(plan.steps_per_epoch, 1)
    decays = not out  # a run spent in warmup has no decay to warn about
    if decays and s.name == "multistep":
        late = [m for m in s.milestones if m >= epochs]
        if late:
            reached = len(s.milestones) - len(late)
            out.append(f"schedule.milestones {late} lie at or past the last epoch ({epochs}): never reached; the LR "
                       f"ends at {s.gamma ** reached:.3g} x the peak ({reached} decay(s))")
        early = [m for m in s.milestones if m * plan.steps_per_epoch <= warmup and m < epochs]
        if early:
            out.append(f"schedule.milestones {early} fall within the warmup ({warmup_epochs:g} epochs): the LR "
                       f"after the warmup starts at {s.gamma ** len(early):.3g} x the peak, not at the peak")
    if decays and s.name == "step" and s.step_epochs >= epochs:
        out.append(f"schedule.step_epochs={s.step_epochs:g} >= train.epochs={epochs}: the LR never decays "
                   f"(constant at the peak after the warmup)")
    if decays and s.name == "plateau" and epochs - warmup_epochs <= s.plateau_patience:
        out.append(f"schedule.plateau_patience={s.plateau_patience} epochs >= the {epochs - warmup_epochs:g} epochs "
                   f"after the warmup: the LR never decays (constant at the peak after the warmup)")
    off = cfg.train.mix_off_epoch
    if off is not None and off >= epochs and (cfg.train.mixup_alpha > 0 or cfg.train.cutmix_alpha > 0):
        out.append(f"train.mix_off_epoch={off} >= train.epochs={epochs}: mixing stays on for the whole run")
    return out
