"""Pieces of a training run's set-up that need no Trainer state: the built-in data written once per node,
the model with its starting weights, its training wrappers, and the files a run directory starts with.
`training_run.trainer.Trainer` calls them in its set-up phases."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch

from imgcls.core.config import dump_yaml
from imgcls.data.build import prepare_root
from imgcls.data.listing.split import write_split_lists
import imgcls.runtime.distributed as dist_utils
from imgcls.rundir.resume import apply_finetune
from imgcls.runtime.device import memory_format
from imgcls.rundir.runlog import RunLog
from imgcls.models.factory import build_model, load_local_weights, load_pretrained_weights

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
                         finetune_source: Optional[str], finetune_partial: bool) -> torch.nn.Module:
    """The bare model on `device` with its starting weights: `model.weights`, the pretrained source or a
    --finetune checkpoint (a resume restores last.pt's instead), SyncBatchNorm under DDP when asked."""
    model = build_model(cfg.model, len(classes), cfg.data.channels)
    if cfg.model.weights and not resuming:
        load_local_weights(model, cfg.model.weights)
    if pretrained is not None:
        load_pretrained_weights(model, pretrained, cfg.model.name, classes)
    if finetune_ckpt is not None:
        apply_finetune(model, finetune_ckpt, finetune_source, finetune_partial)
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
