"""The validation outputs the fits after training need (every sample's logits, penultimate features and the
stages' pooled statistics), recorded during the last validation passes and kept from the pass that made best.pt:
the temperature and the reject fit then take them instead of passing over the validation split again.

Kept in memory only, per rank (calibrate_best gathers them as it gathers its own pass): a resumed run whose
best epoch came before the stop has none, nor has a run whose best epoch came before the recorded
validations, and a split too large for KEEP_BYTES records none; the calibration then passes over the split
as before.

After training: the best model's outputs on the validation split (the temperature, the reject thresholds
and fit), topped up for the reject fit with a seeded subset of the training split when the split holds fewer
than MIN_VALIDATION_FIT images, written into best.pt as its `calibration` record.
Every rank passes over its own shard; rank 0 fits and writes."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Callable, Optional

import torch

import imgcls.compute.distributed as dist_utils
from imgcls.compute.device import DeviceInput
from imgcls.config import Config
from imgcls.core.errors import CheckpointError, ConfigError
from imgcls.core.safe_load import load_checkpoint
from imgcls.data.build import build_eval_loader_for, eval_transform
from imgcls.data.listing import ImageIndex
from imgcls.data.settings import eval_size
from imgcls.evaluation.calibration import apply_temperature, expected_calibration_error, nll
from imgcls.evaluation.rejection import (BANK_SIZE, OutputRecorder, SplitOutputs, collect_outputs, gather_outputs,
                                         layer_names, probe_rejector, seeded_subset, weak_note)
from imgcls.evaluation.trust import CROSS_FIT_FOLDS, MIN_VALIDATION_FIT, build_record, top_up_count, usable_rejector
from imgcls.tasks import task_of
from imgcls.training.checkpoints import save_atomic

# Recording costs 4-9% of a validation pass's model time (resnet18 / resnet10t, 32-128 px, one CPU thread:
# docs/performance.md) and saves one pass: only the last RECORDED_VALIDATIONS scheduled validations record,
# where a scheduled run's best epoch mostly is; a best epoch before them is passed over again.
RECORDED_VALIDATIONS = 5


# What one rank keeps at most (the kept pass's outputs and the one being recorded, each): resnet18's 512
# features, five stages of at most 256 statistics and the logits are ~8 KB a sample, so ~30000 samples.
KEEP_BYTES = 256 * 2**20


class BoundedRecorder(OutputRecorder):
    """An OutputRecorder that drops everything (and records no more) once its outputs pass `limit` bytes."""

    def __init__(self, model: torch.nn.Module, layers: list[str], limit: int):
        super().__init__(model, with_features=True, layers=layers)
        self.limit, self.bytes, self.overflowed = limit, 0, False

    def __call__(self, logits, targets, valid, indices) -> None:
        if self.overflowed:
            return
        super().__call__(logits, targets, valid, indices)
        part = self.parts[-1]
        tensors = [part.logits, part.labels, part.indices, part.features, *(part.layers or [])]
        self.bytes += sum(t.numel() * t.element_size() for t in tensors if t is not None)
        if self.bytes > self.limit:
            self.overflowed, self.parts = True, []
            self.close()


class KeptOutputs:
    """`recording(model, on_outputs)` around a validation pass; `keep(epoch)` when that pass made best.pt;
    `outputs()` the kept pass's outputs (this rank's), or None."""

    def __init__(self, enabled: bool, limit: int = KEEP_BYTES):
        self.enabled, self.limit = enabled, limit
        self.recorder: Optional[BoundedRecorder] = None
        self.last: Optional[SplitOutputs] = None   # the last finished pass's
        self.kept: Optional[SplitOutputs] = None
        self.kept_epoch: Optional[int] = None

    def start(self, model: torch.nn.Module, on_outputs: Optional[Callable],
              validations_left: int = 1) -> Optional[Callable]:
        """Begin recording a pass of `model` (when it is one of the last RECORDED_VALIDATIONS: `validations_left`
        counts it and the run's later ones); returns the `on_outputs` to give `evaluate` (the objective's too).
        Call `finish()` after the pass, also when it failed."""
        self.last = None
        if not self.enabled or validations_left > RECORDED_VALIDATIONS:
            return on_outputs
        self.recorder = BoundedRecorder(model, layer_names(model), self.limit)
        if on_outputs is None:
            return self.recorder
        recorder = self.recorder

        def both(*args) -> None:
            on_outputs(*args)
            recorder(*args)
        return both

    def finish(self, completed: bool) -> None:
        recorder, self.recorder = self.recorder, None
        if recorder is None:
            return
        recorder.close()
        self.last = recorder.outputs() if completed and not recorder.overflowed else None

    def keep(self, epoch: int) -> None:
        """The last pass made best.pt (None kept when it recorded nothing: a later fit must pass again)."""
        self.kept, self.kept_epoch, self.last = self.last, epoch, None

    def outputs(self) -> Optional[SplitOutputs]:
        return self.kept

log = logging.getLogger(__name__)


def bank_index(train_index, seed: int, size: int = BANK_SIZE) -> Optional[ImageIndex]:
    """The training files whose outputs top up the reject fit: a seeded subset of at most `size` (None for
    WebDataset shards, which cannot be addressed by index; a validation split under MIN_VALIDATION_FIT then
    rejects by the energy score)."""
    if not isinstance(train_index, ImageIndex):
        return None
    keep = seeded_subset(len(train_index), size, seed)
    return dataclasses.replace(train_index, paths=[train_index.paths[i] for i in keep],
                               labels=[train_index.labels[i] for i in keep])


def top_up_workers(images: int, batch: int, configured: int) -> int:
    """Loader workers for the top-up pass: none for a pass of at most TOP_UP_IN_PROCESS_BATCHES batches, whose
    images decode in less time than forking workers takes (32 photos at 128 px: ~0.05 s; the workers' start
    ~0.6 s of the photos recipe's tail)."""
    return configured if images > TOP_UP_IN_PROCESS_BATCHES * batch else 0


TOP_UP_IN_PROCESS_BATCHES = 2


def best_is_calibrated(run_dir: Path, dist: Optional[dist_utils.DistInfo] = None) -> bool:
    """Whether the run's best.pt holds its calibration record (True when there is no best.pt to calibrate).
    With `dist`: rank 0's answer on every rank (another node may not see rank 0's files yet)."""
    if dist is not None:
        return dist_utils.run_on_main(dist.is_main, lambda: best_is_calibrated(run_dir), share_result=True)
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
    saved it (training.calibrate); the validation split is then not passed over again (when every rank
    has them)."""
    best_path = run_dir / "best.pt"
    task = task_of(cfg)
    if not task.supports("calibration"):
        log.info("calibration: %s", task.unsupported["calibration"])
        return None
    # rank 0 decides and shares its weights: a rank on another node may not see best.pt (its own working
    # directory, an NFS lookup cache), and ranks that disagree would wait for each other in different collectives
    if not dist_utils.run_on_main(dist.is_main, best_path.exists, share_result=True):
        log.info("calibration: no best.pt (no validation ran); nothing to calibrate")
        return None
    best = dist_utils.run_on_main(dist.is_main, lambda: load_checkpoint(best_path),
                                  shared=(ConfigError, CheckpointError))
    if dist.is_main:
        eval_model.load_state_dict(best["model"])
    dist_utils.broadcast_state(eval_model)
    if dist_utils.any_rank(val_outputs is None, device_input.device):
        # as the validation pass ran (its memory layout): the same numbers as the outputs it would have kept
        val_outputs = collect_outputs(eval_model, val_loader, device_input, with_features=True, with_layers=True)
    else:
        log.info("calibration: on the validation outputs kept from the pass that chose best.pt (no second pass)")
    val = gather_outputs(val_outputs)
    need = top_up_count(len(val)) if val.features is not None else 0
    subset = bank_index(train_index, cfg.train.seed, need) if need else None
    top_up = None
    if val.features is not None and not need:
        log.info("calibration: reject fit on the %d validation outputs (>= %d: no pass over the training split; "
                 "thresholds on %d-fold cross-fitted scores)", len(val), MIN_VALIDATION_FIT, CROSS_FIT_FOLDS)
    elif subset is not None:
        log.info("calibration: %d validation images (< %d): the reject fit adds %d training images' outputs (a pass "
                 "over those only; thresholds on %d-fold cross-fitted validation scores)", len(val),
                 MIN_VALIDATION_FIT, len(subset), CROSS_FIT_FOLDS)
        # The pass as infer.py's and serve.py's: channels_last whatever the training's layout (training is
        # over). resnet10t at 32 px on the CPU: 1.32x the images per second of NCHW.
        eval_model.to(memory_format=torch.channels_last)
        device_input = dataclasses.replace(device_input, channels_last=True)
        d = cfg.data
        loader = build_eval_loader_for(subset, eval_transform(d), eval_size(d), cfg.train.batch_size,
                                       top_up_workers(len(subset), cfg.train.batch_size * dist.world_size,
                                                      d.num_workers), False, dist.rank, dist.world_size)
        top_up = gather_outputs(collect_outputs(eval_model, loader, device_input, with_features=True,
                                                with_layers=True))
    record = None
    if dist.is_main and len(val):
        record = build_record(val, None, cfg.calibration.temperature, cfg.calibration.coverage, cfg.train.seed,
                              layer_names=layer_names(eval_model), top_up=top_up)
        probe_record(record, eval_model, device_input, eval_size(cfg.data), cfg.train.seed)
        best["calibration"] = record
        save_atomic(best, best_path)
        log_record(record, val)
    dist_utils.barrier()
    return record


def input_channels(model: torch.nn.Module) -> int:
    """The channels the model's first convolution takes (3 for a model without one)."""
    first = next((m for m in model.modules() if isinstance(m, torch.nn.Conv2d)), None)
    return first.in_channels if first is not None else 3


def probe_record(record: dict, model: torch.nn.Module, device_input: DeviceInput, size: int, seed: int) -> None:
    """Add to `record` how much of each generated far-off kind its reject option rejects (`reject_probe`,
    kind -> percent) and, when that is weak, `reject_notes` (evaluation.rejection). The thresholds and
    fits are not touched: a separate pass fits the same ones."""
    rejector = usable_rejector(record, have_features=record.get("feature_bank") is not None,
                               have_layers=bool(record.get("layer_names")))
    record["reject_probe"] = probe_rejector(model, device_input, rejector, size, input_channels(model), seed)
    note = weak_note(record["reject_probe"], rejector.method)
    record["reject_notes"] = [note] if note else []


def log_record(record: dict, val: SplitOutputs) -> None:
    t = record["temperature"]
    before = expected_calibration_error(apply_temperature(val.logits, None), val.labels)
    after = expected_calibration_error(apply_temperature(val.logits, t), val.labels)
    log.info("calibration on %d validation images: temperature %s (NLL %.4f -> %.4f, ECE %.2f%% -> %.2f%%); "
             "reject option: %s score, threshold %.4g keeps %.0f%% of them; written to best.pt",
             len(val), "none" if t is None else f"{t:.4f}", nll(val.logits, val.labels),
             nll(val.logits, val.labels, t or 1.0), before, after, record["method"],
             record["thresholds"][record["method"]], 100 * record["coverage"])
    if record.get("temperature_decision") and record["temperature_decision"] not in record.get("temperature_notes", []):
        log.info("calibration: temperature %s", record["temperature_decision"])
    for note in record.get("temperature_notes", []):
        log.warning("calibration: %s", note)
    if record.get("reject_probe"):
        log.info("reject option on generated far-off images: %s rejected",
                 ", ".join(f"{kind} {rate:.0f}%" for kind, rate in record["reject_probe"].items()))
    for note in record.get("reject_notes", []):
        log.warning("reject option: %s", note)
