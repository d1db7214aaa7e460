"""Random erasing, mixup and CutMix on the batch on the training device, per micro-batch (each micro-batch
of an accumulation window mixes within itself).

Exactness: timm's `Mixup` draws from numpy's global RNG, which a restart does not restore, so a resumed
run would mix differently from the uninterrupted one. Here every draw comes from a `torch.Generator` made
afresh for each micro-batch and seeded by (train.seed, optimizer step, micro-batch in the window, rank),
never from state a restart loses: a killed and resumed run draws exactly what the uninterrupted run drew.
The mixing decision, lambda and CutMix box are host numbers drawn before the batch is touched; the
erasing boxes are drawn on the batch's device. Nothing reads a device value back: no host sync.

The training step's pieces: erasing and mixing of one micro-batch, its forward and backward through the run's
objective, and the update that ends an accumulation window (unscale, gradient norm and clipping, the non-finite
decision, optimizer step, EMA, LR schedule). The epoch (`training.loop`) calls them in that order; the step
keeps no state between calls.

`build_train_step` is the one way to assemble it; the trainer, the batch-size finder, `benchmark.py` and
the tests all use it, so what they time or check is what training runs."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
from timm.utils import unwrap_model

from imgcls.compute.device import DeviceInput
from imgcls.compute.distributed import all_ranks_true
from imgcls.compute.memory import explain_out_of_memory
from imgcls.data.loaders import mix_seed
from imgcls.objectives.base import Objective
from imgcls.tasks import task_of
from imgcls.training.optim import base_lr, build_optimizer, update_carries_nonfinite
from imgcls.training.schedule import build_scheduler, observe_epoch, schedule_from_config

ERASE_SCALE = (0.02, 0.33)   # torchvision RandomErasing defaults: area fraction, aspect ratio, attempts


ERASE_RATIO = (0.3, 3.3)


ERASE_ATTEMPTS = 10


_ERASE_STREAM, _MIX_STREAM = 0xE5A5E, 0x313C


@dataclass
class MixDraw:
    """What one micro-batch gets: `mode` None (not mixed), 'mixup' or 'cutmix'; the weight `lam` of each
    image's own label; the CutMix box (top, bottom, left, right), pasted from the batch rolled by one."""

    mode: Optional[str] = None
    lam: float = 1.0
    box: tuple = (0, 0, 0, 0)


def beta_sample(alpha: float, generator: torch.Generator) -> float:
    """Beta(alpha, alpha) as X / (X + Y) of two Gamma(alpha) draws from `generator`."""
    x, y = torch._standard_gamma(torch.full((2,), alpha, dtype=torch.float64), generator=generator).tolist()
    return x / (x + y) if x + y > 0 else 1.0


def cutmix_box(lam: float, height: int, width: int, generator: torch.Generator) -> tuple[tuple, float]:
    """A box of about (1 - lam) of the image around a uniform centre, clipped to the image, and lambda
    corrected to the area actually pasted (timm's rand_bbox and correct_lam)."""
    cut = math.sqrt(1.0 - lam)
    cut_h, cut_w = int(height * cut), int(width * cut)
    cy = int(torch.randint(0, height, (), generator=generator))
    cx = int(torch.randint(0, width, (), generator=generator))
    top, bottom = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, height)
    left, right = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, width)
    return (top, bottom, left, right), 1.0 - (bottom - top) * (right - left) / (height * width)


def draw_mix(generator: torch.Generator, mixup_alpha: float, cutmix_alpha: float, mix_prob: float,
             switch_prob: float, height: int, width: int) -> MixDraw:
    """One micro-batch's mixing: mixed with `mix_prob`; with both alphas on, CutMix with `switch_prob`."""
    u_mix, u_switch = torch.rand(2, generator=generator, dtype=torch.float64).tolist()
    if u_mix >= mix_prob or (mixup_alpha <= 0 and cutmix_alpha <= 0):
        return MixDraw()
    use_cutmix = cutmix_alpha > 0 and (mixup_alpha <= 0 or u_switch < switch_prob)
    if not use_cutmix:
        return MixDraw("mixup", beta_sample(mixup_alpha, generator))
    box, lam = cutmix_box(beta_sample(cutmix_alpha, generator), height, width, generator)
    return MixDraw("cutmix", lam, box)


def apply_mix(images: torch.Tensor, labels: torch.Tensor, draw: MixDraw, num_classes: int):
    """Mix `images` (in place) with the batch rolled by one; soft targets lam * own + (1 - lam) * partner's."""
    partner = images.roll(1, 0)
    if draw.mode == "mixup":
        images.mul_(draw.lam).add_(partner, alpha=1.0 - draw.lam)
    else:
        top, bottom, left, right = draw.box
        images[:, :, top:bottom, left:right] = partner[:, :, top:bottom, left:right]
    # multi-label targets arrive as float multi-hot vectors: mixing mixes the vectors
    own = labels if labels.is_floating_point() else torch.nn.functional.one_hot(labels, num_classes).float()
    return images, torch.lerp(own.roll(1, 0), own, draw.lam)


def erase_boxes(batch: int, height: int, width: int, prob: float, generator: torch.Generator) -> torch.Tensor:
    """(batch, 4) int64 [top, left, h, w] per image, torchvision RandomErasing's draw: with `prob`, the first
    of 10 attempts (area 2-33%, log-uniform aspect 0.3-3.3) that fits; h = w = 0 where none is erased."""
    device = generator.device
    apply = torch.rand(batch, generator=generator, device=device) < prob
    area = height * width * (ERASE_SCALE[0] + (ERASE_SCALE[1] - ERASE_SCALE[0]) *
                             torch.rand(batch, ERASE_ATTEMPTS, generator=generator, device=device))
    log_lo, log_hi = math.log(ERASE_RATIO[0]), math.log(ERASE_RATIO[1])
    aspect = torch.exp(log_lo + (log_hi - log_lo) * torch.rand(batch, ERASE_ATTEMPTS, generator=generator,
                                                                 device=device))
    h, w = torch.round(torch.sqrt(area * aspect)).long(), torch.round(torch.sqrt(area / aspect)).long()
    fits = (h < height) & (w < width)
    first = fits.int().argmax(1, keepdim=True)   # the first attempt that fits (0 when none does)
    h, w = h.gather(1, first).squeeze(1), w.gather(1, first).squeeze(1)
    keep = apply & fits.any(1)
    h, w = torch.where(keep, h, 0), torch.where(keep, w, 0)
    u = torch.rand(batch, 2, generator=generator, device=device)
    top = (u[:, 0] * (height - h + 1)).long()
    left = (u[:, 1] * (width - w + 1)).long()
    return torch.stack([top, left, h, w], 1)


def erase(images: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """Set each image's box to 0 (the normalised mean) in place; boxes from `erase_boxes`."""
    _, _, height, width = images.shape
    top, left, h, w = (boxes[:, i, None] for i in range(4))
    rows = torch.arange(height, device=images.device)
    cols = torch.arange(width, device=images.device)
    in_rows = (rows >= top) & (rows < top + h)
    in_cols = (cols >= left) & (cols < left + w)
    return images.masked_fill_((in_rows[:, :, None] & in_cols[:, None, :])[:, None], 0.0)


@dataclass
class BatchMixing:
    """`data.random_erasing`, then mixup / CutMix (`train.*`), for one micro-batch on the device."""

    num_classes: int
    seed: int
    rank: int = 0
    erase_prob: float = 0.0
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    mix_prob: float = 1.0
    switch_prob: float = 0.5
    off_epoch: Optional[int] = None   # no mixing from this epoch (0-based) on: mixed for the first N epochs

    @classmethod
    def from_config(cls, cfg, num_classes: int, rank: int = 0) -> Optional["BatchMixing"]:
        """None when erasing and mixing are both off."""
        t = cfg.train
        if cfg.data.random_erasing <= 0 and t.mixup_alpha <= 0 and t.cutmix_alpha <= 0:
            return None
        return cls(num_classes, t.seed, rank, cfg.data.random_erasing, t.mixup_alpha, t.cutmix_alpha, t.mix_prob,
                   t.mix_switch_prob, t.mix_off_epoch)

    @property
    def mixes(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0

    def generator(self, stream: int, step: int, micro: int, device: torch.device) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(mix_seed(self.seed, step, micro, self.rank, stream))

    def draw(self, epoch: int, step: int, micro: int, height: int, width: int) -> MixDraw:
        if self.off_epoch is not None and epoch >= self.off_epoch:
            return MixDraw()
        return draw_mix(self.generator(_MIX_STREAM, step, micro, torch.device("cpu")), self.mixup_alpha,
                        self.cutmix_alpha, self.mix_prob, self.switch_prob, height, width)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, epoch: int, step: int, micro: int):
        """(images, targets) of optimizer step `step`'s micro-batch `micro`: int labels when not mixed,
        (batch, classes) float targets when mixed."""
        batch, _, height, width = images.shape
        if self.erase_prob > 0:
            generator = self.generator(_ERASE_STREAM, step, micro, images.device)
            images = erase(images, erase_boxes(batch, height, width, self.erase_prob, generator))
        draw = self.draw(epoch, step, micro, height, width)
        if draw.mode is None:
            return images, labels
        return apply_mix(images, labels, draw, self.num_classes)

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
