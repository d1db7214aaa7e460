"""What a run shows while it trains: the step lines (or a tqdm bar on a terminal), TensorBoard step
scalars, and the one-time advice when the model waits for data."""
from __future__ import annotations

import logging
import sys
from typing import Optional

from data.health import DATA_WAIT_WARN_FRAC, data_wait_advice
from core.host import usable_cpus
from engine.runlog import RunLog

log = logging.getLogger("train")


class StepReporter:
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
            grad_norm = values["train/grad_norm"]
            log.info("step %d/%d  loss %.4f  lr %.4g  grad norm %s  %.0f img/s  data wait %.0f%%", step,
                     self.total_steps, values["train/loss"], values["train/lr"],
                     "-" if grad_norm is None else f"{grad_norm:.3g}", values["train/samples_per_s"],
                     100 * values["train/data_wait_frac"])
        wait = values["train/data_wait_frac"]
        if wait > DATA_WAIT_WARN_FRAC and not self.wait_warned and step > 2 * self.cfg.output.log_interval:
            self.wait_warned = True
            d = self.cfg.data
            log.warning("%s", data_wait_advice(wait, d.num_workers, usable_cpus(), d.prefetch_factor))
