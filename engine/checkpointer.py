"""The checkpoint format, in one place: what goes into last.pt and best.pt, restoring a run from last.pt,
`--resume auto` with its fallback, what may change on resume, and reading a checkpoint back for
eval.py / infer.py (the model, its classes, its config and its eval preprocessing).

last.pt: `model` (the trained weights, a bare state_dict), `classes`, `config`, `preprocessing`, `epoch`,
`step`, `metrics`, and the training state: `batch_in_epoch`, `optimizer`, `scheduler`, `scaler`, `rng`,
`train_state`, `world_size`, and with EMA `model_ema`. Both record `data_source` (the data format, a
`data.val_fraction` split's file lists, CSV lists' digests). best.pt: the evaluated weights (the EMA when
on) under `model`, with the same metadata and no training state.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from core.config import Config, apply_overrides, config_differences, config_from_dict, validate
from core.errors import CheckpointError, ConfigError, NonFiniteError
from data.build import eval_transform
from data.transforms import EvalTransform
from core.safe_load import load_checkpoint
from engine.checkpoint import bare_state_dict, rng_state, save_atomic, set_rng_state
from engine.device import memory_format
from engine.state import TrainState
from models.factory import build_model

log = logging.getLogger("train")

FORMAT_VERSION = 1
# keys of a checkpoint's `preprocessing` that are also `data.*` config keys
PREPROCESSING_KEYS = ("img_size", "crop_pct", "interpolation", "mean", "std")


def preprocessing_record(cfg: Config) -> dict:
    """The eval preprocessing saved beside the weights, which eval.py and infer.py apply."""
    d = cfg.data
    return {"img_size": d.img_size, "resize": eval_transform(d).resize_to, "crop_pct": d.crop_pct,
            "mean": list(d.mean), "std": list(d.std), "interpolation": d.interpolation}


# ---------------------------------------------------------------- training: save and restore


@dataclass
class TrainingParts:
    """What last.pt saves and restores besides the bookkeeping."""

    model: torch.nn.Module           # the bare trained model
    eval_model: torch.nn.Module      # what validation runs and best.pt holds (the EMA when on)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    ema: Optional[torch.nn.Module] = None


class Checkpointer:
    """Writes last.pt (with last.prev.pt) and best.pt of a run; only rank 0 writes."""

    def __init__(self, run_dir: Path, is_main: bool, cfg: Config, classes: list[str], world_size: int,
                 parts: TrainingParts, data_source: Optional[dict] = None):
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self.cfg = cfg
        self.classes = classes
        self.world_size = world_size
        self.parts = parts
        self.data_source = data_source

    def _common(self, weights: torch.nn.Module, state: TrainState, metrics: Optional[dict]) -> dict:
        return {"format_version": FORMAT_VERSION, "model": bare_state_dict(weights), "classes": list(self.classes),
                "config": self.cfg.to_dict(), "preprocessing": preprocessing_record(self.cfg),
                "epoch": state.epoch, "step": state.step, "metrics": dict(metrics or {}),
                **data_source_fields(self.data_source)}

    def last_contents(self, state: TrainState) -> dict:
        p = self.parts
        ckpt = self._common(p.model, state, None)
        ckpt.update({"batch_in_epoch": state.batch_in_epoch, "optimizer": p.optimizer.state_dict(),
                     "scheduler": p.scheduler.state_dict(), "scaler": p.scaler.state_dict(), "rng": rng_state(),
                     "train_state": dataclasses.asdict(state), "world_size": self.world_size})
        if p.ema is not None:
            # A bare state_dict, like `model`, so timm's load_checkpoint(use_ema=True) also reads it.
            ckpt["model_ema"] = bare_state_dict(p.ema.module)
        return ckpt

    def best_contents(self, state: TrainState, metrics: dict) -> dict:
        return self._common(self.parts.eval_model, state, metrics)

    def save_last(self, state: TrainState) -> None:
        """Call on every rank at the same point: all agree on refusing non-finite weights."""
        self.refuse_nonfinite("last.pt", state.step)
        if self.is_main:
            save_atomic(self.last_contents(state), self.run_dir / "last.pt", keep_previous=True)

    def save_best(self, state: TrainState, metrics: dict) -> None:
        self.refuse_nonfinite("best.pt", state.step)
        if self.is_main:
            save_atomic(self.best_contents(state, metrics), self.run_dir / "best.pt")

    def refuse_nonfinite(self, name: str, step: int) -> None:
        """Non-finite weights are never saved: the file keeps the last good state."""
        tensors = [t for t in (*self.parts.model.parameters(), *self.parts.model.buffers()) if t.is_floating_point()]
        if tensors and not bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all()):
            raise NonFiniteError(f"the weights became non-finite by optimizer step {step}; {name} was not "
                                 f"written and keeps the last good state (lower optim.lr or set train.clip_grad_norm)")

    def restore(self, ckpt: dict) -> TrainState:
        """Load last.pt's weights, optimizer, scheduler, scaler and RNG into the run; returns its state."""
        p = self.parts
        p.model.load_state_dict(ckpt["model"])
        if p.ema is not None:
            p.ema.module.load_state_dict(ckpt["model_ema"])
        p.optimizer.load_state_dict(ckpt["optimizer"])
        p.scheduler.load_state_dict(ckpt["scheduler"])
        p.scaler.load_state_dict(ckpt["scaler"])
        set_rng_state(ckpt["rng"])
        state = TrainState(**ckpt["train_state"])
        log.info("resumed at epoch %d, batch %d, optimizer step %d", state.epoch + 1, state.batch_in_epoch, state.step)
        return state


def data_source_fields(data_source: Optional[dict]) -> dict:
    """The checkpoint's record of where its samples came from (data.sources.DataSources.identity)."""
    return {"data_source": dict(data_source)} if data_source else {}


def data_source_differences(saved: Optional[dict], current: Optional[dict]) -> list[str]:
    """What --resume refuses about the data itself: another held-out split, other CSV lists. A checkpoint
    without a record (older ones) is compared by its config only."""
    if not saved or not current:
        return []
    diffs = []
    split_a, split_b = saved.get("split"), current.get("split")
    if split_a != split_b:
        def sizes(split):
            return f"{len(split['train'])} train / {len(split['val'])} val files" if split else "no split"
        diffs.append(f"data split (data.val_fraction): other files on each side ({sizes(split_a)} -> "
                     f"{sizes(split_b)}); the held-out files must stay held out")
    for key, name in (("train_csv_sha256", "data.train_csv"), ("val_csv_sha256", "data.val_csv")):
        if saved.get(key) != current.get(key):
            diffs.append(f"{name}: its files and labels differ from the list the checkpoint was trained on")
    for key, name in (("train_shards", "data.train_shards (shard names)"), ("train_samples", "training samples"),
                      ("loader_workers", "data.num_workers (a shard stream is split across loader workers)")):
        if saved.get(key) != current.get(key):
            diffs.append(f"{name}: {saved.get(key)!r} -> {current.get(key)!r}")
    return diffs


def check_resume_compatible(ckpt: dict, cfg: Config, classes: list[str], world_size: int,
                            data_source: Optional[dict] = None) -> None:
    """ConfigError (exit 2) listing what differs when `ckpt` is not a state this run can continue: the
    config keys the math depends on (those not marked resume-free), the classes, the process count."""
    saved = ckpt.get("config")
    if not isinstance(saved, dict) or "optimizer" not in ckpt:
        raise ConfigError("--resume: this checkpoint holds no training state (is it a best.pt? use last.pt, "
                          "or --finetune to start a new schedule from its weights)")
    diffs = config_differences(saved, cfg.to_dict())
    if ckpt.get("classes") != classes:
        diffs.append(f"classes: {ckpt.get('classes')} -> {classes}")
    if ckpt.get("world_size", 1) != world_size:
        diffs.append(f"world size: {ckpt.get('world_size', 1)} -> {world_size}")
    diffs += data_source_differences(ckpt.get("data_source"), data_source)
    if diffs:
        raise ConfigError("--resume: the run would not continue the same training; these differ from the "
                          "checkpoint:\n  " + "\n  ".join(diffs) +
                          "\n(keep them, or pass --finetune CKPT to start a new schedule from its weights)")


def resolve_resume(resume: str, run_dir: Path) -> Optional[dict]:
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


def load_finetune_source(path: str) -> dict:
    try:
        return load_checkpoint(path)
    except CheckpointError as err:
        raise ConfigError(f"--finetune {path}: {err}") from err


# ---------------------------------------------------------------- reading back for eval.py and infer.py


@dataclass
class LoadedCheckpoint:
    path: Path
    cfg: Config
    classes: list[str]
    state_dict: dict
    epoch: int
    saved_val_limit: Optional[int] = None  # data.limit_val_batches of the training run
    data_source: Optional[dict] = None     # the training run's data record (split file lists, ...)

    def eval_transform(self) -> EvalTransform:
        return eval_transform(self.cfg.data)


def read_checkpoint(path: str | Path, overrides: list[str] = ()) -> LoadedCheckpoint:
    """Load a checkpoint (weights_only) and rebuild its config: saved config, then the saved eval
    preprocessing, then `overrides` (KEY=VALUE). Raises CheckpointError / ConfigError (exit 2)."""
    path = Path(path)
    ckpt = load_checkpoint(path)
    missing = [k for k in ("model", "classes", "config") if k not in ckpt]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {', '.join(missing)}: not a checkpoint written by train.py")
    classes = ckpt["classes"]
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes) or not classes:
        raise CheckpointError(f"checkpoint {path}: 'classes' must be a non-empty list of class names")
    if len(set(classes)) != len(classes):
        raise CheckpointError(f"checkpoint {path}: duplicate class names in 'classes'")
    try:
        cfg = config_from_dict(ckpt["config"])
    except ConfigError as err:
        raise CheckpointError(f"checkpoint {path}: its saved config does not load: {err}") from err
    saved_val_limit = cfg.data.limit_val_batches
    preprocessing = ckpt.get("preprocessing") or {}
    for key in PREPROCESSING_KEYS:
        if key in preprocessing:
            setattr(cfg.data, key, preprocessing[key])
    cfg.data.limit_val_batches = None  # a training dry-run setting; evaluation reads the whole split unless asked
    apply_overrides(cfg, overrides)
    validate(cfg)
    return LoadedCheckpoint(path, cfg, list(classes), ckpt["model"], int(ckpt.get("epoch", 0)), saved_val_limit,
                            ckpt.get("data_source"))


def build_eval_model(loaded: LoadedCheckpoint, device: torch.device, channels_last: bool) -> torch.nn.Module:
    """The bare model with the checkpoint's weights (strict), in eval mode, on `device`."""
    model = build_model(loaded.cfg.model, len(loaded.classes))
    try:
        model.load_state_dict(loaded.state_dict, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"checkpoint {loaded.path}: its weights do not fit model '{loaded.cfg.model.name}' "
                              f"with {len(loaded.classes)} classes: {str(err).splitlines()[0]}") from err
    return model.to(device, memory_format=memory_format(channels_last)).eval()


def find_newest_checkpoint(search_root: str | Path = "runs", name: str = "best.pt") -> Path:
    """The most recently written `name` under `search_root` (recursively)."""
    search_root = Path(search_root)
    candidates = [p for p in search_root.rglob(name) if p.is_file()] if search_root.is_dir() else []
    if not candidates:
        raise CheckpointError(f"no --checkpoint given and no {name} under {search_root.resolve()}/; "
                              f"pass --checkpoint PATH (a best.pt or last.pt written by train.py)")
    return max(candidates, key=lambda p: (p.stat().st_mtime_ns, str(p)))
