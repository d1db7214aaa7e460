"""What a run shows and records as it trains: the step lines (or a tqdm bar on a terminal), the epoch
lines, TensorBoard scalars, metrics.csv rows, summary.json, and the one-time advice when the model waits
for data."""
from __future__ import annotations

import logging
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from imgcls.compute.device import precision_name
from imgcls.core.host import process_age_s, usable_cpus
from imgcls.data.images import DATA_WAIT_WARN_FRAC, data_wait_advice
from imgcls.data.loaders import loader_length
from imgcls.objectives.base import Objective
from imgcls.tasks import deciding_metric, task_of
from imgcls.tasks.base import nonfinite_metrics
from imgcls.training.optim import optimizer_options
from imgcls.training.runlog import RunLog
from imgcls.training.schedule import schedule_warnings

log = logging.getLogger(__name__)


class RunReporter:
    def __init__(self, cfg, runlog: RunLog, is_main: bool, world_size: int, total_steps: int,
                 batches_per_epoch: int, objective: Objective):
        self.cfg = cfg
        self.runlog = runlog
        self.is_main = is_main
        self.world_size = world_size
        self.total_steps = total_steps
        self.batches_per_epoch = batches_per_epoch
        self.bar = None
        self.redirect = None      # tqdm's logging redirection while a bar is up
        self.epoch = 0
        self.step_lines = 0
        self.wait_warned = False
        self.top5_k = 5  # top5 is top-k with k = min(5, classes): stated beside it when under 5
        self.task = task_of(cfg)
        self.last_agreement: Optional[float] = None  # a distilled run's latest validation agreement, for `done:`
        self.objective = objective  # its summary goes into summary.json (distillation: the teacher's record)

    def log_startup(self, data, runtime, plan) -> None:
        """What the run will do: the data, the model and precision, the CPU threads (count, where it came
        from), the batch and step arithmetic, the recipe."""
        cfg, classes = self.cfg, data.classes
        self.top5_k = min(5, len(classes))
        log.info("data: %d training images, %d validation images, %d classes (%s)", len(data.train_index),
                 len(data.val_index), len(classes), ", ".join(classes[:10]) + (", ..." if len(classes) > 10 else ""))
        log.info("model %s on %s, precision %s, channels_last %s, %d process(es), %d CPU thread(s) (%s)",
                 cfg.model.name, runtime.device, precision_name(runtime.amp_dtype), cfg.train.channels_last,
                 self.world_size, runtime.threads, runtime.threads_source)
        log.info("effective batch %d (batch %d x accum %d x %d process(es)) | steps/epoch %d | total steps %d | "
                 "warmup steps %d | peak lr %.6g (%s scaling of %.6g at batch %d)", plan.effective_batch,
                 plan.batch_size, plan.accum_steps, plan.world_size, plan.steps_per_epoch, plan.total_steps,
                 plan.warmup_steps, plan.peak_lr, cfg.optim.lr_scaling, cfg.optim.lr, cfg.optim.base_batch_size)
        for line in [*self.task.startup_lines(cfg), *recipe_lines(cfg, plan)]:
            log.info("%s", line)
        for warning in [*self.task.startup_warnings(cfg), *schedule_warnings(cfg, plan)]:
            log.warning("%s", warning)

    def open_bar(self, epoch: int, start_batch: int) -> None:
        """A tqdm bar for the epoch when `output.progress_bar` says so (auto: on a terminal), rank 0 only."""
        self.epoch = epoch
        self._open_bar(self.batches_per_epoch, start_batch, self._epoch_label())

    def _epoch_label(self) -> str:
        return f"epoch {self.epoch + 1}/{self.cfg.train.epochs}"

    def _open_bar(self, total: Optional[int], initial: int, desc: str) -> None:
        mode = self.cfg.output.progress_bar
        on = mode is True or (mode == "auto" and sys.stderr.isatty())
        self.bar = None
        if on and self.is_main:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            # While the bar is up, log records (step lines, warnings) print above it on their own lines.
            self.redirect = logging_redirect_tqdm()
            self.redirect.__enter__()
            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, leave=False)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            self.redirect.__exit__(None, None, None)

    def batch_done(self) -> None:
        if self.bar is not None:
            self.bar.update()

    def on_batch(self) -> Optional[callable]:
        """The per-batch callback of a validation pass (None without a bar: nothing to do per batch)."""
        return self.bar.update if self.bar is not None else None

    @contextmanager
    def validation(self, loader):
        """Around a validation pass over `loader`: a line, and a bar on a terminal; yields the per-batch
        callback. A shard stream's loader has no length: the line says so and the bar counts up."""
        num_batches = loader_length(loader)
        log.info("%s: validating (%s)", self._epoch_label(),
                 f"{num_batches} batches" if num_batches is not None else "a shard stream")
        self._open_bar(num_batches, 0, f"{self._epoch_label()} validation")
        try:
            yield self.on_batch()
        finally:
            self.close_bar()

    def log_step(self, step: int, values: dict) -> None:
        """A step line in the log (whether or not a bar is shown), its TensorBoard scalars, the bar's numbers."""
        values["train/samples_per_s"] *= self.world_size  # the whole job's rate
        self.runlog.step_line(values, step)
        wait = values["train/data_wait_frac"]
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {values['train/loss']:.4f}, data wait {100 * wait:.0f}%")
        grad_norm, skipped = values["train/grad_norm"], values.get("train/skipped_steps")
        teacher = values.get("train/teacher_time_frac")
        log.info("step %d/%d  loss %.4f  lr %.4g  grad norm %s  %.0f img/s  data wait %.0f%%%s%s", step,
                 self.total_steps, values["train/loss"], values["train/lr"],
                 "-" if grad_norm is None else f"{grad_norm:.3g}", values["train/samples_per_s"], 100 * wait,
                 "" if teacher is None else f"  teacher {100 * teacher:.0f}% of step time",
                 f"  ({skipped} skipped)" if skipped else "")
        self.step_lines += 1
        # the first two intervals include the loader's start-up
        if wait > DATA_WAIT_WARN_FRAC and not self.wait_warned and self.step_lines > 2:
            self.wait_warned = True
            d = self.cfg.data
            log.warning("%s", data_wait_advice(wait, d.num_workers, usable_cpus(), d.prefetch_factor))

    def report_epoch(self, epoch: int, state, metrics: Optional[dict], counters, samples_per_s: float,
                     seconds: float, improved: bool, lr: float, wait_frac: Optional[float]) -> None:
        """The epoch line, its TensorBoard scalars and its metrics.csv row (validation columns empty in an
        epoch without validation)."""
        cfg, es = self.cfg, self.cfg.early_stop
        train_loss = counters.mean_loss()
        progress = "best" if improved else f"no improvement for {state.bad_epochs} validation(s)"
        if metrics is None:
            log.info("epoch %d/%d  train loss %.4f  %.0f img/s  (no validation: train.val_interval=%d)", epoch + 1,
                     cfg.train.epochs, train_loss, samples_per_s, cfg.train.val_interval)
            metrics = {}
        else:
            log.info("epoch %d/%d  train loss %.4f  %s  %.0f img/s  %s", epoch + 1, cfg.train.epochs, train_loss,
                     self.task.epoch_text(metrics, self.top5_k), samples_per_s, progress)
            self._warn_nonfinite(epoch, metrics, state)
        if metrics.get("teacher_agreement") is not None:
            self.last_agreement = metrics["teacher_agreement"]
            log.info("epoch %d/%d  teacher agreement %.2f%% of validation images", epoch + 1, cfg.train.epochs,
                     metrics["teacher_agreement"])
        if "old_top1" in metrics:
            log.info("epoch %d/%d  top1 old classes %s  new classes %s  all %s", epoch + 1, cfg.train.epochs,
                     *(self.task.metric("top1").format(metrics.get(k)) for k in ("old_top1", "new_top1", "top1")))
        if state.stopped_early:
            log.info("early stopping: %s has not improved by more than %g for %d validations; best epoch %d",
                     es.metric, es.min_delta, es.patience, state.best_epoch)
        self.runlog.scalars({f"val/{k}": metrics.get(k) for k in self.task.scalar_names()} |
                            {"train/epoch_loss": train_loss, "train/epoch_samples_per_s": samples_per_s}, state.step)
        self.runlog.epoch_row({
            "epoch": epoch + 1, "step": state.step, "lr": lr, "train_loss": train_loss,
            "train_samples_per_s": samples_per_s, "data_wait_frac": wait_frac, "epoch_time_s": seconds,
            "skipped_files": len(state.skipped_files), **{f"val_{k}": v for k, v in metrics.items()}})
        self.runlog.flush()
        self.runlog.curves.epoch_end()

    def roll_back_to(self, saved, classes: list[str], plan, val_skipped_files: list[str]) -> None:
        """After a failed save: metrics.csv and summary.json describe `saved` (what last.pt holds), as a resume
        will."""
        try:
            self.runlog.drop_epochs_from(saved.epoch + 1)
            self.write_summary(saved, classes, plan, val_skipped_files)
        except OSError as err:
            log.warning("metrics.csv / summary.json could not be brought back to last.pt's state either: %s", err)

    def write_summary(self, state, classes: list[str], plan, val_skipped_files: list[str]) -> None:
        s = state
        self.runlog.summary({
            "best_epoch": s.best_epoch,
            "best": s.best_metrics,
            "best_metric": self.cfg.early_stop.metric,
            "top5_k": min(5, len(classes)),
            "epochs_completed": s.epoch,
            "steps_completed": s.step,
            "stopped_early": s.stopped_early,
            "train_samples_per_s": self.train_rate(s),
            "train_time_s": s.train_time_s,
            "skipped_files": list(s.skipped_files),
            "skipped_steps": s.skipped_steps,
            "skipped_val_files": list(val_skipped_files),
            "classes": list(classes),
            "effective_batch": plan.effective_batch,
            "peak_lr": plan.peak_lr,
            **self.objective.summary(),
        })

    def train_rate(self, state) -> float:
        """The whole job's training images per second over the run (its resumed parts included)."""
        return state.train_samples * self.world_size / state.train_time_s if state.train_time_s > 0 else 0.0

    @staticmethod
    def _warn_nonfinite(epoch: int, metrics: dict, state) -> None:
        bad = nonfinite_metrics(metrics)
        if bad:
            kept = f"best.pt stays at epoch {state.best_epoch}" if state.best_epoch else "no best.pt yet"
            log.warning("epoch %d: validation %s not finite (%s): the model has diverged, so this epoch is never "
                        "best (%s); lower optim.lr or set train.clip_grad_norm", epoch + 1,
                        "is" if len(bad) == 1 else "are", ", ".join(f"{k} {metrics[k]}" for k in bad), kept)

    def _best_text(self, state, run_dir) -> str:
        if not state.best_metrics:
            return "no best.pt (no epoch was validated with finite numbers)"
        metric = deciding_metric(state.best_metrics, self.cfg.early_stop.metric)
        value = self.task.metric(metric).format(state.best_metrics[metric])
        return f"best epoch {state.best_epoch}: {metric} {value} ({Path(run_dir) / 'best.pt'})"

    def log_done(self, state, run_dir, wall_s: float) -> None:
        """The run's last line: what it reached, where the files are, how long it took (the whole process,
        imports included, and the run from the start of its set-up)."""
        log.info("done: %d epoch(s)%s, %s%s | summary %s | wall time %s (process; %s from set-up) | %.0f img/s",
                 state.epoch, " (stopped early)" if state.stopped_early else "", self._best_text(state, run_dir),
                 objective_text(self.objective.summary(), self.last_agreement), Path(run_dir) / "summary.json",
                 format_duration(process_age_s()), format_duration(wall_s), self.train_rate(state))

    def report_complete(self, state, run_dir) -> None:
        """`--resume` of a run that has nothing left to do: say so, and how to train further."""
        done = (f"stopped early after epoch {state.epoch}" if state.stopped_early else
                f"all {state.epoch} epochs done")
        log.info("the run in %s is complete (%s): %s. Nothing to resume. To train further: --finetune %s with a "
                 "new output.dir (a new schedule from these weights), or a larger train.epochs with a new "
                 "output.dir (a new run)", run_dir, done, self._best_text(state, run_dir), Path(run_dir) / "best.pt")


def objective_text(summary: dict, agreement: Optional[float]) -> str:
    """The done line's part for a distilled run (empty otherwise): the teacher, its validation figures, and the
    last validation's agreement with it (percent of images)."""
    teacher = summary.get("teacher")
    if not teacher:
        return ""
    figures = "".join(f" {k} {teacher[k]:.2f}" for k in ("top1", "top5", "mAP") if teacher.get(k) is not None)
    agreed = f", agreement {agreement:.2f}% at the last validation" if agreement is not None else ""
    return f" | teacher {teacher.get('source')}{figures}{agreed}"


def format_duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _schedule_text(cfg, plan) -> str:
    s = cfg.schedule
    warmup = (f"warmup {s.warmup_epochs:g} epochs ({plan.warmup_steps} steps) from {s.warmup_start_factor:g} x peak, "
              f"then " if plan.warmup_steps else "")
    decay = {"cosine": f"cosine to {s.min_lr:g}", "constant": "constant",
             "poly": f"poly (power {s.power:g}) to {s.min_lr:g}",
             "step": f"step: x {s.gamma:g} every {s.step_epochs:g} epochs",
             "multistep": f"multistep: x {s.gamma:g} at epochs {', '.join(f'{m:g}' for m in s.milestones)}",
             "plateau": f"plateau: x {s.gamma:g} after {s.plateau_patience} epochs without a better "
                        f"{cfg.early_stop.metric}"}[s.name]
    floor = f" (floor {s.min_lr:g})" if s.name in ("step", "multistep", "plateau") and s.min_lr > 0 else ""
    return f"schedule: {warmup}{decay}{floor}, per optimizer step ({plan.total_steps} steps)"


def recipe_lines(cfg, plan) -> list[str]:
    """The recipe in the start-up lines: augmentation, mixing, loss, optimizer, schedule, EMA."""
    d, t, o, m = cfg.data, cfg.train, cfg.optim, cfg.model
    mixes = [f"mixup alpha {t.mixup_alpha:g}"] * (t.mixup_alpha > 0) + [f"cutmix alpha {t.cutmix_alpha:g}"] * (
        t.cutmix_alpha > 0)
    mixing = "off" if not mixes else (" / ".join(mixes) + (f" (cutmix share {t.mix_switch_prob:g})" if len(mixes) > 1
                                                           else "") + f", {t.mix_prob:.0%} of micro-batches"
                                      + (f", first {t.mix_off_epoch} epochs" if t.mix_off_epoch else ""))
    loss = ("cross-entropy" if t.loss == "ce" else "binary cross-entropy" +
            (f", targets thresholded at {t.bce_target_thresh:g}" if t.bce_target_thresh is not None else ""))
    if t.loss == "asl":
        loss = f"asymmetric loss (gamma_neg {t.asl_gamma_neg:g}, gamma_pos {t.asl_gamma_pos:g}, clip {t.asl_clip:g})"
    if t.loss == "focal":
        loss = f"focal loss (gamma {t.focal_gamma:g})"
    if t.class_weights != "none":
        loss += ", class weights (the train.class_weights line above)"
    options = ", ".join(f"{k} {list(v) if isinstance(v, tuple) else v}" for k, v in optimizer_options(o).items())
    ema = ("off" if m.ema_decay is None else f"decay {m.ema_decay:g} every {m.ema_every_steps} step(s)"
           + (", warmup" if m.ema_warmup else ""))
    return [f"augmentation: random resized crop {d.img_size} px (scale {d.scale}), hflip {d.hflip:g}, colour jitter "
            f"{d.color_jitter:g}, random erasing {d.random_erasing:g} (auto-augment, repeats and the eval size: "
            f"the data lines above)",
            f"mixing: {mixing}",
            f"loss: {loss}, label smoothing {t.label_smoothing:g}",
            f"optimizer: {o.name} ({options}), weight decay {o.weight_decay:g} (not on norm and bias parameters)",
            _schedule_text(cfg, plan),
            f"weight EMA: {ema}"]
