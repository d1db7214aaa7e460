"""What a run shows and records as it trains: the step lines (or a tqdm bar on a terminal), the epoch
lines, TensorBoard scalars, metrics.csv rows, summary.json, and the one-time advice when the model waits
for data."""
from __future__ import annotations

import logging
import sys
from typing import Optional

from data.health import DATA_WAIT_WARN_FRAC, data_wait_advice
from core.host import usable_cpus
from engine.device import precision_name
from engine.runlog import RunLog

log = logging.getLogger("train")


class RunReporter:
    def __init__(self, cfg, runlog: RunLog, is_main: bool, world_size: int, total_steps: int,
                 batches_per_epoch: int):
        self.cfg = cfg
        self.runlog = runlog
        self.is_main = is_main
        self.world_size = world_size
        self.total_steps = total_steps
        self.batches_per_epoch = batches_per_epoch
        self.bar = None
        self.wait_warned = False

    def log_startup(self, data, device, amp_dtype, plan) -> None:
        """What the run will do: the data, the model and precision, the batch and step arithmetic."""
        cfg, classes = self.cfg, data.classes
        log.info("data: %d training images, %d validation images, %d classes (%s)", len(data.train_index),
                 len(data.val_index), len(classes), ", ".join(classes[:10]) + (", ..." if len(classes) > 10 else ""))
        log.info("model %s on %s, precision %s, channels_last %s, %d process(es)", cfg.model.name, device,
                 precision_name(amp_dtype), cfg.train.channels_last, self.world_size)
        log.info("effective batch %d (batch %d x accum %d x %d process(es)) | steps/epoch %d | total steps %d | "
                 "warmup steps %d | peak lr %.6g (%s scaling of %.6g at batch %d)", plan.effective_batch,
                 plan.batch_size, plan.accum_steps, plan.world_size, plan.steps_per_epoch, plan.total_steps,
                 plan.warmup_steps, plan.peak_lr, cfg.optim.lr_scaling, cfg.optim.lr, cfg.optim.base_batch_size)

    def open_bar(self, epoch: int, start_batch: int) -> None:
        """A tqdm bar for the epoch when `output.progress_bar` says so (auto: on a terminal), rank 0 only."""
        mode = self.cfg.output.progress_bar
        on = mode is True or (mode == "auto" and sys.stderr.isatty())
        self.bar = None
        if on and self.is_main:
            from tqdm import tqdm

            self.bar = tqdm(total=self.batches_per_epoch, initial=start_batch, desc=f"epoch {epoch + 1}",
                            dynamic_ncols=True, leave=False)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def on_batch(self) -> Optional[callable]:
        """The per-batch callback for the loop (None without a bar: nothing to do per batch)."""
        return self.bar.update if self.bar is not None else None

    def log_step(self, step: int, values: dict) -> None:
        values["train/samples_per_s"] *= self.world_size  # the whole job's rate
        self.runlog.scalars(values, step)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{values['train/loss']:.4f}", lr=f"{values['train/lr']:.3g}",
                                 img_s=f"{values['train/samples_per_s']:.0f}")
        else:
            grad_norm, skipped = values["train/grad_norm"], values.get("train/skipped_steps")
            log.info("step %d/%d  loss %.4f  lr %.4g  grad norm %s  %.0f img/s  data wait %.0f%%%s", step,
                     self.total_steps, values["train/loss"], values["train/lr"],
                     "-" if grad_norm is None else f"{grad_norm:.3g}", values["train/samples_per_s"],
                     100 * values["train/data_wait_frac"], f"  ({skipped} skipped)" if skipped else "")
        wait = values["train/data_wait_frac"]
        if wait > DATA_WAIT_WARN_FRAC and not self.wait_warned and step > 2 * self.cfg.output.log_interval:
            self.wait_warned = True
            d = self.cfg.data
            log.warning("%s", data_wait_advice(wait, d.num_workers, usable_cpus(), d.prefetch_factor))

    def report_epoch(self, epoch: int, state, metrics: dict, counters, samples_per_s: float, seconds: float,
                     improved: bool, lr: float, wait_frac: Optional[float]) -> None:
        """The epoch line, its TensorBoard scalars and its metrics.csv row."""
        cfg, es = self.cfg, self.cfg.early_stop
        train_loss = counters.mean_loss()
        log.info("epoch %d/%d  train loss %.4f  val top1 %.2f  top5 %.2f  loss %.4f  mean class acc %.2f  "
                 "(%d samples)  %.0f img/s  %s", epoch + 1, cfg.train.epochs, train_loss, metrics["top1"],
                 metrics["top5"], metrics["loss"], metrics["mean_class_acc"], metrics["num_samples"], samples_per_s,
                 "best" if improved else f"no improvement for {state.bad_epochs} epoch(s)")
        if state.stopped_early:
            log.info("early stopping: %s has not improved by more than %g for %d epochs; best epoch %d",
                     es.metric, es.min_delta, es.patience, state.best_epoch)
        self.runlog.scalars({f"val/{k}": metrics[k] for k in ("top1", "top5", "loss", "mean_class_acc")} |
                            {"train/epoch_loss": train_loss, "train/epoch_samples_per_s": samples_per_s}, state.step)
        self.runlog.epoch_row({
            "epoch": epoch + 1, "step": state.step, "lr": lr, "train_loss": train_loss,
            "train_samples_per_s": samples_per_s, "data_wait_frac": wait_frac, "epoch_time_s": seconds,
            "val_top1": metrics["top1"], "val_top5": metrics["top5"], "val_loss": metrics["loss"],
            "val_mean_class_acc": metrics["mean_class_acc"], "val_num_samples": metrics["num_samples"],
            "skipped_files": len(state.skipped_files)})
        self.runlog.flush()

    def write_summary(self, state, classes: list[str], plan, val_skipped_files: list[str]) -> None:
        s = state
        self.runlog.summary({
            "best_epoch": s.best_epoch,
            "best": s.best_metrics,
            "best_metric": self.cfg.early_stop.metric,
            "epochs_completed": s.epoch,
            "steps_completed": s.step,
            "stopped_early": s.stopped_early,
            "train_samples_per_s": s.train_samples * self.world_size / s.train_time_s if s.train_time_s > 0 else 0.0,
            "train_time_s": s.train_time_s,
            "skipped_files": list(s.skipped_files),
            "skipped_steps": s.skipped_steps,
            "skipped_val_files": list(val_skipped_files),
            "classes": list(classes),
            "effective_batch": plan.effective_batch,
            "peak_lr": plan.peak_lr,
        })
