"""The training run, as a table of contents: build the run (`training.parts.build_run`: every part finished,
restored from last.pt on --resume), then for each epoch train (`training.loop.train_one_epoch`), validate and
save, then calibrate best.pt and finish. `run` is the one entry: train.py, tune.py's search and the tests call it."""
from __future__ import annotations

import contextlib
import errno
import gc
import logging
import time
from typing import Optional

import imgcls.compute.distributed as dist_utils
from imgcls.compute.cpu_tuning import process_start
from imgcls.config import Config
from imgcls.core.errors import BadDataError, DiskFullError, ImageDecodeError, NonFiniteError, StopRequested
from imgcls.data.datasets import failure_reason
from imgcls.data.images import check_bad_fraction, check_validation_files
from imgcls.data.loaders import loader_length, original_message
from imgcls.evaluation.evaluate import evaluate
from imgcls.tasks import deciding_metric, task_of
from imgcls.training.calibrate import KeptOutputs, best_is_calibrated, calibrate_best
from imgcls.training.loop import EpochParts, train_one_epoch
from imgcls.training.optim import base_lr
from imgcls.training.parts import Run, build_run
from imgcls.training.rundir import continue_command
from imgcls.training.schedule import validation_due
from imgcls.training.state import EpochCounters, TrainState

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, run: Run):
        self.run = run
        self.started = time.perf_counter()
        self.val_skipped_files: list[str] = []
        self.val_batches = None  # the next validation's batches, when they were started ahead
        self.warned_undefined_metric = False  # said once: early_stop.metric is undefined on the validation split
        self.saves = RunSaves(run)
        # the validation outputs the calibration after training fits on, kept from the pass that made best.pt
        self.kept_outputs = KeptOutputs(task_of(run.cfg).supports("calibration"))
        self.parts = EpochParts(log=run.reporter, saves=self.saves, stop=AgreedStop(run),
                                log_interval=run.cfg.output.log_interval)

    # ------------------------------------------------------------ the run

    def fit(self) -> int:
        r = self.run
        r.stop.install()
        try:
            return self._fit()
        except StopRequested:
            self.saves.finish_pending()
            r.runlog.finish(r.state.step, "KILLED")
            log.warning("stopped by %s; last.pt holds epoch %d batch %d (step %d); continue with: %s",
                        r.stop.name(), r.state.epoch + 1, r.state.batch_in_epoch, r.state.step,
                        continue_command(r.run_dir / "last.pt", r.runtime.dist.world_size))
            self.write_summary()
            return r.stop.exit_status()
        except (BadDataError, ImageDecodeError, NonFiniteError) as err:
            # Too many unreadable files, or non-finite numbers: one clear message (listing the files), exit 1.
            log.error("%s", original_message(err))
            self.write_summary()
            return 1
        except (DiskFullError, OSError) as err:
            if isinstance(err, OSError) and err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            log.error("%s", err if isinstance(err, DiskFullError) else f"no space left on device in {r.run_dir}: {err}")
            r.reporter.roll_back_to(r.checkpointer.saved_state or TrainState(), r.classes, r.plan,
                                    self.val_skipped_files)
            return 1
        finally:
            self.saves.abandon_pending()
            r.stop.restore()
            r.runlog.close()

    def _fit(self) -> int:
        r, cfg = self.run, self.run.cfg
        if r.state.epoch >= cfg.train.epochs or r.state.stopped_early:
            if not best_is_calibrated(r.run_dir, r.runtime.dist):  # the run ended before its calibration was written
                self.calibrate()
            r.reporter.report_complete(r.state, r.run_dir)  # its summary.json stays as it was
            r.runlog.finish(r.state.step, "FINISHED")
            return 0
        # the first epoch's batches load while the objective prepares (a teacher's validation)
        next_batches = start_batches(r, r.state.epoch, r.state.epoch_counters().batches_done)
        r.objective.prepare(r.data.val_loader, r.step.input, r.classes)
        self.val_batches = validation_batches_at_start(r.data.val_loader)
        for epoch in range(r.state.epoch, cfg.train.epochs):
            if r.freeze is not None:
                r.freeze.set_epoch(epoch)
            due = validation_due(epoch + 1, cfg.train.epochs, cfg.train.val_interval)
            counters, seconds, resumed = self.train_epoch(epoch, next_batches, validation_due=due)
            # The next epoch's first batches load while this one validates and saves.
            next_batches = start_batches(r, epoch + 1) if epoch + 1 < cfg.train.epochs else None
            metrics = self.validate_trained_epoch(counters) if due else None
            r.state.finish_epoch()
            self.end_epoch(epoch, metrics, counters, seconds, resumed)
            if dist_utils.any_rank(r.stop.received, r.runtime.device):
                raise StopRequested()
            if r.state.stopped_early:
                break
        self.calibrate()
        self.saves.finish_pending()
        self.write_summary()
        r.reporter.log_done(r.state, r.run_dir, time.perf_counter() - self.started)
        r.runlog.finish(r.state.step, "FINISHED")
        dist_utils.barrier()
        return 0

    def train_epoch(self, epoch: int, batches, validation_due: bool) -> tuple[EpochCounters, float, EpochCounters]:
        """One epoch (from the resumed batch on) over `batches`, already started; returns its counters, the
        seconds it took here, and the counters it started from (non-zero in a resumed epoch)."""
        r = self.run
        counters = r.state.epoch_counters()
        resumed = EpochCounters(samples=counters.samples, data_time=counters.data_time)
        start = time.perf_counter()
        # persistent validation workers load ahead during the last step (others would fork there)
        if validation_due and reusable_workers(r.data.val_loader):
            batches = calling_at(batches, counters.batches_done, r.plan.batches_per_epoch - 1,
                                 self.start_validation)
        r.reporter.open_bar(epoch, counters.batches_done)
        try:
            train_one_epoch(r.step, self.parts, batches, r.plan.batches_per_epoch, r.state, counters)
        finally:
            r.reporter.close_bar()
        seconds = time.perf_counter() - start
        r.state.add_training(seconds, counters.samples - resumed.samples)
        self.saves.record_unreadable(counters.unreadable)
        return counters, seconds, resumed

    def validate_trained_epoch(self, counters: EpochCounters) -> dict:
        try:
            return self.validate()
        except StopRequested:
            # The epoch's training is done: save it as the state at the epoch's last batch, so a resumed
            # run validates this epoch again and goes on.
            self.saves.save(self.run.state, counters.snapshot())
            raise

    def start_validation(self) -> None:
        if self.val_batches is None:
            self.val_batches = iter(self.run.data.val_loader)

    def validate(self) -> dict:
        """The validation pass. A stop signal ends it at the next batch (StopRequested): in one process at
        once (also out of a blocked read), under DDP at the next batch the ranks agree on."""
        r = self.run
        self.saves.sync_buffers()
        # data.limit_val_batches is applied by the loader's sampler (the first limit x batch samples of the
        # split, sharded across ranks), so the samples counted do not depend on the world size.
        stopping, should_stop = r.stop.validation_guard(r.runtime.dist, loader_length(r.data.val_loader),
                                                        r.runtime.device)
        batches = self.val_batches if self.val_batches is not None else r.data.val_loader
        self.val_batches = None
        model, on_outputs = r.objective.validation_model(r.models.eval_model)
        on_outputs = self.kept_outputs.start(r.models.eval_model, on_outputs, self.validations_left())
        completed = False
        try:
            with stopping, r.reporter.validation(r.data.val_loader) as on_batch:
                sums, unreadable = evaluate(model, batches, r.step.input, task_of(r.cfg), r.classes,
                                            on_batch=on_batch, should_stop=should_stop, on_outputs=on_outputs)
            completed = True
        finally:
            self.kept_outputs.finish(completed)
        sums.all_reduce()
        metrics = sums.compute() | r.objective.validation_metrics(model)
        paths = [r.data.val_index.paths[i] for i in dist_utils.union_of_lists(unreadable)]
        check_validation_files(paths, len(r.data.val_index), metrics["num_samples"], r.cfg.data.max_bad_fraction)
        metrics["skipped_files"] = len(paths)
        self.val_skipped_files = paths
        return metrics

    def validations_left(self) -> int:
        """The scheduled validations from the current epoch's on (early stopping may end the run sooner)."""
        t = self.run.cfg.train
        return sum(validation_due(done, t.epochs, t.val_interval) for done in range(self.run.state.epoch + 1,
                                                                                   t.epochs + 1))

    def end_epoch(self, epoch: int, metrics: Optional[dict], counters: EpochCounters, seconds: float,
                  resumed: EpochCounters) -> None:
        """Best and early stopping, the plateau schedule, the epoch's line and row, last.pt, summary.json.
        `metrics` None: an epoch without validation (train.val_interval)."""
        r, es = self.run, self.run.cfg.early_stop
        improved = metrics is not None and r.state.record_validation(epoch, metrics, es.metric, es.min_delta,
                                                                      es.patience)
        if improved:
            self.saves.start_best(metrics)
            self.kept_outputs.keep(epoch)
        deciding = deciding_metric(metrics, es.metric) if metrics is not None else es.metric
        if deciding != es.metric and not self.warned_undefined_metric:
            self.warned_undefined_metric = True
            log.warning("validation %s is undefined on this split (no validation image carries a tag): best.pt, "
                        "early stopping and the plateau schedule go by the validation loss", es.metric)
        if metrics is not None and r.step.end_epoch(metrics[deciding], deciding):
            log.info("schedule plateau: %s has not improved for %d validations; LR now %.6g",
                     deciding, r.cfg.schedule.plateau_patience, base_lr(r.step.optimizer))
        # the whole job's rate, over the samples this process ran since it (re)started the epoch
        elapsed = max(seconds, 1e-9)
        samples_per_s = (counters.samples - resumed.samples) * r.runtime.dist.world_size / elapsed
        r.reporter.report_epoch(epoch, r.state, metrics, counters, samples_per_s, seconds, improved,
                                base_lr(r.step.optimizer), (counters.data_time - resumed.data_time) / elapsed)
        # After the metrics row: a crash between the two re-runs the epoch's end on resume, which first
        # drops the row (RunLog.drop_epochs_from), so metrics.csv never misses or repeats an epoch. The file is
        # written while the next epoch trains (or the calibration computes); its row is sent once it is whole.
        self.saves.start_last()
        self.write_summary()

    def calibrate(self) -> None:
        r = self.run
        self.saves.finish_pending(only="best.pt")  # rewritten by the calibration; last.pt is written meanwhile
        calibrate_best(r.cfg, r.run_dir, r.models.eval_model, r.data.val_loader, r.data.train_index, r.step.input,
                       r.runtime.dist, val_outputs=self.kept_outputs.outputs())

    def write_summary(self) -> None:
        r = self.run
        r.reporter.write_summary(r.state, r.classes, r.plan, self.val_skipped_files)


class RunSaves:
    """best.pt and last.pt at epoch ends, written on threads in that order while the run goes on (`start_best`,
    `start_last`), and last.pt, through the epoch's parts, at checkpoint.every_steps and before a stop. Every
    save, and the run's end, first waits for the pending ones (`finish_pending`, on every rank); the epoch's
    row is sent once its last.pt is whole."""

    def __init__(self, run: Run):
        self.run = run
        self.every_steps = run.cfg.checkpoint.every_steps
        self.pending: list = []  # training.checkpoints.PendingSave, in the order they were started

    def due(self, step: int) -> bool:
        return self.every_steps > 0 and step % self.every_steps == 0

    def save(self, state: TrainState, snapshot: dict) -> None:
        """A save inside the epoch. Every rank is here at the same step: the unreadable files of all ranks go
        into the state that rank 0 saves, and a split with too many of them stops the run now rather than at
        the epoch end."""
        self.record_unreadable(snapshot["unreadable"])
        state.save_mid_epoch(snapshot)
        self.save_last()

    def start_best(self, metrics: dict) -> None:
        """The epoch end's best.pt, written on a thread from a copy (Checkpointer.start_best)."""
        self.finish_pending()
        self.pending.append(self.run.checkpointer.start_best(self.run.state, metrics))

    def start_last(self) -> None:
        """The epoch end's last.pt, written on a thread from a copy after any best.pt (Checkpointer.start_last):
        the resnet18 recipes' 90 MB took 0.1-0.5 s of every epoch's end, and of the tail after the last one."""
        self.finish_pending(only="last.pt")  # left pending: this epoch's best.pt, which lands first
        self.sync_buffers()
        after = self.pending[-1] if self.pending else None
        self.pending.append(self.run.checkpointer.start_last(self.run.state, after=after))

    def save_last(self) -> None:
        # All ranks come here together (epoch ends, and steps the ranks agreed on): afterwards every rank
        # holds the BN statistics that rank 0 saves, as a resumed run will.
        self.finish_pending()
        self.sync_buffers()
        self.run.checkpointer.save_last(self.run.state)

    def finish_pending(self, only: Optional[str] = None) -> None:
        """Wait for the pending saves (`only`: those of that file, and the ones started before them; a full disk
        raises here, on every rank); after a last.pt, send the epoch's row, now that last.pt holds its epoch."""
        upto = len(self.pending) if only is None else max(
            (i + 1 for i, pending in enumerate(self.pending) if pending.name == only), default=0)
        done, self.pending = self.pending[:upto], self.pending[upto:]
        for pending in done:
            pending.wait()
            if pending.name == "last.pt":
                self.run.runlog.checkpoint_saved()

    def abandon_pending(self) -> None:
        """On the way out after another error: let the pending writes end (whole or not), sending no row."""
        pending, self.pending = self.pending, []
        for save in pending:
            with contextlib.suppress(Exception):
                save.wait()

    def sync_buffers(self) -> None:
        """Under DDP every rank takes rank 0's BN statistics (called on all ranks at the same point)."""
        r = self.run
        if r.runtime.dist.enabled and not r.cfg.model.sync_bn:
            ema = r.models.ema
            dist_utils.broadcast_buffers(r.models.model, *([ema.module] if ema is not None else []))

    def record_unreadable(self, indices) -> None:
        r = self.run
        record_unreadable(r.state, r.data, dist_utils.union_of_lists(sorted(indices)), r.cfg.data.max_bad_fraction)


class AgreedStop:
    """A stop signal, at a step every rank agrees on."""

    def __init__(self, run: Run):
        self.signal, self.dist, self.device = run.stop, run.runtime.dist, run.runtime.device

    def requested(self, step: int) -> bool:
        return self.signal.agreed(step, self.dist, self.device)


def start_batches(run: Run, epoch: int, start_batch: int = 0):
    """The training batches of `epoch` from `start_batch` on; the loader workers start loading them now."""
    run.data.sampler.set_epoch(epoch, start_batch)
    return iter(run.data.train_loader)


def validation_batches_at_start(loader):
    """Start the validation loader's persistent workers at the run's start, while this process's heap is
    small, and let them load the first validation's batches; None where iterating forks no reusable
    workers. A fork shares every page of the heap with the children copy-on-write: forked in the middle
    of training, with gigabytes of kept activations, each page the next steps write is copied once
    (seconds of system time for resnet50 at 224 px; docs/performance.md)."""
    return iter(loader) if reusable_workers(loader) else None


def reusable_workers(loader) -> bool:
    """Whether iterating `loader` again reuses its worker processes (none are forked)."""
    return loader.num_workers > 0 and loader.persistent_workers


def calling_at(batches, first: int, at: int, action):
    """`batches`, numbered from `first`; `action()` runs as batch `at` is handed out."""
    for index, batch in enumerate(batches, first):
        if index == at:
            action()
        yield batch


def record_unreadable(state: TrainState, data, indices: list[int], max_bad_fraction: float) -> None:
    """Add the training files at `indices` (every rank's) to the state's skipped files, each new one named
    in a warning; a split with too many of them stops the run (BadDataError)."""
    paths, dataset = data.train_index.paths, data.train_loader.dataset
    new = [i for i in indices if paths[i] not in state.skipped_files]
    for i in new:
        log.warning("unreadable training file skipped (%s): %s", failure_reason(dataset, i), paths[i])
    state.skip_files([paths[i] for i in new])
    check_bad_fraction(state.skipped_files, len(data.train_index), "training", max_bad_fraction)


@contextlib.contextmanager
def open_trainer(cfg: Config, resume: Optional[str] = None, finetune: Optional[str] = None,
                 finetune_partial: bool = False):
    """A Trainer over a run built from `cfg` (the caller's config is not changed); on leaving, the run's
    resources (loader workers, the run directory's lock, the tracking run) are released."""
    with contextlib.ExitStack() as closing:
        trainer = Trainer(build_run(cfg, resume, finetune, finetune_partial, closing))
        trainer.run.reporter.log_startup(trainer.run.data, trainer.run.runtime, trainer.run.plan)
        yield trainer


def run(cfg: Config, resume: Optional[str] = None, finetune: Optional[str] = None,
        finetune_partial: bool = False) -> int:
    """Train `cfg`; the exit status."""
    try:
        with open_trainer(cfg, resume, finetune, finetune_partial) as trainer:
            if process_start() is not None:
                # A command's process (train.py, not a library caller's heap): what the imports and the set-up
                # made lives for the whole run; frozen, the collector's full passes skip it (memory is still
                # freed by reference counts)
                gc.freeze()
            return trainer.fit()
    finally:
        dist_utils.shutdown()
