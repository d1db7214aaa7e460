"""After training: the best model's outputs on the validation split (the temperature, the reject
thresholds) and on a seeded subset of the training split (the feature bank), written into best.pt as its
`calibration` record. Every rank passes over its own shard; rank 0 fits and writes.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Optional

import torch

from core.config import Config, eval_size
from core.safe_load import load_checkpoint
from data.build import build_eval_loader_for, eval_transform
from data.listing.folder import ImageIndex
from evaluation.calibration import apply_temperature, expected_calibration_error, nll
from evaluation.split_outputs import SplitOutputs, collect_outputs, gather_outputs
from evaluation.rejection import BANK_SIZE, layer_names, seeded_subset
from evaluation.trust import build_record
from rundir.atomic_files import save_atomic
from runtime import distributed as dist_utils
from runtime.device import DeviceInput
from tasks import task_of

log = logging.getLogger(__name__)


def bank_index(train_index, seed: int) -> Optional[ImageIndex]:
    """The training files whose features form the bank: a seeded subset of at most BANK_SIZE (None for
    WebDataset shards, which cannot be addressed by index; the reject option then uses the energy score)."""
    if not isinstance(train_index, ImageIndex):
        return None
    keep = seeded_subset(len(train_index), BANK_SIZE, seed)
    return dataclasses.replace(train_index, paths=[train_index.paths[i] for i in keep],
                               labels=[train_index.labels[i] for i in keep])


def best_is_calibrated(run_dir: Path) -> bool:
    """Whether the run's best.pt holds its calibration record (True when there is no best.pt to calibrate)."""
    path = run_dir / "best.pt"
    if not path.exists():
        return True
    best = load_checkpoint(path)
    return "calibration" in best or "thresholds" in best  # a multi-label model's: its tuned thresholds


def calibrate_best(cfg: Config, run_dir: Path, eval_model: torch.nn.Module, val_loader, train_index,
                   device_input: DeviceInput, dist: dist_utils.DistInfo,
                   val_outputs: Optional[SplitOutputs] = None) -> Optional[dict]:
    """Load best.pt's weights into `eval_model` (training is over), gather its outputs, and on rank 0 add
    the `calibration` record to best.pt. Call on every rank. Returns the record (rank 0) or None.
    `val_outputs`: this rank's outputs of best.pt's model on `val_loader`, kept from the validation pass that
    saved it (training_run.kept_outputs); the validation split is then not passed over again (when every rank
    has them)."""
    best_path = run_dir / "best.pt"
    task = task_of(cfg)
    if not task.supports("calibration"):
        log.info("calibration: %s", task.unsupported["calibration"])
        return None
    dist_utils.barrier()
    if not best_path.exists():
        log.info("calibration: no best.pt (no validation ran); nothing to calibrate")
        return None
    best = load_checkpoint(best_path)
    eval_model.load_state_dict(best["model"])
    if dist_utils.any_rank(val_outputs is None, device_input.device):
        # as the validation pass ran (its memory layout): the same numbers as the outputs it would have kept
        val_outputs = collect_outputs(eval_model, val_loader, device_input, with_features=True, with_layers=True)
    else:
        log.info("calibration: on the validation outputs kept from the pass that chose best.pt (no second pass)")
    val = gather_outputs(val_outputs)
    # The bank's pass as infer.py's and serve.py's: channels_last whatever the training's layout (training
    # is over). resnet10t at 32 px on the CPU: 1.32x the images per second of NCHW, the calibration 0.4 s less.
    eval_model.to(memory_format=torch.channels_last)
    device_input = dataclasses.replace(device_input, channels_last=True)
    bank = None
    subset = bank_index(train_index, cfg.train.seed)
    if subset is not None and val.features is not None:
        d = cfg.data
        loader = build_eval_loader_for(subset, eval_transform(d), eval_size(d), cfg.train.batch_size, d.num_workers,
                                       False, dist.rank, dist.world_size)
        bank = gather_outputs(collect_outputs(eval_model, loader, device_input, with_features=True, with_layers=True))
    record = None
    if dist.is_main and len(val):
        record = build_record(val, bank, cfg.calibration.temperature, cfg.calibration.coverage, cfg.train.seed,
                              layer_names=layer_names(eval_model))
        best["calibration"] = record
        save_atomic(best, best_path)
        log_record(record, val)
    dist_utils.barrier()
    return record


def log_record(record: dict, val: SplitOutputs) -> None:
    t = record["temperature"]
    before = expected_calibration_error(apply_temperature(val.logits, None), val.labels)
    after = expected_calibration_error(apply_temperature(val.logits, t), val.labels)
    log.info("calibration on %d validation images: temperature %s (NLL %.4f -> %.4f, ECE %.2f%% -> %.2f%%); "
             "reject option: %s score, threshold %.4g keeps %.0f%% of them; written to best.pt",
             len(val), "none" if t is None else f"{t:.4f}", nll(val.logits, val.labels),
             nll(val.logits, val.labels, t or 1.0), before, after, record["method"],
             record["thresholds"][record["method"]], 100 * record["coverage"])
    for note in record.get("temperature_notes", []):
        log.warning("calibration: %s", note)
