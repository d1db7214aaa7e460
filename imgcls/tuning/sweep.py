"""The lowest training loss a recipe's objective can reach, from the recipe alone: the LR range test's rules
(a 4x divergence, a 10% fall) are measured above it (training.arithmetic.lr_suggestion).

Cross entropy against a soft target t is H(t) + KL(t || p) >= H(t): with label smoothing s over C classes
the loss cannot fall below the smoothed one-hot's entropy (0.50 nats for s = 0.1, C = 10), and mixup / CutMix
raise the floor further (a mixed target lam * a + (1 - lam) * b is softer still). Measured from 0, a smoothed
loss that fell from 2.3 to 0.6 has fallen 74%, but above its floor of 0.5 it has fallen 95%; and a run that
broke at 2.0 is not "4x its minimum" from 0 while it is 15x above the floor.

Why the floor and not the plain cross entropy on the hard labels recorded beside the objective: the
hard-label CE of a mixed batch is not defined (two labels per image), the floor needs no change to the
training step, and the range test then smooths the very loss the optimizer follows (the one that diverges).

Running `tune.py`'s measurements: N real optimizer steps on the real data at one batch size (the batch-size
sweep), or at exponentially increasing LRs (the LR range test).

Each run builds a fresh model from the same seed and its step with `training.step.build_train_step`, and runs
it with `training.loop.train_one_epoch`, as training does; the loss is read only at the run's logging points."""
from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

import imgcls.compute.distributed as dist_utils
from imgcls.compute.device import DeviceInput, Runtime, memory_format, pin_memory_for
from imgcls.compute.memory import peak_memory_bytes, reset_peak_memory
from imgcls.core.errors import NonFiniteError, StopRequested
from imgcls.models.factory import build_model
from imgcls.objectives.registry import build_objective
from imgcls.tasks import task_of
from imgcls.training.arithmetic import Curve, above_floor, divergence_index, exponential_lrs, smooth
from imgcls.training.loop import measuring_parts, train_one_epoch
from imgcls.training.schedule import scaled_lr
from imgcls.training.state import EpochCounters, TrainState
from imgcls.training.step import LRPlan, build_train_step

# the expectation over the mixing's lambda ~ Beta(alpha, alpha): this many seeded draws (an error of ~0.3% of
# the floor, far under the rules' 10% and 4x)
MIX_DRAWS = 4000


def entropy(probabilities: list[float]) -> float:
    return -sum(p * math.log(p) for p in probabilities if p > 0)


def binary_entropy(p: float) -> float:
    return entropy([p, 1.0 - p])


def target_floor(own: float, other: float, classes: int, smoothing: float, loss: str) -> float:
    """The floor of one soft target: weight `own` on one class and `other` on a second (0 when unmixed), then
    smoothed as tasks.losses.smoothed_targets does; its entropy (`ce`) or mean binary entropy per class (`bce`)."""
    rest = smoothing / classes
    weights = [own * (1 - smoothing) + rest, other * (1 - smoothing) + rest] + [rest] * (classes - 2)
    if loss == "ce":
        return entropy(weights)
    return sum(binary_entropy(w) for w in weights) / classes


def mixed_floor(alpha: float, classes: int, smoothing: float, loss: str, seed: int = 0) -> float:
    """The mean floor of targets mixed with lambda ~ Beta(alpha, alpha), the partner of another class with
    probability (C - 1) / C (balanced classes; a partner of the same class leaves the target unmixed)."""
    draws = random.Random(seed)
    total = 0.0
    for _ in range(MIX_DRAWS):
        lam = draws.betavariate(alpha, alpha)
        total += target_floor(lam, 1 - lam, classes, smoothing, loss)
    unmixed = target_floor(1.0, 0.0, classes, smoothing, loss)
    return (classes - 1) / classes * total / MIX_DRAWS + unmixed / classes


def loss_floor(cfg, classes: int) -> tuple[float, str]:
    """The floor of `cfg`'s training loss over `classes` classes and what sets it ('' when it is 0): the
    smoothing and the mixing (train.mix_prob of the micro-batches; with both mixup and CutMix on,
    train.mix_switch_prob of them CutMix, whose lambda is drawn as mixup's); under distillation the task loss
    weighs (1 - distill.alpha) (the distillation terms can reach 0). 0 for multi-label tasks (their tags per
    image are not known here), `asl` (not a proper scoring rule: no entropy floor) and binarised `bce` targets."""
    t = cfg.train
    one_label = task_of(cfg).activation == "softmax"
    if not one_label or classes < 2 or t.loss == "asl" or (t.loss == "bce" and t.bce_target_thresh is not None):
        return 0.0, ""
    unmixed = target_floor(1.0, 0.0, classes, t.label_smoothing, t.loss)
    parts = [f"label smoothing {t.label_smoothing:g} over {classes} classes"] if t.label_smoothing > 0 else []
    floor = unmixed
    alphas = [(a, share) for a, share in ((t.mixup_alpha, 1 - t.mix_switch_prob if t.cutmix_alpha > 0 else 1.0),
                                          (t.cutmix_alpha, t.mix_switch_prob if t.mixup_alpha > 0 else 1.0))
              if a > 0]
    if alphas and t.mix_prob > 0:
        mixed = sum(share * mixed_floor(a, classes, t.label_smoothing, t.loss) for a, share in alphas)
        floor = t.mix_prob * mixed + (1 - t.mix_prob) * unmixed
        parts.append("mixup / CutMix soft targets")
    teacher = getattr(cfg, "distill", None)
    if teacher is not None and teacher.teacher:
        floor *= 1 - teacher.alpha
        if floor > 0:
            parts.append(f"x (1 - distill.alpha={teacher.alpha:g})")
    return (floor, ", ".join(parts)) if floor > 0 else (0.0, "")

def chance_loss(cfg, classes: int) -> Optional[float]:
    """What the training loss of a model that predicts every class alike scores: ln C for single-label cross
    entropy, whatever the smoothing or mixing (the targets sum to 1); None where it is not that simple (other
    losses, multi-label tasks, distillation's extra terms). A sweep's curve that never falls below it learned
    nothing (training.arithmetic.learning_failure)."""
    teacher = getattr(cfg, "distill", None)
    if task_of(cfg).activation != "softmax" or cfg.train.loss != "ce" or classes < 2 or (teacher and teacher.teacher):
        return None
    return math.log(classes)


log = logging.getLogger(__name__)


def epochs_of(loader, sampler) -> Iterator:
    """The loader's batches, epoch after epoch, the sampler reshuffled for each as in training."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def settings_for(cfg, batch: int, accum: int, grad_checkpointing: bool):
    """A copy of `cfg` at this per-process batch, accumulation and checkpointing."""
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, batch_size=batch, accum_steps=accum),
        model=dataclasses.replace(cfg.model, grad_checkpointing=grad_checkpointing))


def mean_over_ranks(runtime: Runtime, value: float) -> float:
    """`value` averaged over the processes (itself in one process)."""
    if not runtime.dist.enabled:
        return value
    total = dist_utils.all_reduce_sum(torch.tensor([value], dtype=torch.float64, device=runtime.device))
    return float(total) / runtime.dist.world_size


@dataclass
class SizeRun:
    """One batch size's measurement."""

    curve: Curve
    img_per_s: float
    seconds_per_step: float
    peak_memory_bytes: int
    peak_lr: float
    grad_checkpointing: bool
    interrupted: bool = False     # Ctrl-C during this size: the curve so far
    diverged: bool = False        # a non-finite loss ended it


def build_run(cfg, ctx: Runtime, peak_lr: float, warmup: int, steps: int):
    """(TrainStep, data) for `cfg`: a fresh model from the seed, wrapped in DDP under torchrun."""
    from imgcls.data.build import build_run_data, resolve_class_weights, resolve_normalisation

    torch.manual_seed(cfg.train.seed)
    data = build_run_data(cfg, cfg.train.batch_size, ctx.dist.rank, ctx.dist.world_size,
                          pin_memory_for(cfg.data.pin_memory, ctx.device))
    cfg = resolve_class_weights(cfg, data.train_index)
    cfg = resolve_normalisation(cfg, data.train_index, None, cfg.train.batch_size,
                                lambda fn: dist_utils.run_on_main(ctx.dist.is_main, fn, share_result=True))
    model = build_model(cfg.model, len(data.classes), cfg.data.channels)
    model = model.to(ctx.device, memory_format=memory_format(cfg.train.channels_last))
    train_model = model
    if ctx.dist.enabled:
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        train_model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    # distill.teacher: the sweep trains (and times) the student with its teacher, as train.py would
    objective = build_objective(cfg, data.classes, model, ctx.device)
    step = build_train_step(cfg, model, DeviceInput.from_config(cfg, ctx.device, ctx.amp_dtype),
                            LRPlan(peak_lr, warmup, steps), train_model=train_model, dist=ctx.dist,
                            accum_steps=cfg.train.accum_steps, objective=objective)
    return step, data


def run_batch_size(cfg, ctx: Runtime, steps: int, warmup: int, log_every: int,
                   on_point: Optional[Callable[[Curve], None]] = None) -> SizeRun:
    """`steps` optimizer steps at `cfg`'s batch and accumulation: LR scaled by optim.lr_scaling from the
    effective batch, linear warmup over `warmup` optimizer steps, then that LR held (schedule.min_lr is set
    to it: the sweep compares batch sizes at their training LR, not a decay compressed into N steps)."""
    t = cfg.train
    effective = t.batch_size * t.accum_steps * ctx.dist.world_size
    peak_lr = scaled_lr(cfg.optim.lr, effective, cfg.optim.base_batch_size, cfg.optim.lr_scaling)
    held = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, min_lr=peak_lr))
    step, data = build_run(held, ctx, peak_lr, warmup, steps)
    curve = Curve(t.batch_size, t.accum_steps, effective)
    raw: list[float] = []
    start = time.perf_counter()

    def record(number: int, values: dict) -> None:
        raw.append(mean_over_ranks(ctx, values["train/loss"]))
        curve.steps.append(number)
        curve.samples.append(number * effective)
        curve.seconds.append(time.perf_counter() - start)
        curve.losses = smooth(raw)
        if on_point is not None:
            on_point(curve)

    parts = measuring_parts(on_step=record, log_interval=log_every)
    reset_peak_memory(ctx.device)
    interrupted = diverged = False
    try:
        train_one_epoch(step, parts, epochs_of(data.train_loader, data.sampler), steps * t.accum_steps,
                        TrainState(), EpochCounters())
    except KeyboardInterrupt:
        interrupted = True
    except NonFiniteError:
        diverged = True
    rate, per_step = steady_rates(curve)
    return SizeRun(curve, rate, per_step, peak_memory_bytes(ctx.device), peak_lr, cfg.model.grad_checkpointing,
                   interrupted, diverged)


def steady_rates(curve: Curve) -> tuple[float, float]:
    """(img/s, seconds per optimizer step) between the first and the last logged point: the first interval
    (loader start-up, kernel selection) is left out."""
    if len(curve.steps) < 2:
        if not curve.steps:
            return 0.0, 0.0
        return curve.samples[0] / max(curve.seconds[0], 1e-9), curve.seconds[0] / curve.steps[0]
    seconds = max(curve.seconds[-1] - curve.seconds[0], 1e-9)
    return (curve.samples[-1] - curve.samples[0]) / seconds, seconds / (curve.steps[-1] - curve.steps[0])


@dataclass
class RangeTest:
    lrs: list[float]
    losses: list[float]           # raw, averaged over ranks
    smoothed: list[float]
    effective_batch: int
    floor: float = 0.0            # the objective's lowest reachable loss (tuning.sweep)
    floor_reason: str = ""


def run_lr_range(cfg, ctx: Runtime, low: float, high: float, steps: int,
                 on_step: Optional[Callable[[int, float], None]] = None) -> RangeTest:
    """The LR range test at `cfg`'s batch: LR from `low` to `high` exponentially over `steps` optimizer
    steps (the same on every rank), the loss averaged over ranks at every step; it stops early once the
    smoothed loss diverges (training.arithmetic.divergence_index) (every rank sees the same averages, so all stop
    together; both measured above the objective's floor, tuning.sweep). `on_step(step, seconds since the
    start)` after every step."""
    lrs = exponential_lrs(low, high, steps)
    step, data = build_run(cfg, ctx, low, 0, None)
    step.scheduler = torch.optim.lr_scheduler.LambdaLR(step.optimizer, lambda i: lrs[min(i, steps - 1)] / low)
    result = RangeTest([], [], [], cfg.train.batch_size * cfg.train.accum_steps * ctx.dist.world_size,
                       *loss_floor(cfg, len(data.classes)))
    start = time.perf_counter()

    def record(number: int, values: dict) -> None:
        result.lrs.append(values["train/lr"])
        result.losses.append(mean_over_ranks(ctx, values["train/loss"]))
        result.smoothed = smooth(result.losses)
        if on_step is not None:
            on_step(number, time.perf_counter() - start)

    def diverged(number: int) -> bool:
        return divergence_index(above_floor(result.smoothed, result.floor)) is not None

    parts = measuring_parts(on_step=record, stop_when=diverged, log_interval=1)
    try:
        train_one_epoch(step, parts, epochs_of(data.train_loader, data.sampler), steps * cfg.train.accum_steps,
                        TrainState(), EpochCounters())
    except (StopRequested, NonFiniteError):
        log.info("LR range test: the loss diverged at LR %.3g; stopped", result.lrs[-1])
    return result


def attempts_for(per_process: int, grad_checkpointing: bool, try_checkpointing: bool) -> list[tuple[int, int, bool]]:
    """(micro-batch, accum_steps, grad_checkpointing) to try in order for one per-process batch: as it is;
    with activation checkpointing if asked; then 2, 4, ... micro-batches keeping the batch."""
    out = [(per_process, 1, grad_checkpointing)]
    if try_checkpointing and not grad_checkpointing:
        out.append((per_process, 1, True))
    accum = 2
    while accum <= per_process:
        if per_process % accum == 0:
            out.append((per_process // accum, accum, grad_checkpointing))
        accum *= 2
    return out


@dataclass
class SweepEntry:
    size: int                       # the effective batch asked for
    run: Optional[SizeRun]          # None: no attempt fitted
    fits: bool                      # fitted as it is (no accumulation, no checkpointing added)
    how: str                        # "as is", "accum_steps=K", "grad_checkpointing", ...


class MemoryCheck:
    """Whether a setting fits. CUDA: None (the run itself answers, out-of-memory is caught). CPU: the
    breakdown measured at two small batches predicts the peak, within `train.memory_budget_gb`."""

    def __init__(self, cfg, ctx: Runtime, num_classes: int, budget: Optional[int], small: int):
        self.cfg, self.ctx, self.num_classes, self.budget, self.small = cfg, ctx, num_classes, budget, small
        self.breakdowns: dict = {}

    def breakdown(self, grad_checkpointing: bool):
        from imgcls.training.batch_finder import TrainingStepProbe

        if grad_checkpointing not in self.breakdowns:
            probe = TrainingStepProbe(settings_for(self.cfg, self.small, 1, grad_checkpointing), self.num_classes,
                                      self.ctx.device, self.ctx.amp_dtype)
            try:
                with torch.random.fork_rng(devices=[]):
                    self.breakdowns[grad_checkpointing] = probe.breakdown(self.small, 2 * self.small)
            finally:
                probe.close()
        return self.breakdowns[grad_checkpointing]

    def predicted_fit(self, batch: int, grad_checkpointing: bool) -> Optional[bool]:
        if self.budget is None:
            return None
        return self.breakdown(grad_checkpointing).total(batch) <= self.budget


def sweep_batch_sizes(cfg, ctx: Runtime, sizes: list[int], steps: int, warmup: int, log_every: int,
                      memory: MemoryCheck, try_checkpointing: bool,
                      on_point: Optional[Callable[[int, Curve], None]] = None,
                      on_entry: Optional[Callable[[SweepEntry], None]] = None) -> list[SweepEntry]:
    """Each size in turn (stopping after one Ctrl-C'd); a size that does not fit is retried as `attempts_for`
    says. `on_point(size, curve)` after every logged point, `on_entry` after every size."""
    from imgcls.compute.device import is_out_of_memory
    from imgcls.training.batch_finder import free_device_memory

    entries: list[SweepEntry] = []
    for size in sizes:
        entry = SweepEntry(size, None, False, "does not fit")
        for batch, accum, checkpointing in attempts_for(size // ctx.dist.world_size, cfg.model.grad_checkpointing,
                                                        try_checkpointing):
            if memory.predicted_fit(batch, checkpointing) is False:
                continue
            point = (lambda curve, size=size: on_point(size, curve)) if on_point else None
            try:
                run = run_batch_size(settings_for(cfg, batch, accum, checkpointing), ctx, steps, warmup, log_every,
                                     point)
            except Exception as err:  # noqa: BLE001 - only out-of-memory means "try the next way"
                if not is_out_of_memory(err):
                    raise
                free_device_memory()
                continue
            as_is = accum == 1 and checkpointing == cfg.model.grad_checkpointing
            how = "as is" if as_is else ", ".join(
                ([f"accum_steps={accum}"] if accum > 1 else []) +
                (["grad_checkpointing"] if checkpointing and not cfg.model.grad_checkpointing else []))
            entry = SweepEntry(size, run, as_is, how)
            break
        entries.append(entry)
        if on_entry is not None:
            on_entry(entry)
        if entry.run is not None and entry.run.interrupted:
            break
    return entries
