"""Timing real training steps (the batch-size finder and benchmark.py): the loop the trainer runs, on
batches from a loader or a synthetic batch already on the device.

`train.batch_size: auto`: the largest per-device batch that fits, then the smallest one that is as fast.

1. Fit: double the batch until a training step no longer fits, then binary-search the boundary to
   within 5%. On CUDA "fits" means a real step ran without an out-of-memory error (the error is caught
   and the cache freed). On the CPU running out of memory kills the process, so instead the peak RSS of
   real steps at two small batches gives memory = fixed + per_image x batch, and a batch fits when that
   stays under `train.memory_budget_gb` (default: 80% of the RAM available at start, plus what the
   process already holds).
2. Speed: img/s of real steps at the largest fitting batch and at halvings of it; the smallest batch
   within 5% of the best rate wins (larger batches only cost memory and generalisation headroom).
3. The effective batch is kept: it is `train.target_effective_batch` (null: `optim.base_batch_size`,
   the batch `optim.lr` is tuned for), reached by `accum_steps` micro-batches on every process; the
   trainer then scales the LR by `optim.lr_scaling` from the resulting effective batch as usual.

The table (batch, img/s, peak memory) is logged and saved as `batch_finder.json` in the run directory."""
from __future__ import annotations

import dataclasses
import gc
import logging
import os
import resource
import time
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from imgcls.compute.device import DeviceInput, is_out_of_memory, memory_format, precision_name
from imgcls.compute.distributed import min_over_ranks
from imgcls.compute.memory import (MemoryBreakdown, available_memory_bytes, breakdown_from_steps, current_memory_bytes,
                                   current_rss_bytes, gradient_bytes, mib, optimizer_state_bytes, parameter_bytes,
                                   peak_memory_bytes, reset_peak_memory)
from imgcls.core.errors import ModelError
from imgcls.data.build import for_timing
from imgcls.models.factory import build_model, check_grad_checkpointing
from imgcls.objectives.registry import build_objective
from imgcls.objectives.teacher import check_teacher
from imgcls.training.arithmetic import throughput_knee
from imgcls.training.loop import measuring_parts, train_one_epoch
from imgcls.training.schedule import ceil_div
from imgcls.training.state import EpochCounters, TrainState
from imgcls.training.step import TrainStep, build_train_step


def process_tree_cpu_seconds() -> float:
    """CPU time (user + system) of this process plus its children (loader workers), live ones and those that
    ended (a shard stream's workers end with each epoch). On a busy machine wall-clock rates follow the
    load of other processes; CPU seconds per image do not."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    me = os.getpid()
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:  # ppid; then utime, stime are fields 14, 15 of the whole line
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic_batch(batch_size: int, img_size: int, num_classes: int, device: torch.device, train: bool = True,
                    channels: int = 3):
    """Random uint8 images and labels already on the device, shaped like a loader batch (`channels` bands)."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (batch_size, channels, img_size, img_size), dtype=torch.uint8, generator=generator)
    targets = torch.randint(0, num_classes, (batch_size,), generator=generator)
    images, targets = images.to(device), targets.to(device)
    if train:
        return images, targets, torch.full((batch_size,), -1, dtype=torch.int64)
    return images, targets, torch.ones(batch_size, dtype=torch.bool), torch.arange(batch_size)


class TimedIterator:
    """Wraps batches and adds up the time spent waiting for the next one (the data wait)."""

    def __init__(self, batches: Iterable):
        self.batches = iter(batches)
        self.wait_s = 0.0

    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()
        try:
            return next(self.batches)
        finally:
            self.wait_s += time.perf_counter() - start


@dataclass
class StepTiming:
    steps: int
    images: int
    total_s: float
    data_wait_s: float
    peak_memory_bytes: int
    cpu_s: float = 0.0
    held_before_bytes: int = 0    # memory held when the timed steps started (peak minus it: what they added)

    @property
    def img_per_s(self) -> float:
        return self.images / self.total_s if self.total_s > 0 else 0.0

    @property
    def step_s(self) -> float:
        return self.total_s / max(self.steps, 1)


def time_train_steps(step: TrainStep, batches: Iterable, steps: int, warmup: int) -> StepTiming:
    """Run `warmup` then `steps` real training steps (`train_one_epoch`) on `batches`; time the latter."""
    iterator = iter(batches)
    device = step.input.device
    if warmup:
        train_one_epoch(step, measuring_parts(), iterator, warmup, TrainState(), EpochCounters())
    sync(device)
    reset_peak_memory(device)
    held_before = current_memory_bytes(device)
    timed = TimedIterator(iterator)
    counters = EpochCounters()
    cpu_start = process_tree_cpu_seconds()
    start = time.perf_counter()
    # train_one_epoch ends with one host sync (the epoch's loss sum), so the clock stops after the work.
    train_one_epoch(step, measuring_parts(), timed, steps, TrainState(), counters)
    sync(device)
    total = time.perf_counter() - start
    return StepTiming(steps, counters.samples, total, timed.wait_s, peak_memory_bytes(device),
                      process_tree_cpu_seconds() - cpu_start, held_before)


log = logging.getLogger(__name__)


FIT_TOLERANCE = 0.05


SPEED_TOLERANCE = 0.05


SPEED_CANDIDATES = 4          # the largest fitting batch and up to 3 halvings of it


MIN_SPEED_BATCH = 8


TIMING_ROUNDS = (2, 5)        # the speed table is timed at least 2 and at most 5 rounds over the candidates ...


STABLE_SPREAD = 0.10          # ... until every batch's img/s over the rounds is within 10% (max - min over median)


@dataclass
class StepResult:
    """One measured training step size: seconds per step and the peak memory (bytes) while it ran."""

    seconds: float
    peak_bytes: int
    held_before_bytes: int = 0


StepFn = Callable[[int], StepResult]   # batch size -> measurement; raises torch.OutOfMemoryError if it does not fit


def search_max_batch(fits: Callable[[int], bool], limit: int, start: int = 1,
                     tolerance: float = FIT_TOLERANCE) -> tuple[int, list[tuple[int, bool]]]:
    """Largest batch in [1, limit] with `fits(batch)`, assuming fitting is monotone: doubling from `start`,
    then bisection until the gap between the largest fitting and smallest failing batch is within
    `tolerance` of the former. Returns (batch, [(batch, fits), ...] in the order tried); batch 0 when
    not even 1 fits."""
    tried: list[tuple[int, bool]] = []

    def probe(batch: int) -> bool:
        ok = fits(batch)
        tried.append((batch, ok))
        return ok

    start = max(1, min(start, limit))
    good, bad = 0, None
    batch = start
    while True:
        if probe(batch):
            good = batch
            if batch >= limit:
                return good, tried
            batch = min(batch * 2, limit)
        else:
            bad = batch
            break
    if good == 0:  # even `start` failed: halve down
        while bad > 1:
            batch = bad // 2
            if probe(batch):
                good = batch
                break
            bad = batch
        if good == 0:
            return 0, tried
    while bad - good > max(1, tolerance * good):
        mid = (good + bad) // 2
        if probe(mid):
            good = mid
        else:
            bad = mid
    return good, tried


class LinearMemoryModel:
    """memory(batch) = fixed + per_image x batch, from two measured steps."""

    def __init__(self, small: tuple[int, int], large: tuple[int, int]):
        (b1, m1), (b2, m2) = small, large
        self.per_image = max(0.0, (m2 - m1) / (b2 - b1)) if b2 != b1 else 0.0
        self.fixed = m1 - self.per_image * b1

    def __call__(self, batch: int) -> float:
        return self.fixed + self.per_image * batch


@dataclass
class FinderResult:
    max_batch: int
    chosen_batch: int
    fit_probes: list            # [{batch, fits, peak_memory_mb?}]
    table: list                 # [{batch, img_per_s, peak_memory_mb}]
    memory_budget_mb: Optional[float] = None
    memory_model: Optional[dict] = None
    timing_rounds: int = 1
    timing_stable: bool = True     # every batch's img/s within STABLE_SPREAD over the rounds


def fit_search(step: StepFn, limit: int, memory_budget: Optional[int] = None,
               tolerance: float = FIT_TOLERANCE,
               measured: tuple = ()) -> tuple[int, list[dict], Optional[LinearMemoryModel]]:
    """The largest batch that fits: (batch, probes, the CPU memory model or None).

    `memory_budget` None: a batch fits when `step` does not raise out-of-memory (CUDA). Otherwise
    (bytes): a batch fits when the linear memory model from two measured steps (`measured`, the
    breakdown's, or measured here) stays within it (CPU).
    """
    probes: list[dict] = []
    model = None
    if memory_budget is None:
        def fits(batch: int) -> bool:
            result = run_or_none(step, batch)
            if result is None:
                probes.append({"batch": batch, "fits": False})
                return False
            probes.append({"batch": batch, "fits": True, "peak_memory_mb": mib(result.peak_bytes)})
            return True
    else:
        if not measured:
            small = max(1, min(limit // 2, MIN_SPEED_BATCH))
            large = min(limit, 2 * small)
            step(small)  # warm-up: optimizer state, allocator pools, kernels
            measured = [(b, step(b).peak_bytes) for b in (small, large)]
        for b, peak in measured:
            probes.append({"batch": b, "fits": peak <= memory_budget, "peak_memory_mb": mib(peak), "measured": True})
        model = LinearMemoryModel(*measured)

        def fits(batch: int) -> bool:
            return model(batch) <= memory_budget

    max_batch, tried = search_max_batch(fits, limit, tolerance=tolerance)
    if model is not None:
        probes.extend({"batch": b, "fits": ok, "predicted_memory_mb": mib(int(model(b)))} for b, ok in tried)
    return max_batch, probes, model


def find_batch(step: StepFn, limit: int, memory_budget: Optional[int] = None,
               tolerance: float = FIT_TOLERANCE, speed_tolerance: float = SPEED_TOLERANCE,
               measured: tuple = ()) -> FinderResult:
    """Search with `step` (a real training step, or an injected one in tests): `fit_search`, then the
    speed of the largest fitting batch and its halvings."""
    max_batch, probes, model = fit_search(step, limit, memory_budget, tolerance, measured)
    memory_model = None if model is None else {"fixed_mb": mib(int(model.fixed)),
                                               "per_image_mb": round(model.per_image / 2**20, 3)}
    if max_batch == 0:
        raise MemoryError("out of memory: train.batch_size=auto found that not even a batch of 1 fits" +
                          (f" in train.memory_budget_gb ({memory_budget / 2**30:.2f} GB)" if memory_budget else ""))

    sizes = sorted({max(1, max_batch >> k) for k in range(SPEED_CANDIDATES)
                    if (max_batch >> k) >= min(MIN_SPEED_BATCH, max_batch)}, reverse=True)
    table, rounds, stable = timed_table(step, sizes, memory_budget, probes)
    if not table:
        raise MemoryError(f"out of memory: train.batch_size=auto found {max_batch}, but no batch up to it ran within "
                          f"memory when timed")
    chosen = pick_fastest_small(table, speed_tolerance)
    return FinderResult(max_batch, chosen, probes, sorted(table, key=lambda r: r["batch"]),
                        mib(memory_budget) if memory_budget is not None else None, memory_model, rounds, stable)


def spread(values: list[float]) -> float:
    """(max - min) / median: how far repeated timings of one batch disagree."""
    ordered = sorted(values)
    median = ordered[len(ordered) // 2] if len(ordered) % 2 else (ordered[len(ordered) // 2 - 1] +
                                                                   ordered[len(ordered) // 2]) / 2
    return (ordered[-1] - ordered[0]) / median if median > 0 else 0.0


def timed_table(step: StepFn, sizes: list[int], memory_budget: Optional[int], probes: list,
                rounds: tuple[int, int] = TIMING_ROUNDS,
                stable_spread: float = STABLE_SPREAD) -> tuple[list[dict], int, bool]:
    """img/s of every size, timed in rounds over all sizes in turn (so a change in the machine's load reaches
    every size alike), at least rounds[0] and at most rounds[1] times, until each size's rates are within
    `stable_spread`. Rows: `batch`, `img_per_s` (the median over the rounds), `img_per_s_spread`,
    `peak_memory_mb`. Returns (rows, rounds run, whether the rates were stable). A size out of memory, or
    (CPU) over the budget when measured, is dropped into `probes` as not fitting."""
    rates: dict[int, list[float]] = {b: [] for b in sizes}
    peaks: dict[int, int] = {}
    done, stable = 0, False
    while done < rounds[1] and rates:
        for batch in list(rates):
            result = run_or_none(step, batch)
            over = result is not None and memory_budget is not None and result.peak_bytes > memory_budget
            if result is None or over:
                # the extrapolation was optimistic: the measured step is over budget, so it does not fit
                if over:
                    probes.append({"batch": batch, "fits": False, "peak_memory_mb": mib(result.peak_bytes),
                                   "measured": True})
                del rates[batch]
                continue
            rates[batch].append(batch / result.seconds if result.seconds > 0 else 0.0)
            peaks[batch] = max(peaks.get(batch, 0), result.peak_bytes)
        done += 1
        stable = all(spread(r) <= stable_spread for r in rates.values())
        if done >= rounds[0] and stable:
            break
    table = [{"batch": b, "img_per_s": round(sorted(r)[len(r) // 2], 2), "img_per_s_spread": round(spread(r), 4),
              "peak_memory_mb": mib(peaks[b])} for b, r in rates.items()]
    return table, done, stable


def run_or_none(step: StepFn, batch: int) -> Optional[StepResult]:
    """`step(batch)`, or None when it ran out of memory (then the failed step's memory is released: only
    after the exception, whose traceback holds the step's tensors, is gone)."""
    try:
        return step(batch)
    except Exception as err:  # noqa: BLE001 - only out-of-memory means "does not fit"
        if not is_out_of_memory(err):
            raise
    free_device_memory()
    return None


def pick_fastest_small(table: list[dict], tolerance: float = SPEED_TOLERANCE) -> int:
    """The smallest batch whose img/s is within `tolerance` of the best."""
    return throughput_knee({row["batch"]: row["img_per_s"] for row in table}, tolerance)


def accumulation_for(batch: int, target_effective: int, world_size: int) -> tuple[int, int]:
    """(per-device batch, accum_steps) with batch x accum x world as close to `target_effective` as the
    fitting `batch` allows: the fewest micro-batches, each no larger than `batch`."""
    per_step = max(1, ceil_div(target_effective, world_size))
    accum = max(1, ceil_div(per_step, batch))
    return max(1, ceil_div(per_step, accum)), accum


def free_device_memory() -> None:
    """After a caught CUDA out-of-memory error: drop the failed step's tensors and return cached blocks."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


def memory_budget_bytes(cfg, device: torch.device) -> Optional[int]:
    """None on CUDA (real out-of-memory errors decide); on the CPU, the budget for the process's peak RSS."""
    if device.type == "cuda":
        return None
    if cfg.train.memory_budget_gb is not None:
        return int(cfg.train.memory_budget_gb * 2**30)
    return int(current_rss_bytes() + 0.8 * available_memory_bytes())


class TrainingStepProbe:
    """`StepFn` running real training steps (`training.loop.train_one_epoch`) on a synthetic batch on the
    device, with a throwaway model and optimizer built like the trainer's (uncompiled)."""

    def __init__(self, cfg, num_classes: int, device: torch.device, amp_dtype, steps: int = 2, warmup: int = 1):
        self.cfg = cfg
        self.num_classes = num_classes
        self.device = device
        self.steps = steps
        self.warmup = warmup
        self.step = build_training_probe(cfg, num_classes, device, amp_dtype)

    def __call__(self, batch: int) -> StepResult:
        try:
            data = synthetic_batch(batch, self.cfg.data.img_size, self.num_classes, self.device,
                                   channels=self.cfg.data.channels)
            timing = time_train_steps(self.step, repeat(data), self.steps, self.warmup)
            return StepResult(timing.step_s, timing.peak_memory_bytes, timing.held_before_bytes)
        finally:
            self.step.optimizer.zero_grad(set_to_none=True)

    def breakdown(self, small: int, large: int) -> MemoryBreakdown:
        """Parameters, gradients and optimizer state of this model, and its activations per sample from
        real steps at two batch sizes (the first also creates the optimizer state)."""
        self(small)
        first, second = self(small), self(large)
        model, optimizer = self.step.model, self.step.optimizer
        return breakdown_from_steps(parameter_bytes(model), gradient_bytes(model), optimizer_state_bytes(optimizer),
                                    first.held_before_bytes, (small, first.peak_bytes), (large, second.peak_bytes))

    def close(self) -> None:
        if self.step is not None:
            self.step.objective.close()  # semi.method: its unlabelled loader's workers
        self.step = None
        free_device_memory()


def build_training_probe(cfg, num_classes: int, device: torch.device, amp_dtype, compile_model: bool = False):
    """A fresh model and `TrainStep` built like the trainer's (constant LR, one micro-batch per step), for
    measuring what a training step costs."""
    model = build_model(cfg.model, num_classes, cfg.data.channels).to(device, memory_format=memory_format(cfg.train.channels_last))
    train_model = torch.compile(model, dynamic=False) if compile_model else model
    # distill.teacher: the teacher's forward and memory are part of what a step costs
    objective = build_objective(cfg, None, model, device)
    return build_train_step(cfg, model, DeviceInput.from_config(for_timing(cfg), device, amp_dtype), cfg.optim.lr,
                            train_model=train_model, accum_steps=1, num_classes=num_classes, objective=objective)


def target_effective_batch(cfg) -> int:
    return cfg.train.target_effective_batch or cfg.optim.base_batch_size


def run_finder(cfg, device: torch.device, amp_dtype, num_classes: int, train_images: int, world_size: int = 1,
               step: Optional[StepFn] = None, compare_checkpointing: Optional[bool] = None,
               min_steps_per_epoch: int = 1) -> dict:
    """Find the batch for this config on this device; returns the report saved as batch_finder.json.

    With real steps (no injected `step`) it also holds the memory breakdown, and, when
    `compare_checkpointing` (default: `model.grad_checkpointing` is on), the largest batch that fits with
    activation checkpointing switched the other way. `min_steps_per_epoch`: the effective batch (and the
    search) stay small enough for that many optimizer steps per epoch (benchmark.py's recommendation)."""
    target = target_effective_batch(cfg)
    most = max(1, train_images // max(1, min_steps_per_epoch))
    if target > most:
        # An epoch holds each image once: a larger effective batch would only exist on paper.
        log.warning("the target effective batch %d (train.target_effective_batch, or optim.base_batch_size) is "
                    "more than the %d training images%s; aiming at %d", target, train_images,
                    f" allow for {min_steps_per_epoch} steps per epoch" if min_steps_per_epoch > 1 else "", most)
        target = most
    per_device_cap = max(1, min(ceil_div(target, world_size), most // max(world_size, 1)))
    budget = memory_budget_bytes(cfg, device)
    breakdown = None
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if step is None:
            probe = TrainingStepProbe(cfg, num_classes, device, amp_dtype)
            try:
                small = max(1, min(per_device_cap // 2, MIN_SPEED_BATCH))
                breakdown = probe.breakdown(small, min(per_device_cap, 2 * small))
                result = find_batch(probe, per_device_cap, budget, measured=breakdown.measured)
            finally:
                probe.close()
        else:
            result = find_batch(step, per_device_cap, budget)
        compare = cfg.model.grad_checkpointing if compare_checkpointing is None else compare_checkpointing
        other_setting = (max_batch_with_checkpointing(cfg, not cfg.model.grad_checkpointing, num_classes, device,
                                                      amp_dtype, per_device_cap, budget) if compare else None)
    batch, accum = accumulation_for(result.chosen_batch, target, world_size)
    with_checkpointing = result.max_batch if cfg.model.grad_checkpointing else other_setting
    without_checkpointing = other_setting if cfg.model.grad_checkpointing else result.max_batch
    return {"device": str(device), "model": cfg.model.name, "img_size": cfg.data.img_size,
            "amp": precision_name(amp_dtype),
            "channels_last": cfg.train.channels_last, "search_limit": per_device_cap,
            "target_effective_batch": target, "world_size": world_size, "max_batch": result.max_batch,
            "fastest_small_batch": result.chosen_batch, "batch_size": batch, "accum_steps": accum,
            "effective_batch": batch * accum * world_size, "memory_budget_mb": result.memory_budget_mb,
            "memory_model": result.memory_model, "fit_probes": result.fit_probes, "table": result.table,
            "timing_rounds": result.timing_rounds, "timing_stable": result.timing_stable,
            "train_images": train_images, "steps_per_epoch": train_images // (batch * accum * world_size)
            if train_images < 1 << 30 else None,
            "grad_checkpointing": cfg.model.grad_checkpointing,
            "max_batch_with_grad_checkpointing": with_checkpointing,
            "max_batch_without_grad_checkpointing": without_checkpointing,
            "memory_breakdown": breakdown.as_dict(result.max_batch) if breakdown is not None else None}


def max_batch_with_checkpointing(cfg, enabled: bool, num_classes: int, device: torch.device, amp_dtype, limit: int,
                                 budget: Optional[int]) -> Optional[int]:
    """The largest batch that fits with `model.grad_checkpointing` = `enabled`; None where the model has no
    activation checkpointing."""
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, grad_checkpointing=enabled))
    try:
        check_grad_checkpointing(other.model)
    except ModelError:
        return None
    probe = TrainingStepProbe(other, num_classes, device, amp_dtype)
    try:
        return fit_search(probe, limit, budget)[0]
    finally:
        probe.close()


def format_finder_table(report: dict) -> str:
    lines = [f"{'batch':>7} {'img/s':>10} {'peak MiB':>10}"]
    for row in report["table"]:
        mark = "  <- chosen" if row["batch"] == report["fastest_small_batch"] else ""
        lines.append(f"{row['batch']:>7} {row['img_per_s']:>10.1f} {row['peak_memory_mb']:>10.1f}{mark}")
    memory = report.get("memory_breakdown")
    if memory:
        lines.append(format_breakdown(memory))
    for on in (True, False):
        fits = report.get(f"max_batch_{'with' if on else 'without'}_grad_checkpointing")
        if fits is not None:
            lines.append(f"largest batch {'with' if on else 'without'} model.grad_checkpointing: {fits}")
    return "\n".join(lines)


def format_breakdown(memory: dict) -> str:
    """One line of `MemoryBreakdown.as_dict(batch)`."""
    return (f"memory at batch {memory['batch']}: parameters {memory['parameters_mb']:.1f} MiB + gradients "
            f"{memory['gradients_mb']:.1f} + optimizer state {memory['optimizer_state_mb']:.1f} + activations "
            f"{memory['activations_mb']:.1f} ({memory['activations_per_sample_mb']:.2f} per sample) + other "
            f"{memory['other_mb']:.1f} = {memory['total_mb']:.1f} MiB")


def resolve_auto_batch(cfg, device: torch.device, amp_dtype, run_dir: Path, dist, scan=None) -> tuple[int, int]:
    """`train.batch_size: auto` -> (per-device batch, accum_steps); logs the table, saves batch_finder.json.
    `scan`: the run's scan of its data where it labels it itself (build_run_data's).

    Every process measures its own device; all take the smallest batch any of them chose, so the
    effective batch is the same everywhere.
    """
    from imgcls.core.files import write_json
    from imgcls.data.build import scan_splits

    train_index = scan(cfg).train_index if scan is not None else scan_splits(cfg)[0]
    if cfg.distill.teacher:  # a teacher that cannot teach is refused before the search (exit 2)
        check_teacher(cfg, train_index.classes)
    log.info("train.batch_size=auto: searching the largest batch that fits on %s (model %s, %d px)...", device,
             cfg.model.name, cfg.data.img_size)
    report = run_finder(cfg, device, amp_dtype, len(train_index.classes), len(train_index), dist.world_size)
    chosen = report["fastest_small_batch"]
    if dist.enabled:
        chosen = min_over_ranks(chosen, device)
        report["fastest_small_batch"] = chosen
        report["batch_size"], report["accum_steps"] = accumulation_for(chosen, report["target_effective_batch"],
                                                                       dist.world_size)
        report["effective_batch"] = report["batch_size"] * report["accum_steps"] * dist.world_size
    log.info("batch-size finder (largest fitting batch %d; %s):\n%s", report["max_batch"],
             f"CPU memory budget {report['memory_budget_mb']:.0f} MiB" if report["memory_budget_mb"] else
             "out-of-memory search", format_finder_table(report))
    log.info("train.batch_size=auto -> batch %d x accum_steps %d x %d process(es) = effective batch %d "
             "(target %d, train.target_effective_batch)", report["batch_size"], report["accum_steps"],
             dist.world_size, report["effective_batch"], report["target_effective_batch"])
    if dist.is_main:
        write_json(report, Path(run_dir) / "batch_finder.json")
    return report["batch_size"], report["accum_steps"]


def resolve_batch_size(cfg, resume_ckpt: Optional[dict], device: torch.device, amp_dtype, run_dir: Path,
                       dist, scan=None) -> tuple[int, int]:
    """(per-device batch, accum_steps) for the run: the configured ones, or for `train.batch_size: auto` the
    finder's choice. A resumed run keeps the batch the finder chose the first time: a new search could
    pick another one, which would change the math."""
    if cfg.train.batch_size != "auto":
        return cfg.train.batch_size, cfg.train.accum_steps
    saved_train = ((resume_ckpt or {}).get("config") or {}).get("train")
    if isinstance(saved_train, dict) and isinstance(saved_train.get("batch_size"), int):
        log.info("train.batch_size=auto: resuming with the batch chosen before, %d x accum %d",
                 saved_train["batch_size"], saved_train["accum_steps"])
        return saved_train["batch_size"], saved_train["accum_steps"]
    return resolve_auto_batch(cfg, device, amp_dtype, run_dir, dist, scan)
