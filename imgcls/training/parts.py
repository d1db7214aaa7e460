"""Pieces of a training run's set-up that need no Trainer state: the built-in data written once per node,
the model with its starting weights, its training wrappers, and the files a run directory starts with.
`training.trainer.Trainer` calls them in its set-up phases.

A training run's parts, built once: `build_run` returns a frozen `Run` whose every part is finished (runtime,
run directory, data, models, objective, optimisation, checkpointing, logging and tracking); nothing waits
for a later phase and the caller's config is never changed (the run trains with a resolved copy: the
batch size `train.batch_size: auto` found, the pretrained model's preprocessing where none was set).

Each part that holds a resource is handed to `closing` as it is made, so a set-up that fails half-way
releases what it took (loader workers, the run directory's lock, the tracking run)."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

import imgcls.compute.distributed as dist_utils
from imgcls.compute.device import (DeviceInput, Runtime, memory_format, pin_memory_for, say_pending_warnings,
                                   start_runtime)
from imgcls.compute.distributed import StopSignal, launch_info
from imgcls.config import Config, dump_yaml
from imgcls.core.errors import ConfigError
from imgcls.data.build import RunData, build_run_data, prepare_root, resolve_class_weights, resolve_normalisation
from imgcls.data.listing import data_fingerprint, write_split_lists
from imgcls.data.loaders import shutdown_workers
from imgcls.data.settings import check_data_root, check_outside_data
from imgcls.incremental.extension import Extension, initialise, prepare_extension, scan_extended
from imgcls.model_files.checkpoint_files import recorded_threads
from imgcls.models.ema import create_ema
from imgcls.models.factory import (BackboneFreeze, build_model, check_grad_checkpointing, check_model_name,
                                   load_local_weights, load_pretrained_weights, prepare_pretrained)
from imgcls.objectives.base import Objective
from imgcls.objectives.registry import build_objective, check_objective, check_resume_objective
from imgcls.tracking.runs import RUN_ID_KEY as TRACKING_RUN_ID_KEY, TrainingTracking, open_training_tracking
from imgcls.tracking.tracker import check_store_apart, check_tracking_client
from imgcls.training.batch_finder import resolve_batch_size
from imgcls.training.checkpoints import Checkpointer, ModuleWeights, RandomState, Recorded, RunRecord
from imgcls.training.optim import check_optimizer, describe_groups
from imgcls.training.reporter import RunReporter
from imgcls.training.rundir import (RUN_ID_KEY as ELASTIC_RUN_ID_KEY, apply_finetune, check_own_checkpoint,
                                    check_resume_compatible, check_shared_checkpoint, claim_run_dir,
                                    load_finetune_source, open_run_dir, plan_resume, resolve_resume, run_inputs)
from imgcls.training.runlog import RunLog, setup_logging
from imgcls.training.schedule import RunPlan, plan_run
from imgcls.training.state import TrainState
from imgcls.training.step import TrainStep, build_train_step

log = logging.getLogger(__name__)


def prepare_data_once(cfg, dist) -> None:
    """The built-in data set is written once: by rank 0 first, then by the first process of each other node,
    which finds it complete on a shared file system or writes its own copy on a local one."""
    if dist.is_main:
        prepare_root(cfg)
    dist_utils.barrier()
    if dist.enabled and dist.local_rank == 0 and not dist.is_main:
        prepare_root(cfg)
    dist_utils.barrier()


def build_starting_model(cfg, classes: list[str], device: torch.device, dist, resuming: bool,
                         pretrained: Optional[torch.nn.Module], finetune_ckpt: Optional[dict],
                         finetune_source: Optional[str], finetune_partial: bool,
                         extension: Optional[Extension] = None, train_index=None) -> torch.nn.Module:
    """The bare model on `device` with its starting weights: `model.weights`, the pretrained source, a
    --finetune checkpoint or an extension's base (a resume restores last.pt's instead), SyncBatchNorm under DDP
    when asked."""
    model = build_model(cfg.model, len(classes), cfg.data.channels)
    if cfg.model.weights and not resuming:
        load_local_weights(model, cfg.model.weights)
    if pretrained is not None:
        load_pretrained_weights(model, pretrained, cfg.model.name, classes)
    if finetune_ckpt is not None:
        apply_finetune(model, finetune_ckpt, finetune_source, finetune_partial)
    if extension is not None and not resuming:
        initialise(model, extension, train_index, device, cfg.data.num_workers)
    if cfg.model.sync_bn and dist.enabled:
        model, converted = dist_utils.convert_sync_bn(model)
        log.info("model.sync_bn: %d BatchNorm layers converted to SyncBatchNorm", converted)
    elif cfg.model.sync_bn:
        log.info("model.sync_bn has no effect in a single process (ordinary BatchNorm)")
    return model.to(device, memory_format=memory_format(cfg.train.channels_last))


def wrap_for_training(model: torch.nn.Module, cfg, dist, device: torch.device) -> torch.nn.Module:
    """What runs forward: the model in DistributedDataParallel under torchrun, compiled with
    `train.compile`."""
    train_model = model
    if dist.enabled:
        ids = [device.index] if device.type == "cuda" else None
        # a frozen backbone gets no gradients: DDP must not wait for them
        train_model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids,
                                                                find_unused_parameters=bool(cfg.model.freeze))
    if cfg.train.compile:
        train_model = torch.compile(train_model, dynamic=False)
    return train_model


def write_run_files(run_dir: Path, cfg, data, runlog: RunLog, resumed_epoch: Optional[int]) -> None:
    """Rank 0, at the start: the resolved config, a data.val_fraction split's file lists, and metrics.csv
    without the rows a resumed run will write again (a new run starts it afresh)."""
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    if data.sources.split is not None:
        write_split_lists(run_dir, data.sources.split, data.classes, data.train_index.label_name)
    runlog.drop_epochs_from(1 if resumed_epoch is None else resumed_epoch + 1)


@dataclass(frozen=True)
class Models:
    """The bare model is trained and saved in last.pt; `eval_model` (the EMA when on) is validated and saved
    in best.pt; `train_model` runs forward (DDP- and compile-wrapped where set)."""

    model: torch.nn.Module
    eval_model: torch.nn.Module
    train_model: torch.nn.Module
    ema: Optional[torch.nn.Module]


@dataclass(frozen=True)
class Run:
    cfg: Config                 # resolved: the batch the run trains with, the pretrained preprocessing
    runtime: Runtime
    run_dir: Path
    data: RunData
    fingerprint: dict           # of the splits' files, recorded in last.pt, checked on resume
    models: Models
    objective: Objective
    plan: RunPlan
    step: TrainStep
    freeze: Optional[BackboneFreeze]  # model.freeze: the backbone, until model.unfreeze_epoch
    checkpointer: Checkpointer
    runlog: RunLog
    reporter: RunReporter
    stop: StopSignal
    state: TrainState           # restored from last.pt on --resume; changed only through its methods
    resumed: bool

    @property
    def classes(self) -> list[str]:
        return self.data.classes


@dataclass(frozen=True)
class Start:
    """Where a run starts from: the runtime, the checkpoint it resumes or fine-tunes from, pretrained weights."""

    runtime: Runtime
    resume_ckpt: Optional[dict]
    finetune_ckpt: Optional[dict]
    pretrained: Optional[torch.nn.Module]


def build_run(cfg: Config, resume: Optional[str], finetune: Optional[str], finetune_partial: bool,
              closing: contextlib.ExitStack) -> Run:
    if resume and finetune:
        raise ConfigError(f"--resume {resume} and --finetune {finetune} exclude each other: --resume continues "
                          f"a run, --finetune starts a new one from a checkpoint's weights; pass one")
    if finetune and cfg.incremental.base:
        raise ConfigError(f"--finetune {finetune} and 'incremental.base' = {cfg.incremental.base} exclude each other: "
                          f"an extension starts from its base's weights; pass one")
    cfg = copy.deepcopy(cfg)
    run_dir = Path(cfg.output.dir)
    start = start_run(cfg, run_dir, resume, finetune, closing)
    rt = start.runtime
    extension = None
    if cfg.incremental.base:  # the base's normalisation, the exemplar memory (memory.csv)
        cfg, extension = prepare_extension(cfg, run_dir, rt, start.resume_ckpt is not None)
    scan = scan_extended(extension) if extension is not None else None
    cfg = with_resolved_batch(cfg, start.resume_ckpt, rt, run_dir, scan)
    data = build_run_data(cfg, cfg.train.batch_size, rt.dist.rank, rt.dist.world_size,
                          pin_memory_for(cfg.data.pin_memory, rt.device), scan=scan)
    closing.callback(shutdown_workers, data.train_loader, data.val_loader)
    cfg = resolve_class_weights(cfg, data.train_index)
    cfg = resolve_normalisation(cfg, data.train_index, start.resume_ckpt, cfg.train.batch_size,
                                lambda fn: dist_utils.run_on_main(rt.dist.is_main, fn, share_result=True))
    # rank 0 reads the file sizes, the others take its answer (one stat per file on a shared file system)
    fingerprint = dist_utils.run_on_main(
        rt.dist.is_main, lambda: data_fingerprint(data.train_index, data.val_index), share_result=True)
    if start.resume_ckpt is not None:
        check_resume_compatible(start.resume_ckpt, cfg, data.classes, rt.dist.world_size, data.sources.identity,
                                fingerprint)
    models = build_models(cfg, data, start, finetune, finetune_partial, extension)
    objective = build_objective(cfg, data.classes, models.model, rt.device)
    if extension is not None:
        objective.use_memory(extension.summary())
    closing.callback(objective.close)
    if start.resume_ckpt is not None:
        check_resume_objective(start.resume_ckpt, objective)
    plan = plan_run(cfg, cfg.train.batch_size, data.sampler.num_batches(), rt.dist.world_size)
    step = build_step(cfg, models, objective, plan, rt, len(data.classes))
    # after the optimizer: its groups hold every parameter, frozen or not, so they resume across the unfreeze
    freeze = BackboneFreeze(models.model, cfg.model.unfreeze_epoch) if cfg.model.freeze else None
    tracking = open_training_tracking(cfg, run_dir, rt.dist.is_main, rt.dist.world_size, str(rt.device),
                                      fingerprint, start.resume_ckpt, start.finetune_ckpt, finetune)
    runlog = RunLog(run_dir, rt.dist.is_main, cfg.output.tensorboard, cfg.output.curves, listeners=(tracking,))
    closing.callback(runlog.close)
    checkpointer = build_checkpointer(cfg, run_dir, rt, data, fingerprint, models, objective, step, tracking)
    state = checkpointer.restore(start.resume_ckpt) if start.resume_ckpt is not None else TrainState()
    if rt.dist.is_main:
        write_run_files(run_dir, cfg, data, runlog, state.epoch if start.resume_ckpt is not None else None)
    if start.resume_ckpt is not None:
        runlog.checkpoint_saved()  # rows last.pt holds that the killed run may not have sent
    reporter = RunReporter(cfg, runlog, rt.dist.is_main, rt.dist.world_size, plan.total_steps,
                           plan.batches_per_epoch, objective)
    return Run(cfg, rt, run_dir, data, fingerprint, models, objective, plan, step, freeze, checkpointer, runlog,
               reporter, StopSignal(), state, start.resume_ckpt is not None)


def start_run(cfg: Config, run_dir: Path, resume: Optional[str], finetune: Optional[str],
              closing: contextlib.ExitStack) -> Start:
    """Checks that need no work, the runtime, the run directory (locked by rank 0), the checkpoint to
    resume or fine-tune from, the CPU threads, the pretrained weights and the built-in data."""
    check_data_root(cfg)
    check_outside_data(cfg, "output.dir", run_dir)
    check_tracking_client(cfg.tracking)
    check_store_apart(cfg, finetune)
    check_model_name(cfg.model.name)
    check_grad_checkpointing(cfg.model)
    check_optimizer(cfg.optim)
    check_objective(cfg)  # before the run directory and its log: an objective that cannot run leaves nothing
    runtime = start_runtime(cfg, distributed=True)
    lock = dist_utils.run_on_main(runtime.dist.is_main, lambda: open_run_dir(run_dir))
    if lock is not None:
        closing.callback(lock.release)
    dist_utils.barrier()
    setup_logging(run_dir, runtime.dist.is_main)
    launch = launch_info()
    # a torchrun restart continues from last.pt; rank 0 decides, so that every rank asks for the same files
    plan = dist_utils.run_on_main(runtime.dist.is_main, lambda: plan_resume(resume, run_dir, launch),
                                  share_result=True)
    check_shared_checkpoint(plan.resume, run_dir, runtime.dist)
    claim_run_dir(run_dir, plan.resume, cfg.output.overwrite, runtime.dist.is_main, run_inputs(cfg, finetune))
    say_pending_warnings()  # the precision's, chosen before train.log existed: into it now
    resume_ckpt = resolve_resume(plan.resume, run_dir) if plan.resume else None
    if plan.must_own:
        check_own_checkpoint(resume_ckpt, run_dir, launch)
    runtime.apply_cpu_policy(cfg.train.threads, cfg.train.reuse_host_memory, recorded_threads(resume_ckpt),
                             agree_over_ranks=True)
    finetune_ckpt = load_finetune_source(finetune) if finetune else None
    pretrained = None
    if cfg.model.pretrained:  # before the data: no weights (offline) is a usage error, exit 2
        pretrained, lines = prepare_pretrained(cfg, resume_ckpt.get("config") if resume_ckpt else None)
        for line in lines:
            log.info("%s", line)
    torch.manual_seed(cfg.train.seed)
    prepare_data_once(cfg, runtime.dist)
    return Start(runtime, resume_ckpt, finetune_ckpt, pretrained)


def with_resolved_batch(cfg: Config, resume_ckpt: Optional[dict], rt: Runtime, run_dir: Path, scan=None) -> Config:
    """`cfg` with the per-process batch and accumulation the run trains with (`train.batch_size: auto`
    resolved by the finder, or kept from the resumed run)."""
    batch, accum = resolve_batch_size(cfg, resume_ckpt, rt.device, rt.amp_dtype, run_dir, rt.dist, scan)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=batch, accum_steps=accum))


def build_models(cfg: Config, data: RunData, start: Start, finetune: Optional[str], finetune_partial: bool,
                 extension: Optional[Extension] = None) -> Models:
    rt = start.runtime
    model = build_starting_model(cfg, data.classes, rt.device, rt.dist, start.resume_ckpt is not None,
                                 start.pretrained, start.finetune_ckpt, finetune, finetune_partial, extension,
                                 data.train_index)
    m = cfg.model
    ema = create_ema(model, m.ema_decay, m.ema_every_steps, m.ema_warmup) if m.ema_decay else None
    return Models(model, ema.module if ema is not None else model,
                  wrap_for_training(model, cfg, rt.dist, rt.device), ema)


def build_step(cfg: Config, models: Models, objective: Objective, plan: RunPlan, rt: Runtime,
               num_classes: int) -> TrainStep:
    step = build_train_step(cfg, models.model, DeviceInput.from_config(cfg, rt.device, rt.amp_dtype), plan,
                            train_model=models.train_model, ema=models.ema, dist=rt.dist, num_classes=num_classes,
                            accum_steps=plan.accum_steps, objective=objective)
    if cfg.optim.layer_decay is not None or cfg.optim.head_lr_scale != 1.0:
        log.info("optim: %s (layer_decay %s, head_lr_scale %g)", describe_groups(step.optimizer),
                 cfg.optim.layer_decay, cfg.optim.head_lr_scale)
    return step


def build_checkpointer(cfg: Config, run_dir: Path, rt: Runtime, data: RunData, fingerprint: dict, models: Models,
                       objective: Objective, step: TrainStep, tracking: TrainingTracking) -> Checkpointer:
    """Every resumable part, registered once: saved into last.pt and restored from it by the same pair."""
    states = {"model": ModuleWeights(models.model),
              **({"model_ema": ModuleWeights(models.ema.module)} if models.ema is not None else {}),
              "optimizer": step.optimizer, "scheduler": step.scheduler, "scaler": step.scaler,
              "rng": RandomState(),
              **({objective.name: objective} if objective.name != "task" else {}),
              TRACKING_RUN_ID_KEY: tracking,
              ELASTIC_RUN_ID_KEY: Recorded(lambda: launch_info().run_id or None)}
    record = RunRecord(cfg, data.classes, rt.dist.world_size, data.sources.identity, fingerprint)
    return Checkpointer(run_dir, rt.dist.is_main, record, states, models.eval_model,
                        best_states=(TRACKING_RUN_ID_KEY, *([objective.name] if objective.in_best_file else [])),
                        optional=(TRACKING_RUN_ID_KEY, ELASTIC_RUN_ID_KEY), best_weights=objective.best_weights)
