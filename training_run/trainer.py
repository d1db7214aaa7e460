"""The training run: set up from the config in named phases, then epochs of train / validate / checkpoint.

Set-up phases, in order: runtime (device, precision, processes, the run directory and its lock, the
checkpoint to resume or fine-tune from), data (batch size, splits, loaders, their fingerprint), model
(weights, SyncBN, EMA), wrapping (DDP, compile), optimisation (run plan, `TrainStep`), start or restore
(checkpointer, run log). Every attribute is declared in `__init__`; `close` ends the loader workers and
lets the run directory go, on every exit path.
"""
from __future__ import annotations

import errno
import gc
import logging
import time
from pathlib import Path
from typing import Optional

import torch

from core.config import Config, check_data_root, check_tracking_client
from core.errors import BadDataError, ConfigError, DiskFullError, ImageDecodeError, NonFiniteError, StopRequested
from data.build import RunData, build_run_data
from data.datasets import failure_reason
from data.listing.fingerprint import data_fingerprint
from data.health import check_bad_fraction, check_validation_files
from data.loaders import loader_length, original_message, shutdown_workers
from runtime import distributed as dist_utils
from rundir.resume_hint import continue_command
from rundir.checkpoints import Checkpointer, TrainingParts
from rundir.resume import check_resume_compatible, claim_run_dir, load_finetune_source, resolve_resume, run_inputs
from rundir.restart import check_own_checkpoint, plan_resume
from rundir.shared_view import check_shared_checkpoint
from runtime.launcher import launch_info
from model_files.checkpoint_files import recorded_threads
from tuning.batch_finder import resolve_batch_size
from runtime.cpu_tuning import process_start
from runtime.device import DeviceInput, pin_memory_for
from runtime.runtime import Runtime, start_runtime
from evaluation.evaluate import evaluate
from objectives.distillation.agreement import AgreementProbe, validate_teacher
from objectives.distillation.distiller import Distiller, build_distiller, check_resume_teacher, teacher_summary
from objectives.distillation.teacher import check_same_teacher_everywhere, check_teacher
from training.loop import StepHooks, train_one_epoch
from training.optim import base_lr, describe_groups
from training_run.calibrate import best_is_calibrated, calibrate_best
from training_run.reporter import RunReporter
from training_run.setup import build_starting_model, prepare_data_once, wrap_for_training, write_run_files
from rundir.run_lock import RunDirLock, open_run_dir
from rundir.runlog import RunLog, setup_logging
from training.schedule import RunPlan, plan_run, validation_due
from runtime.signals import StopSignal
from rundir.state import EpochCounters, TrainState
from training.step import TrainStep, build_train_step
from models.ema import create_ema
from tasks import deciding_metric, task_of
from models.factory import BackboneFreeze, check_grad_checkpointing, check_model_name, prepare_pretrained
from tracking.training import TrainingTracking, open_training_tracking

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: Config, resume: Optional[str] = None, finetune: Optional[str] = None,
                 finetune_partial: bool = False):
        if resume and finetune:
            raise ConfigError(f"--resume {resume} and --finetune {finetune} exclude each other: --resume continues "
                              f"a run, --finetune starts a new one from a checkpoint's weights; pass one")
        self.cfg = cfg
        self.started = time.perf_counter()
        self.resume = resume
        self.finetune = finetune
        self.finetune_partial = finetune_partial
        self.stop_signal = StopSignal()
        self.state = TrainState()
        # runtime: device, precision, processes, CPU threads (runtime.runtime)
        self.runtime = Runtime(torch.device("cpu"), None)
        self.run_dir = Path(cfg.output.dir)
        self.run_lock: Optional[RunDirLock] = None  # rank 0's lock on the run directory, held for the run
        # data
        self.data: Optional[RunData] = None
        self.classes: list[str] = []
        self.fingerprint: Optional[dict] = None  # of the splits' files, recorded in last.pt, checked on resume
        # model: the bare model is trained and saved in last.pt; eval_model (the EMA when on) is validated
        # and saved in best.pt; train_model is what runs forward (DDP- and compile-wrapped where set)
        self.model: Optional[torch.nn.Module] = None
        self.pretrained: Optional[torch.nn.Module] = None  # model.pretrained: the source, until copied into model
        self.freeze: Optional[BackboneFreeze] = None
        self.ema: Optional[torch.nn.Module] = None
        self.eval_model: Optional[torch.nn.Module] = None
        self.train_model: Optional[torch.nn.Module] = None
        self.distiller: Optional[Distiller] = None  # distill.teacher: the frozen teacher and its loss term
        # optimisation
        self.plan: Optional[RunPlan] = None
        self.step: Optional[TrainStep] = None
        # start or restore
        self.checkpointer: Optional[Checkpointer] = None
        self.runlog: Optional[RunLog] = None
        self.reporter: Optional[RunReporter] = None
        self.val_skipped_files: list[str] = []
        self.epoch_wait_frac: Optional[float] = None
        self.val_batches = None  # the next validation's batches, when they were started ahead
        self.warned_undefined_metric = False  # said once: early_stop.metric is undefined on the validation split
        self.tracking: Optional[TrainingTracking] = None  # tracking.*: the run's experiment-tracking run

    # ------------------------------------------------------------ set-up

    def setup(self) -> None:
        resume_ckpt, finetune_ckpt = self._setup_runtime()
        self._setup_data(resume_ckpt)
        self._setup_model(resume_ckpt, finetune_ckpt)
        self.train_model = wrap_for_training(self.model, self.cfg, self.runtime.dist, self.runtime.device)
        self._setup_optimisation()
        self._start_or_restore(resume_ckpt)
        self._open_tracking(resume_ckpt, finetune_ckpt)
        self.reporter.log_startup(self.data, self.runtime, self.plan)
        if process_start() is not None:
            # A command's process (train.py, not a library caller's heap): what the imports and the set-up
            # made lives for the whole run; frozen, the collector's full passes skip it (they took 1 s of a
            # 45 s distillation on the digits; memory is still freed by reference counts)
            gc.freeze()

    def _setup_runtime(self) -> tuple[Optional[dict], Optional[dict]]:
        cfg = self.cfg
        check_data_root(cfg)
        check_tracking_client(cfg.tracking)
        check_model_name(cfg.model.name)
        check_grad_checkpointing(cfg.model)
        if cfg.distill.teacher:  # before the run directory and its log: a teacher that cannot teach leaves nothing
            check_teacher(cfg)
        self.runtime = start_runtime(cfg, distributed=True)
        self.run_lock = dist_utils.run_on_main(self.runtime.dist.is_main, lambda: open_run_dir(self.run_dir))
        dist_utils.barrier()
        setup_logging(self.run_dir, self.runtime.dist.is_main)
        launch = launch_info()
        # a torchrun restart continues from last.pt; rank 0 decides, so that every rank asks for the same files
        plan = dist_utils.run_on_main(self.runtime.dist.is_main, lambda: plan_resume(self.resume, self.run_dir, launch),
                                      share_result=True)
        self.resume = plan.resume
        check_shared_checkpoint(self.resume, self.run_dir, self.runtime.dist)
        claim_run_dir(self.run_dir, self.resume, cfg.output.overwrite, self.runtime.dist.is_main, run_inputs(cfg, self.finetune))
        resume_ckpt = resolve_resume(self.resume, self.run_dir) if self.resume else None
        if plan.must_own:
            check_own_checkpoint(resume_ckpt, self.run_dir, launch)
        self.runtime.apply_cpu_policy(cfg.train.threads, cfg.train.reuse_host_memory, recorded_threads(resume_ckpt),
                                      agree_over_ranks=True)
        finetune_ckpt = load_finetune_source(self.finetune) if self.finetune else None
        if cfg.model.pretrained:  # before the data: no weights (offline) is a usage error, exit 2
            self.pretrained, lines = prepare_pretrained(cfg, resume_ckpt.get("config") if resume_ckpt else None)
            for line in lines:
                log.info("%s", line)
        torch.manual_seed(cfg.train.seed)
        prepare_data_once(cfg, self.runtime.dist)
        return resume_ckpt, finetune_ckpt

    def _setup_data(self, resume_ckpt: Optional[dict]) -> None:
        cfg = self.cfg
        cfg.train.batch_size, cfg.train.accum_steps = resolve_batch_size(cfg, resume_ckpt, self.runtime.device, self.runtime.amp_dtype,
                                                                         self.run_dir, self.runtime.dist)
        pin = pin_memory_for(cfg.data.pin_memory, self.runtime.device)
        self.data = build_run_data(cfg, cfg.train.batch_size, self.runtime.dist.rank, self.runtime.dist.world_size, pin)
        self.classes = self.data.classes
        # rank 0 reads the file sizes, the others take its answer (one stat per file on a shared file system)
        self.fingerprint = dist_utils.run_on_main(
            self.runtime.dist.is_main, lambda: data_fingerprint(self.data.train_index, self.data.val_index), share_result=True)
        if resume_ckpt is not None:
            check_resume_compatible(resume_ckpt, cfg, self.classes, self.runtime.dist.world_size,
                                    self.data.sources.identity, self.fingerprint)

    def _setup_model(self, resume_ckpt: Optional[dict], finetune_ckpt: Optional[dict]) -> None:
        self.model = build_starting_model(self.cfg, self.classes, self.runtime.device, self.runtime.dist, resume_ckpt is not None,
                                          self.pretrained, finetune_ckpt, self.finetune, self.finetune_partial)
        self.pretrained = None
        m = self.cfg.model
        self.ema = create_ema(self.model, m.ema_decay, m.ema_every_steps, m.ema_warmup) if m.ema_decay else None
        self.eval_model = self.ema.module if self.ema is not None else self.model
        if self.cfg.distill.teacher:  # distillation (objectives/distillation): the teacher is loaded and checked here
            self.distiller = build_distiller(self.cfg, self.classes, self.model, self.runtime.device)
            check_same_teacher_everywhere(self.distiller.teacher)
        if resume_ckpt is not None:
            check_resume_teacher(resume_ckpt, self.distiller)

    def _setup_optimisation(self) -> None:
        cfg = self.cfg
        self.plan = plan_run(cfg, cfg.train.batch_size, self.data.sampler.num_batches(), self.runtime.dist.world_size)
        self.step = build_train_step(cfg, self.model, DeviceInput.from_config(cfg, self.runtime.device, self.runtime.amp_dtype),
                                     self.plan.peak_lr, self.plan.warmup_steps, self.plan.total_steps,
                                     train_model=self.train_model, ema=self.ema, distributed=self.runtime.dist.enabled,
                                     num_classes=len(self.classes), steps_per_epoch=self.plan.steps_per_epoch,
                                     rank=self.runtime.dist.rank, accum_steps=self.plan.accum_steps,
                                     distiller=self.distiller)
        if cfg.optim.layer_decay is not None or cfg.optim.head_lr_scale != 1.0:
            log.info("optim: %s (layer_decay %s, head_lr_scale %g)", describe_groups(self.step.optimizer),
                     cfg.optim.layer_decay, cfg.optim.head_lr_scale)
        # after the optimizer: its groups hold every parameter, frozen or not, so they resume across the unfreeze
        self.freeze = BackboneFreeze(self.model, cfg.model.unfreeze_epoch) if cfg.model.freeze else None

    def _start_or_restore(self, resume_ckpt: Optional[dict]) -> None:
        cfg, step = self.cfg, self.step
        parts = TrainingParts(self.model, self.eval_model, step.optimizer, step.scheduler, step.scaler, self.ema)
        self.checkpointer = Checkpointer(self.run_dir, self.runtime.dist.is_main, cfg, self.classes, self.runtime.dist.world_size,
                                         parts, self.data.sources.identity, self.fingerprint)
        if self.distiller is not None:  # last.pt records the teacher (and the feature projection)
            self.checkpointer.last_extras = lambda: {"distill": self.distiller.checkpoint_record()}
        if resume_ckpt is not None:
            self.state = self.checkpointer.restore(resume_ckpt)
            if self.distiller is not None:
                self.distiller.restore(resume_ckpt)
        self.runlog = RunLog(self.run_dir, self.runtime.dist.is_main, cfg.output.tensorboard, cfg.output.curves)
        self.reporter = RunReporter(cfg, self.runlog, self.runtime.dist.is_main, self.runtime.dist.world_size,
                                     self.plan.total_steps, self.plan.batches_per_epoch)
        if self.distiller is not None:
            self.reporter.step_extras = self.distiller.step_values
        if self.runtime.dist.is_main:
            write_run_files(self.run_dir, cfg, self.data, self.runlog,
                            self.state.epoch if resume_ckpt is not None else None)

    def _open_tracking(self, resume_ckpt: Optional[dict], finetune_ckpt: Optional[dict]) -> None:
        dist = self.runtime.dist
        self.tracking = open_training_tracking(self.cfg, self.run_dir, dist.is_main, dist.world_size,
                                               str(self.runtime.device), self.fingerprint, resume_ckpt,
                                               finetune_ckpt, self.finetune)
        self.checkpointer.tracking_run_id = self.tracking.run_id_for_checkpoint

    def _log_step(self, step: int, values: dict) -> None:
        self.reporter.log_step(step, values)
        self.tracking.log_step(step, values)

    # ------------------------------------------------------------ the run

    def fit(self) -> int:
        self.stop_signal.install()
        try:
            return self._fit()
        except StopRequested:
            self.tracking.status = "KILLED"
            log.warning("stopped by %s; last.pt holds epoch %d batch %d (step %d); continue with: %s",
                        self.stop_signal.name(), self.state.epoch + 1, self.state.batch_in_epoch,
                        self.state.step, continue_command(self.run_dir / "last.pt", self.runtime.dist.world_size))
            self.write_summary()
            return self.stop_signal.exit_status()
        except (BadDataError, ImageDecodeError, NonFiniteError) as err:
            # Too many unreadable files, or non-finite numbers: one clear message (listing the files), exit 1.
            log.error("%s", original_message(err))
            self.write_summary()
            return 1
        except (DiskFullError, OSError) as err:
            if isinstance(err, OSError) and err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            log.error("%s", err if isinstance(err, DiskFullError) else f"no space left on device in {self.run_dir}: {err}")
            self.reporter.roll_back_to(self.checkpointer.saved_state or TrainState(), self.classes, self.plan,
                                       self.val_skipped_files)
            return 1
        finally:
            self.stop_signal.restore()
            self.runlog.close()
            self.close()

    def close(self) -> None:
        """End the loader workers now (a failing run's would otherwise wait for interpreter exit) and let the
        run directory go; safe to call more than once."""
        if self.tracking is not None:
            self.tracking.close()
        if self.data is not None:
            shutdown_workers(self.data.train_loader, self.data.val_loader)
        if self.run_lock is not None:
            self.run_lock.release()

    def _fit(self) -> int:
        every = self.cfg.checkpoint.every_steps
        hooks = StepHooks(checkpoint_due=lambda step: every > 0 and step % every == 0,
                          stop_requested=lambda step: self.stop_signal.agreed(step, self.runtime.dist, self.runtime.device), save=self._save_mid_epoch,
                          log_step=self._log_step, log_interval=self.cfg.output.log_interval)
        if self.state.epoch >= self.cfg.train.epochs or self.state.stopped_early:
            if not best_is_calibrated(self.run_dir, self.runtime.dist):  # the run ended before its calibration was written
                self._calibrate()
            self.reporter.report_complete(self.state, self.run_dir)  # its summary.json stays as it was
            self.tracking.status = "FINISHED"
            return 0
        next_batches = None
        if self.distiller is not None:  # the teacher is validated once per run, before the first step
            if self.distiller.teacher_metrics is None:
                # while the first epoch's batches load (the workers' start was 0.5 s of a first epoch)
                next_batches = start_batches(self.data, self.state.epoch, self.state.epoch_counters().batches_done)
                self.distiller.teacher_metrics = validate_teacher(self.distiller, self.data.val_loader,
                                                                  self.step.input, self.classes)
            self.reporter.set_teacher(teacher_summary(self.distiller))
        self.val_batches = validation_batches_at_start(self.data.val_loader)
        for epoch in range(self.state.epoch, self.cfg.train.epochs):
            if self.freeze is not None:
                self.freeze.set_epoch(epoch)
            due = validation_due(epoch + 1, self.cfg.train.epochs, self.cfg.train.val_interval)
            counters, seconds, resumed = self._train_epoch(epoch, hooks, next_batches, validation_due=due)
            # The next epoch's first batches load while this one validates and saves.
            next_batches = start_batches(self.data, epoch + 1) if epoch + 1 < self.cfg.train.epochs else None
            try:
                metrics = self.validate() if due else None
            except StopRequested:
                # The epoch's training is done: save it as the state at the epoch's last batch, so a resumed
                # run validates this epoch again and goes on.
                self._save_mid_epoch(counters.snapshot())
                raise
            self.state.epoch, self.state.batch_in_epoch, self.state.epoch_snapshot = epoch + 1, 0, {}
            # the whole job's rate, over the samples this process ran since it (re)started the epoch
            samples_per_s = (counters.samples - resumed.samples) * self.runtime.dist.world_size / max(seconds, 1e-9)
            self.epoch_wait_frac = (counters.data_time - resumed.data_time) / max(seconds, 1e-9)
            self._end_epoch(epoch, metrics, counters, samples_per_s, seconds)
            if dist_utils.any_rank(self.stop_signal.received, self.runtime.device):
                raise StopRequested()
            if self.state.stopped_early:
                break
        self._calibrate()
        self.write_summary()
        self.reporter.log_done(self.state, self.run_dir, time.perf_counter() - self.started)
        self.tracking.finish(self.state.step)
        self.tracking.status = "FINISHED"
        dist_utils.barrier()
        return 0

    def _calibrate(self) -> None:
        calibrate_best(self.cfg, self.run_dir, self.eval_model, self.data.val_loader, self.data.train_index,
                       self.step.input, self.runtime.dist)

    def _start_validation(self) -> None:
        if self.val_batches is None:
            self.val_batches = iter(self.data.val_loader)

    def _train_epoch(self, epoch: int, hooks: StepHooks, batches=None,
                     validation_due: bool = False) -> tuple[EpochCounters, float, EpochCounters]:
        """One epoch (from the resumed batch on), over `batches` when they were started already; returns its
        counters, the seconds it took here, and the counters it started from (non-zero in a resumed epoch)."""
        counters = self.state.epoch_counters()
        resumed = EpochCounters(samples=counters.samples, data_time=counters.data_time)
        start = time.perf_counter()
        if batches is None:
            batches = start_batches(self.data, epoch, counters.batches_done)
        # persistent validation workers load ahead during the last step (others would fork there)
        if validation_due and reusable_workers(self.data.val_loader):
            batches = calling_at(batches, counters.batches_done, self.plan.batches_per_epoch - 1,
                                 self._start_validation)
        self.reporter.open_bar(epoch, counters.batches_done)
        try:
            train_one_epoch(self.step, batches, self.plan.batches_per_epoch, counters, self.state, hooks,
                            self.reporter.on_batch())
        finally:
            self.reporter.close_bar()
        seconds = time.perf_counter() - start
        self.state.train_time_s += seconds
        self.state.train_samples += counters.samples - resumed.samples
        self._record_unreadable(counters.unreadable)
        return counters, seconds, resumed

    def _save_mid_epoch(self, snapshot: dict) -> None:
        # Every rank is here at the same step: the unreadable files of all ranks go into the state that rank 0
        # saves, and a split with too many of them stops the run now rather than at the epoch end.
        self._record_unreadable(snapshot["unreadable"])
        self.state.batch_in_epoch = snapshot["batches_done"]
        self.state.epoch_snapshot = snapshot
        self.save_last()

    def _record_unreadable(self, indices) -> None:
        every_rank = dist_utils.union_of_lists(sorted(indices))
        record_unreadable(self.state, self.data, every_rank, self.cfg.data.max_bad_fraction)

    def _sync_buffers(self) -> None:
        """Under DDP every rank takes rank 0's BN statistics (called on all ranks at the same point)."""
        if self.runtime.dist.enabled and not self.cfg.model.sync_bn:
            dist_utils.broadcast_buffers(self.model, *([self.ema.module] if self.ema is not None else []))

    def save_last(self) -> None:
        # All ranks come here together (epoch ends, and steps the ranks agreed on): afterwards every rank
        # holds the BN statistics that rank 0 saves, as a resumed run will.
        self._sync_buffers()
        self.checkpointer.save_last(self.state)

    def validate(self) -> dict:
        """The validation pass. A stop signal ends it at the next batch (StopRequested): in one process at
        once (also out of a blocked read), under DDP at the next batch the ranks agree on."""
        self._sync_buffers()
        # data.limit_val_batches is applied by the loader's sampler (the first limit x batch samples of the
        # split, sharded across ranks), so the samples counted do not depend on the world size.
        stopping, should_stop = self.stop_signal.validation_guard(self.runtime.dist, loader_length(self.data.val_loader),
                                                                  self.runtime.device)
        batches = self.val_batches if self.val_batches is not None else self.data.val_loader
        self.val_batches = None
        probe = AgreementProbe(self.eval_model, self.distiller) if self.distiller is not None else None
        with stopping, self.reporter.validation(self.data.val_loader) as on_batch:
            sums, unreadable = evaluate(probe or self.eval_model, batches, self.step.input, task_of(self.cfg),
                                        self.classes, on_batch=on_batch, should_stop=should_stop,
                                        on_outputs=probe.count if probe is not None else None)
        sums.all_reduce()
        metrics = sums.compute()
        if probe is not None:
            metrics["teacher_agreement"] = probe.read()
        paths = [self.data.val_index.paths[i] for i in dist_utils.union_of_lists(unreadable)]
        check_validation_files(paths, len(self.data.val_index), metrics["num_samples"], self.cfg.data.max_bad_fraction)
        metrics["skipped_files"] = len(paths)
        self.val_skipped_files = paths
        return metrics

    def _end_epoch(self, epoch: int, metrics: Optional[dict], counters: EpochCounters, samples_per_s: float,
                   seconds: float) -> None:
        """`metrics` None: an epoch without validation (train.val_interval)."""
        es = self.cfg.early_stop
        improved = metrics is not None and self.state.record_validation(epoch, metrics, es.metric, es.min_delta,
                                                                         es.patience)
        if improved:
            self.checkpointer.save_best(self.state, metrics)
        deciding = deciding_metric(metrics, es.metric) if metrics is not None else es.metric
        if deciding != es.metric and not self.warned_undefined_metric:
            self.warned_undefined_metric = True
            log.warning("validation %s is undefined on this split (no validation image carries a tag): best.pt, "
                        "early stopping and the plateau schedule go by the validation loss", es.metric)
        if metrics is not None and self.step.end_epoch(metrics[deciding], deciding):
            log.info("schedule plateau: %s has not improved for %d validations; LR now %.6g",
                     deciding, self.cfg.schedule.plateau_patience, base_lr(self.step.optimizer))
        self.reporter.report_epoch(epoch, self.state, metrics, counters, samples_per_s, seconds, improved,
                                   base_lr(self.step.optimizer), self.epoch_wait_frac)
        # After the metrics row: a crash between the two re-runs the epoch's end on resume, which first
        # drops the row (RunLog.drop_epochs_from), so metrics.csv never misses or repeats an epoch.
        self.save_last()
        self.tracking.log_epochs()  # the row, now that last.pt holds its epoch
        self.write_summary()

    def write_summary(self) -> None:
        self.reporter.write_summary(self.state, self.classes, self.plan, self.val_skipped_files)


def start_batches(data: RunData, epoch: int, start_batch: int = 0):
    """The training batches of `epoch` from `start_batch` on; the loader workers start loading them now."""
    data.sampler.set_epoch(epoch, start_batch)
    return iter(data.train_loader)


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


def record_unreadable(state: TrainState, data: RunData, indices: list[int], max_bad_fraction: float) -> None:
    """Add the training files at `indices` (every rank's) to the state's skipped files, each new one named
    in a warning; a split with too many of them stops the run (BadDataError)."""
    paths, dataset = data.train_index.paths, data.train_loader.dataset
    new = [i for i in indices if paths[i] not in state.skipped_files]
    for i in new:
        log.warning("unreadable training file skipped (%s): %s", failure_reason(dataset, i), paths[i])
    state.skipped_files.extend(paths[i] for i in new)
    check_bad_fraction(state.skipped_files, len(data.train_index), "training", max_bad_fraction)


def run(cfg: Config, resume: Optional[str] = None, finetune: Optional[str] = None,
        finetune_partial: bool = False) -> int:
    trainer = Trainer(cfg, resume, finetune, finetune_partial)
    try:
        trainer.setup()
        return trainer.fit()
    finally:
        trainer.close()
        dist_utils.shutdown()
