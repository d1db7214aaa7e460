"""The training run: build everything from the config, then epochs of train / validate / checkpoint."""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from data.build import TrainData, build_train_data, eval_transform, prepare_root
from data.images import ImageDecodeError
from engine import distributed as dist_utils
from engine.checkpoint import (CheckpointError, bare_state_dict, load_checkpoint, rng_state, save_atomic,
                               set_rng_state)
from engine.config import Config, ConfigError, check_data_root, dump_yaml
from engine.device import pin_memory_for, resolve_amp, select_device
from engine.loop import EpochProgress, NonFiniteError, StepContext, StepHooks, StopRequested, evaluate, train_one_epoch
from engine.metrics import is_improvement
from engine.optim import build_optimizer
from engine.runlog import RunLog, setup_logging
from engine.schedule import build_scheduler, effective_batch, scaled_lr, steps_per_epoch, warmup_steps
from models.ema import create_ema
from models.factory import check_model_name, create_model, load_local_weights, load_matching_weights

log = logging.getLogger("train")

EXIT_SIGNAL = {signal.SIGTERM: 143, signal.SIGINT: 130}
# Keys that may change between a run and its resume without changing the math.
RESUME_FREE_KEYS = {"data.root", "data.num_workers", "data.pin_memory", "data.persistent_workers",
                    "data.prefetch_factor", "data.max_bad_fraction", "data.limit_val_batches", "output.dir",
                    "output.log_interval", "output.tensorboard", "output.progress_bar", "checkpoint.every_steps",
                    "early_stop.patience", "early_stop.min_delta", "train.device", "train.compile",
                    "train.memory_budget_gb", "train.max_nonfinite_in_row", "train.nonfinite"}


@dataclass
class TrainState:
    """Bookkeeping that goes into last.pt beside the model, optimizer, scheduler, scaler and RNG."""

    epoch: int = 0               # epochs completed
    step: int = 0                # optimizer steps done
    batch_in_epoch: int = 0      # batches of epoch `epoch` already consumed
    best_value: Optional[float] = None
    best_epoch: int = 0
    best_metrics: dict = field(default_factory=dict)
    bad_epochs: int = 0
    stopped_early: bool = False
    skipped_files: list = field(default_factory=list)
    skipped_steps: int = 0
    train_samples: int = 0
    train_time_s: float = 0.0
    progress: dict = field(default_factory=dict)


class StopSignal:
    """Remembers the first SIGTERM / SIGINT; the loop saves and exits at the next optimizer step."""

    def __init__(self):
        self.signum: Optional[int] = None
        self._previous: dict = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        """Put back the handlers that were there before `install` (matters when fit() runs in-process)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            log.warning("received %s: saving last.pt at the end of this step, then stopping",
                        signal.Signals(signum).name)


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(saved: dict, current: dict) -> list[str]:
    a, b = flatten(saved), flatten(current)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if k not in RESUME_FREE_KEYS and a.get(k) != b.get(k)]


def eval_preprocessing(cfg: Config) -> dict:
    d = cfg.data
    return {"img_size": d.img_size, "resize": eval_transform(cfg).resize_to, "crop_pct": d.crop_pct,
            "mean": list(d.mean), "std": list(d.std), "interpolation": d.interpolation}


def resolve_resume_path(resume: str, run_dir: Path) -> Optional[dict]:
    """Load the checkpoint to resume from; `auto` falls back to last.prev.pt and to a fresh start."""
    if resume != "auto":
        try:
            return load_checkpoint(resume)
        except CheckpointError as err:
            raise ConfigError(f"--resume {resume}: {err}") from err
    candidates = [run_dir / "last.pt", run_dir / "last.prev.pt"]
    if not any(p.exists() for p in candidates):
        log.info("--resume auto: no last.pt in %s, starting a new run", run_dir)
        return None
    for path in candidates:
        if not path.exists():
            continue
        try:
            ckpt = load_checkpoint(path)
            log.info("--resume auto: resuming from %s", path)
            return ckpt
        except CheckpointError as err:
            log.warning("--resume auto: %s; trying the previous state", err)
    raise ConfigError(f"--resume auto: no loadable checkpoint in {run_dir} (last.pt and last.prev.pt are damaged)")


class Trainer:
    def __init__(self, cfg: Config, resume: Optional[str] = None, finetune: Optional[str] = None):
        self.cfg = cfg
        self.resume = resume
        self.finetune = finetune
        self.stop_signal = StopSignal()

    # ------------------------------------------------------------ set-up

    def setup(self) -> None:
        cfg = self.cfg
        check_data_root(cfg)
        check_model_name(cfg.model.name)
        self.device = select_device(cfg.train.device, int(os.environ.get("LOCAL_RANK", "0")))
        self.amp_dtype = resolve_amp(cfg.train.amp, self.device)
        dist_utils.check_sync_bn(cfg.model.sync_bn, self.device.type, dist_utils.env_world_size())
        self.dist = dist_utils.init_distributed(self.device.type)
        self.run_dir = Path(cfg.output.dir)
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        dist_utils.barrier()
        setup_logging(self.run_dir, self.dist.is_main)
        resume_ckpt = resolve_resume_path(self.resume, self.run_dir) if self.resume else None
        finetune_ckpt = None
        if self.finetune:
            try:
                finetune_ckpt = load_checkpoint(self.finetune)
            except CheckpointError as err:
                raise ConfigError(f"--finetune {self.finetune}: {err}") from err

        torch.manual_seed(cfg.train.seed)
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True
        # The built-in data set is written once: by rank 0 first, then by the first process of each other
        # node, which finds it complete on a shared file system or writes its own copy on a local one.
        if self.dist.is_main:
            prepare_root(cfg)
        dist_utils.barrier()
        if self.dist.enabled and self.dist.local_rank == 0 and not self.dist.is_main:
            prepare_root(cfg)
        dist_utils.barrier()

        batch_size = cfg.train.batch_size
        saved_cfg = (resume_ckpt or {}).get("config")
        saved_train = saved_cfg.get("train") if isinstance(saved_cfg, dict) else None
        if batch_size == "auto" and isinstance(saved_train, dict) and isinstance(saved_train.get("batch_size"), int):
            # A resumed run keeps the batch the finder chose the first time: a new search could pick
            # another one, which would change the math.
            batch_size, cfg.train.accum_steps = saved_train["batch_size"], saved_train["accum_steps"]
            cfg.train.batch_size = batch_size
            log.info("train.batch_size=auto: resuming with the batch chosen before, %d x accum %d", batch_size,
                     cfg.train.accum_steps)
        if batch_size == "auto":
            from engine.batch_finder import resolve_auto_batch

            batch_size, cfg.train.accum_steps = resolve_auto_batch(cfg, self.device, self.amp_dtype, self.run_dir,
                                                                   self.dist)
            cfg.train.batch_size = batch_size
        self.batch_size = batch_size
        pin = pin_memory_for(cfg.data.pin_memory, self.device)
        self.data: TrainData = build_train_data(cfg, batch_size, self.dist.rank, self.dist.world_size, pin)
        self.classes = self.data.classes

        self.state = TrainState()
        if resume_ckpt is not None:
            self._check_resume_compatible(resume_ckpt)

        model = create_model(cfg.model.name, len(self.classes), cfg.model.drop_rate, cfg.model.drop_path_rate,
                             cfg.model.norm, cfg.model.group_norm_groups)
        if cfg.model.weights and resume_ckpt is None:
            load_local_weights(model, cfg.model.weights)
        if finetune_ckpt is not None:
            loaded, skipped = load_matching_weights(model, finetune_ckpt.get("model", {}))
            log.info("--finetune: %d tensors loaded from %s; not loaded: %s", len(loaded), self.finetune,
                     ", ".join(skipped) or "none")
        if cfg.model.sync_bn and self.dist.enabled:
            model, converted = dist_utils.convert_sync_bn(model)
            log.info("model.sync_bn: %d BatchNorm layers converted to SyncBatchNorm", converted)
        elif cfg.model.sync_bn:
            log.info("model.sync_bn has no effect in a single process (ordinary BatchNorm)")
        memory_format = torch.channels_last if cfg.train.channels_last else torch.contiguous_format
        model = model.to(self.device, memory_format=memory_format)
        self.model = model  # the bare model: trained and saved in last.pt
        self.ema = create_ema(model, cfg.model.ema_decay) if cfg.model.ema_decay is not None else None
        self.eval_model = self.ema.module if self.ema is not None else model  # validated, saved in best.pt

        self.batches_per_epoch = self.data.sampler.num_batches()
        if cfg.data.limit_train_batches:
            self.batches_per_epoch = min(self.batches_per_epoch, cfg.data.limit_train_batches)
        self.effective = effective_batch(batch_size, cfg.train.accum_steps, self.dist.world_size)
        self.peak_lr = scaled_lr(cfg.optim.lr, self.effective, cfg.optim.base_batch_size, cfg.optim.lr_scaling)
        if cfg.schedule.min_lr > self.peak_lr:
            raise ConfigError(f"'schedule.min_lr' = {cfg.schedule.min_lr} is above the peak LR {self.peak_lr:.6g} "
                              f"(optim.lr {cfg.optim.lr} with {cfg.optim.lr_scaling} scaling to effective batch "
                              f"{self.effective}); lower schedule.min_lr")
        self.steps_per_epoch = steps_per_epoch(self.batches_per_epoch, cfg.train.accum_steps)
        self.total_steps = self.steps_per_epoch * cfg.train.epochs
        self.warmup = min(warmup_steps(cfg.schedule.warmup_epochs, self.steps_per_epoch), self.total_steps)

        self.optimizer = build_optimizer(model, cfg.optim, self.peak_lr)
        self.scheduler = build_scheduler(self.optimizer, self.warmup, self.total_steps,
                                         cfg.schedule.warmup_start_factor, cfg.schedule.min_lr / self.peak_lr)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp_dtype == torch.float16)

        train_model = model
        if self.dist.enabled:
            ids = [self.device.index] if self.device.type == "cuda" else None
            train_model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        if cfg.train.compile:
            train_model = torch.compile(train_model, dynamic=False)
        self.train_model = train_model

        if resume_ckpt is not None:
            self._restore(resume_ckpt)
        self.ctx = StepContext(
            model=train_model, criterion=torch.nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing),
            optimizer=self.optimizer, scheduler=self.scheduler, scaler=self.scaler, device=self.device,
            amp_dtype=self.amp_dtype, mean=cfg.data.mean, std=cfg.data.std, channels_last=cfg.train.channels_last,
            accum_steps=cfg.train.accum_steps, clip_grad_norm=cfg.train.clip_grad_norm, nonfinite=cfg.train.nonfinite,
            max_nonfinite_in_row=cfg.train.max_nonfinite_in_row, distributed=self.dist.enabled, ema=self.ema)
        self.runlog = RunLog(self.run_dir, self.dist.is_main, cfg.output.tensorboard)
        if self.dist.is_main:
            (self.run_dir / "config.yaml").write_text(dump_yaml(cfg))
            if resume_ckpt is not None:
                self.runlog.drop_epochs_from(self.state.epoch + 1)
            else:
                earlier = self.run_dir / "last.pt"
                if earlier.exists():
                    log.warning("%s holds last.pt of an earlier run; this new run replaces it (to continue that "
                                "run instead, stop now and pass --resume auto)", self.run_dir)
                self.runlog.drop_epochs_from(1)  # metrics.csv describes this run only
        self._log_startup()

    def _log_startup(self) -> None:
        cfg = self.cfg
        amp = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.amp_dtype]
        log.info("data: %d training images, %d validation images, %d classes (%s)", len(self.data.train_index),
                 len(self.data.val_index), len(self.classes), ", ".join(self.classes[:10]) +
                 (", ..." if len(self.classes) > 10 else ""))
        log.info("model %s on %s, precision %s, channels_last %s, %d process(es)", cfg.model.name, self.device, amp,
                 cfg.train.channels_last, self.dist.world_size)
        log.info("effective batch %d (batch %d x accum %d x %d process(es)) | steps/epoch %d | total steps %d | "
                 "warmup steps %d | peak lr %.6g (%s scaling of %.6g at batch %d)", self.effective, self.batch_size,
                 cfg.train.accum_steps, self.dist.world_size, self.steps_per_epoch, self.total_steps, self.warmup,
                 self.peak_lr, cfg.optim.lr_scaling, cfg.optim.lr, cfg.optim.base_batch_size)

    def _check_resume_compatible(self, ckpt: dict) -> None:
        saved = ckpt.get("config")
        if not isinstance(saved, dict) or "optimizer" not in ckpt:
            raise ConfigError("--resume: this checkpoint holds no training state (is it a best.pt? use last.pt, "
                              "or --finetune to start a new schedule from its weights)")
        diffs = config_differences(saved, self.cfg.to_dict())
        if ckpt.get("classes") != self.classes:
            diffs.append(f"classes: {ckpt.get('classes')} -> {self.classes}")
        if ckpt.get("world_size", 1) != self.dist.world_size:
            diffs.append(f"world size: {ckpt.get('world_size', 1)} -> {self.dist.world_size}")
        if diffs:
            raise ConfigError("--resume: the run would not continue the same training; these differ from the "
                              "checkpoint:\n  " + "\n  ".join(diffs) +
                              "\n(keep them, or pass --finetune CKPT to start a new schedule from its weights)")

    def _restore(self, ckpt: dict) -> None:
        self.model.load_state_dict(ckpt["model"])
        if self.ema is not None:
            self.ema.module.load_state_dict(ckpt["model_ema"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.scaler.load_state_dict(ckpt["scaler"])
        self.state = TrainState(**ckpt["train_state"])
        set_rng_state(ckpt["rng"])
        log.info("resumed at epoch %d, batch %d, optimizer step %d", self.state.epoch + 1,
                 self.state.batch_in_epoch, self.state.step)

    # ------------------------------------------------------------ checkpoints

    def _checkpoint(self, with_training_state: bool, metrics: Optional[dict] = None) -> dict:
        """best.pt (`with_training_state` False) holds the evaluated weights (the EMA when on) under `model`;
        last.pt holds the trained weights under `model` and, with EMA, the average under `model_ema`."""
        ckpt = {
            "format_version": 1,
            "model": bare_state_dict(self.model if with_training_state else self.eval_model),
            "classes": list(self.classes),
            "config": self.cfg.to_dict(),
            "preprocessing": eval_preprocessing(self.cfg),
            "epoch": self.state.epoch,
            "step": self.state.step,
            "metrics": dict(metrics or {}),
        }
        if with_training_state:
            ckpt.update({
                "batch_in_epoch": self.state.batch_in_epoch,
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(),
                "rng": rng_state(),
                "train_state": dataclasses.asdict(self.state),
                "world_size": self.dist.world_size,
            })
            if self.ema is not None:
                # A bare state_dict, like `model`, so timm's load_checkpoint(use_ema=True) also reads it.
                ckpt["model_ema"] = bare_state_dict(self.ema.module)
        return ckpt

    def _sync_buffers(self) -> None:
        """Under DDP every rank takes rank 0's BN statistics (called on all ranks at the same point)."""
        if self.dist.enabled and not self.cfg.model.sync_bn:
            dist_utils.broadcast_buffers(self.model)
            if self.ema is not None:
                dist_utils.broadcast_buffers(self.ema.module)

    def save_last(self) -> None:
        # All ranks come here together (epoch ends, and steps the ranks agreed on): afterwards every rank
        # holds the BN statistics that rank 0 saves, as a resumed run will.
        self._sync_buffers()
        self._refuse_nonfinite("last.pt")  # every rank holds the same state here, so all agree
        if self.dist.is_main:
            save_atomic(self._checkpoint(True), self.run_dir / "last.pt", keep_previous=True)

    def save_best(self, metrics: dict) -> None:
        self._refuse_nonfinite("best.pt")
        if self.dist.is_main:
            save_atomic(self._checkpoint(False, metrics), self.run_dir / "best.pt")

    def _refuse_nonfinite(self, name: str) -> None:
        if not self._weights_finite():
            raise NonFiniteError(f"the weights became non-finite by optimizer step {self.state.step}; {name} was not "
                                 f"written and keeps the last good state (lower optim.lr or set train.clip_grad_norm)")

    def _weights_finite(self) -> bool:
        """Parameters and floating buffers (BatchNorm statistics) all finite; one host sync."""
        tensors = [t for t in (*self.model.parameters(), *self.model.buffers()) if t.is_floating_point()]
        return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all()) if tensors else True

    # ------------------------------------------------------------ the run

    def fit(self) -> int:
        cfg = self.cfg
        self.stop_signal.install()
        try:
            return self._fit()
        except StopRequested:
            signum = self.stop_signal.signum or signal.SIGTERM
            log.warning("stopped by %s; last.pt holds epoch %d batch %d (step %d); continue with --resume %s",
                        signal.Signals(signum).name, self.state.epoch + 1, self.state.batch_in_epoch,
                        self.state.step, self.run_dir / "last.pt")
            self.write_summary()
            return EXIT_SIGNAL.get(signum, 143)
        except (BadDataError, ImageDecodeError, NonFiniteError) as err:
            # Too many unreadable files, or non-finite numbers: one clear message (listing the files), exit 1.
            log.error("%s", err)
            self.write_summary()
            return 1
        finally:
            self.stop_signal.restore()
            self.runlog.close()

    def _stop_requested(self, step: int) -> bool:
        flag = self.stop_signal.signum is not None
        if self.dist.enabled:
            # All ranks must agree on the step they stop at; asking every 10 steps bounds the host syncs.
            if step % 10 != 0:
                return False
            return dist_utils.any_rank(flag, self.device)
        return flag

    def _fit(self) -> int:
        cfg = self.cfg
        every = cfg.checkpoint.every_steps
        hooks = StepHooks(
            checkpoint_due=lambda step: every > 0 and step % every == 0,
            stop_requested=self._stop_requested,
            save=self._save_mid_epoch,
            log_step=self._log_step,
        )
        for epoch in range(self.state.epoch, cfg.train.epochs):
            start_batch = self.state.batch_in_epoch
            progress = EpochProgress(**self.state.progress) if start_batch else EpochProgress()
            if isinstance(progress.bad_indices, list):
                progress.bad_indices = set(progress.bad_indices)
            resumed_samples, resumed_wait = progress.samples, progress.data_time
            self.data.sampler.set_epoch(epoch, start_batch)
            t0 = time.perf_counter()
            bar = self._progress_bar(epoch, start_batch)
            try:
                train_one_epoch(self.ctx, self.data.train_loader, self.batches_per_epoch, start_batch, progress,
                                self.state, hooks, cfg.output.log_interval, bar)
            finally:
                if bar is not None:
                    bar.close()
            epoch_time = time.perf_counter() - t0
            self.state.train_time_s += epoch_time
            self.state.train_samples += progress.samples - resumed_samples
            self._record_bad_files(progress)
            self.state.skipped_steps += progress.skipped_steps

            metrics = self.validate()
            self.state.epoch = epoch + 1
            self.state.batch_in_epoch = 0
            self.state.progress = {}
            # the whole job's rate, over the samples this process ran since it (re)started the epoch
            samples_per_s = (progress.samples - resumed_samples) * self.dist.world_size / max(epoch_time, 1e-9)
            self._epoch_wait = (progress.data_time - resumed_wait) / max(epoch_time, 1e-9)
            self._end_epoch(epoch, metrics, progress, samples_per_s, epoch_time)
            if dist_utils.any_rank(self.stop_signal.signum is not None, self.device):
                raise StopRequested()
            if self.state.stopped_early:
                break
        self.write_summary()
        dist_utils.barrier()
        return 0

    def _save_mid_epoch(self, progress: EpochProgress) -> None:
        # Every rank is here at the same step: the unreadable files of all ranks go into the state that rank 0
        # saves, and a split with too many of them stops the run now rather than at the epoch end.
        self._record_bad_files(progress)
        self.state.batch_in_epoch = progress.batches_done
        snapshot = dataclasses.asdict(progress)
        snapshot["bad_indices"] = sorted(progress.bad_indices)
        self.state.progress = snapshot
        self.save_last()

    def _record_bad_files(self, progress: EpochProgress) -> None:
        bad = dist_utils.union_of_lists(sorted(progress.bad_indices))
        paths = [self.data.train_index.paths[i] for i in bad]
        new = [p for p in paths if p not in self.state.skipped_files]
        for p in new:
            log.warning("unreadable training file skipped (replaced by another image of its class): %s", p)
        self.state.skipped_files.extend(new)
        self._check_bad_fraction(self.state.skipped_files, len(self.data.train_index), "training")

    def _check_bad_fraction(self, files: list, total: int, split: str) -> None:
        limit = self.cfg.data.max_bad_fraction
        if total and len(files) / total > limit:
            listing = "\n  ".join(files[:20]) + ("\n  ..." if len(files) > 20 else "")
            raise BadDataError(f"{len(files)} of {total} {split} files could not be read, more than "
                               f"data.max_bad_fraction={limit}:\n  {listing}")

    def validate(self) -> dict:
        self._sync_buffers()
        # data.limit_val_batches is applied by the loader's sampler (the first limit x batch samples of the
        # split, sharded across ranks), so the samples counted do not depend on the world size.
        sums, bad = evaluate(self.eval_model, self.data.val_loader, self.device, len(self.classes), self.cfg.data.mean,
                             self.cfg.data.std, self.cfg.train.channels_last, self.amp_dtype)
        sums.all_reduce()
        bad = dist_utils.union_of_lists(bad)
        metrics = sums.compute()
        bad_paths = [self.data.val_index.paths[i] for i in bad]
        if bad_paths:
            log.warning("%d validation file(s) could not be read and were left out: %s", len(bad_paths),
                        ", ".join(bad_paths[:10]))
            self._check_bad_fraction(bad_paths, len(self.data.val_index), "validation")
        metrics["skipped_files"] = len(bad_paths)
        self._val_skipped_files = bad_paths
        return metrics

    def _end_epoch(self, epoch: int, metrics: dict, progress: EpochProgress, samples_per_s: float,
                   epoch_time: float) -> None:
        cfg = self.cfg
        es = cfg.early_stop
        value = metrics[es.metric]
        improved = is_improvement(value, self.state.best_value, es.metric, es.min_delta)
        if improved:
            self.state.best_value = value
            self.state.best_epoch = epoch + 1
            self.state.best_metrics = {k: metrics[k] for k in ("top1", "top5", "loss", "mean_class_acc", "num_samples")}
            self.state.bad_epochs = 0
            self.save_best(metrics)
        else:
            self.state.bad_epochs += 1
            if es.patience is not None and self.state.bad_epochs >= es.patience:
                self.state.stopped_early = True

        train_loss = progress.loss_sum / max(progress.samples, 1)
        lr = self.optimizer.param_groups[0]["lr"]
        log.info("epoch %d/%d  train loss %.4f  val top1 %.2f  top5 %.2f  loss %.4f  mean class acc %.2f  "
                 "(%d samples)  %.0f img/s  %s", epoch + 1, cfg.train.epochs, train_loss, metrics["top1"],
                 metrics["top5"], metrics["loss"], metrics["mean_class_acc"], metrics["num_samples"], samples_per_s,
                 "best" if improved else f"no improvement for {self.state.bad_epochs} epoch(s)")
        if self.state.stopped_early:
            log.info("early stopping: %s has not improved by more than %g for %d epochs; best epoch %d",
                     es.metric, es.min_delta, es.patience, self.state.best_epoch)
        self.runlog.scalars({f"val/{k}": metrics[k] for k in ("top1", "top5", "loss", "mean_class_acc")} |
                            {"train/epoch_loss": train_loss, "train/epoch_samples_per_s": samples_per_s},
                            self.state.step)
        self.runlog.epoch_row({
            "epoch": epoch + 1, "step": self.state.step, "lr": lr, "train_loss": train_loss,
            "train_samples_per_s": samples_per_s, "data_wait_frac": self._epoch_wait, "epoch_time_s": epoch_time,
            "val_top1": metrics["top1"], "val_top5": metrics["top5"], "val_loss": metrics["loss"],
            "val_mean_class_acc": metrics["mean_class_acc"], "val_num_samples": metrics["num_samples"],
            "skipped_files": len(self.state.skipped_files)})
        self.runlog.flush()
        # After the metrics row: a crash between the two re-runs the epoch's end on resume, which first
        # drops the row (RunLog.drop_epochs_from), so metrics.csv never misses or repeats an epoch.
        self.save_last()
        self.write_summary()

    _epoch_wait: Optional[float] = None
    _val_skipped_files: list = []
    _wait_warned = False

    def _log_step(self, step: int, values: dict) -> None:
        values["train/samples_per_s"] *= self.dist.world_size  # the whole job's rate
        self.runlog.scalars(values, step)
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{values['train/loss']:.4f}", lr=f"{values['train/lr']:.3g}",
                                  img_s=f"{values['train/samples_per_s']:.0f}")
        else:
            log.info("step %d/%d  loss %.4f  lr %.4g  grad norm %s  %.0f img/s  data wait %.0f%%", step,
                     self.total_steps, values["train/loss"], values["train/lr"],
                     "-" if values["train/grad_norm"] is None else f"{values['train/grad_norm']:.3g}",
                     values["train/samples_per_s"], 100 * values["train/data_wait_frac"])
        wait = values["train/data_wait_frac"]
        if wait > 0.2 and not self._wait_warned and step > 2 * self.cfg.output.log_interval:
            self._wait_warned = True
            log.warning("the model waited for data %.0f%% of the time: the input pipeline is the bottleneck. Try "
                        "more loader workers (data.num_workers, now %d; this machine has %d cores), a deeper "
                        "prefetch (data.prefetch_factor, now %d), pinned memory on CUDA (data.pin_memory), a "
                        "smaller data.img_size, or images stored as JPEGs near the training size (decoding the "
                        "full-size file is most of the cost). `benchmark.py --mode loader` times the pipeline "
                        "alone", 100 * wait, self.cfg.data.num_workers, os.cpu_count() or 1,
                        self.cfg.data.prefetch_factor)

    _bar = None

    def _progress_bar(self, epoch: int, start_batch: int):
        mode = self.cfg.output.progress_bar
        on = mode is True or (mode == "auto" and sys.stderr.isatty())
        if not (on and self.dist.is_main):
            self._bar = None
            return None
        from tqdm import tqdm

        self._bar = tqdm(total=self.batches_per_epoch, initial=start_batch, desc=f"epoch {epoch + 1}",
                         dynamic_ncols=True, leave=False)
        return self._bar

    def write_summary(self) -> None:
        s = self.state
        self.runlog.summary({
            "best_epoch": s.best_epoch,
            "best": s.best_metrics,
            "best_metric": self.cfg.early_stop.metric,
            "epochs_completed": s.epoch,
            "steps_completed": s.step,
            "stopped_early": s.stopped_early,
            "train_samples_per_s": s.train_samples * self.dist.world_size / s.train_time_s if s.train_time_s > 0 else 0.0,
            "train_time_s": s.train_time_s,
            "skipped_files": list(s.skipped_files),
            "skipped_steps": s.skipped_steps,
            "skipped_val_files": list(self._val_skipped_files),
            "classes": list(self.classes),
            "effective_batch": self.effective,
            "peak_lr": self.peak_lr,
        })


class BadDataError(Exception):
    """Too many unreadable files in a split (exit 1)."""


def run(cfg: Config, resume: Optional[str] = None, finetune: Optional[str] = None) -> int:
    trainer = Trainer(cfg, resume, finetune)
    try:
        trainer.setup()
        return trainer.fit()
    finally:
        dist_utils.shutdown()
