"""The checkpoint format, in one place: what goes into last.pt and best.pt, restoring a run from last.pt,
`--resume auto` with its fallback, what may change on resume, and reading a checkpoint back for
eval.py / infer.py (the model, its classes, its config and its eval preprocessing).

last.pt: `model` (the trained weights, a bare state_dict), `classes`, `config`, `preprocessing`, `epoch`,
`step`, `metrics`, and the training state: `batch_in_epoch`, `optimizer`, `scheduler`, `scaler`, `rng`,
`train_state`, `world_size`, `data_fingerprint` (`data.fingerprint`), and with EMA `model_ema`. Both record
`data_source` (the data format, a `data.val_fraction` split's file lists, CSV lists' digests). best.pt: the
evaluated weights (the EMA when on) under `model`, with the same metadata and no training state.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from core.config import Config, apply_overrides, config_differences, config_from_dict, eval_size, validate
from core.errors import CheckpointError, ConfigError, DiskFullError, NonFiniteError
from data.build import eval_transform
from data.fingerprint import fingerprint_differences
from data.transforms import EvalTransform
from core.safe_load import load_checkpoint
from engine.rundir.atomic_files import bare_state_dict, rng_state, save_atomic, set_rng_state
from engine.runtime.device import memory_format
from engine.runtime.distributed import run_on_main
from engine.rundir.state import EpochCounters, TrainState
from models.factory import build_model, load_matching_weights

log = logging.getLogger("train")

FORMAT_VERSION = 1
# keys of a checkpoint's `preprocessing` that are also `data.*` config keys
PREPROCESSING_KEYS = ("img_size", "crop_pct", "interpolation", "mean", "std")


def preprocessing_record(cfg: Config) -> dict:
    """The eval preprocessing saved beside the weights, which eval.py and infer.py apply: `img_size` is the
    eval input size (`data.eval_img_size` when set), `train_img_size` the training crop's."""
    d = cfg.data
    return {"img_size": eval_size(d), "resize": eval_transform(d).resize_to, "crop_pct": d.crop_pct,
            "mean": list(d.mean), "std": list(d.std), "interpolation": d.interpolation,
            "train_img_size": d.img_size}


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
                 parts: TrainingParts, data_source: Optional[dict] = None, fingerprint: Optional[dict] = None):
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self.cfg = cfg
        self.classes = classes
        self.world_size = world_size
        self.parts = parts
        self.data_source = data_source
        self.fingerprint = fingerprint  # data.fingerprint.data_fingerprint of the run's splits
        self.saved_state: Optional[TrainState] = None  # what last.pt on disk holds (restored or last saved)

    def _common(self, weights: torch.nn.Module, state: TrainState, metrics: Optional[dict]) -> dict:
        return {"format_version": FORMAT_VERSION, "model": bare_state_dict(weights), "classes": list(self.classes),
                "config": self.cfg.to_dict(), "preprocessing": preprocessing_record(self.cfg),
                "epoch": state.epoch, "step": state.step, "metrics": dict(metrics or {}),
                # the CPU threads the run computed with: a resume, eval.py and infer.py take the same by
                # default, since sums over another thread count round differently in the last digits
                "threads": torch.get_num_threads(), **data_source_fields(self.data_source)}

    def last_contents(self, state: TrainState) -> dict:
        p = self.parts
        ckpt = self._common(p.model, state, None)
        ckpt.update({"batch_in_epoch": state.batch_in_epoch, "optimizer": p.optimizer.state_dict(),
                     "scheduler": p.scheduler.state_dict(), "scaler": p.scaler.state_dict(), "rng": rng_state(),
                     "train_state": dataclasses.asdict(state), "world_size": self.world_size})
        if self.fingerprint is not None:
            ckpt["data_fingerprint"] = self.fingerprint
        if p.ema is not None:
            # A bare state_dict, like `model`, so timm's load_checkpoint(use_ema=True) also reads it.
            ckpt["model_ema"] = bare_state_dict(p.ema.module)
        return ckpt

    def best_contents(self, state: TrainState, metrics: dict) -> dict:
        ckpt = self._common(self.parts.eval_model, state, metrics)
        if "thresholds" in metrics:  # data.task=multilabel: per-class thresholds tuned on this validation
            ckpt["thresholds"] = [float(t) for t in metrics["thresholds"]]
        return ckpt

    def save_last(self, state: TrainState) -> None:
        """Call on every rank at the same point: all agree on refusing non-finite weights, and all stop when
        rank 0 finds the disk full."""
        self.refuse_nonfinite("last.pt", state.step)
        run_on_main(self.is_main, lambda: save_atomic(self.last_contents(state), self.run_dir / "last.pt",
                                                      keep_previous=True), shared=(DiskFullError,))
        self.saved_state = TrainState(**dataclasses.asdict(state))

    def save_best(self, state: TrainState, metrics: dict) -> None:
        self.refuse_nonfinite("best.pt", state.step)
        run_on_main(self.is_main, lambda: save_atomic(self.best_contents(state, metrics), self.run_dir / "best.pt"),
                    shared=(DiskFullError,))

    def refuse_nonfinite(self, name: str, step: int) -> None:
        """Non-finite weights are never saved: the file keeps the last good state."""
        tensors = [t for t in (*self.parts.model.parameters(), *self.parts.model.buffers()) if t.is_floating_point()]
        if tensors and not all_finite(tensors):
            raise NonFiniteError(f"the weights became non-finite by optimizer step {step}; {name} was not "
                                 f"written and keeps the last good state (lower optim.lr or set train.clip_grad_norm)")

    def restore(self, ckpt: dict) -> TrainState:
        """Load last.pt's weights, optimizer, scheduler, scaler and RNG into the run; returns its state.
        A part that does not load (a damaged or foreign file that `check_resume_compatible` let through)
        is a CheckpointError (exit 2) naming it."""
        p = self.parts
        parts = [("model", lambda: p.model.load_state_dict(ckpt["model"])),
                 ("model_ema", lambda: p.ema is None or p.ema.module.load_state_dict(ckpt["model_ema"])),
                 ("optimizer", lambda: p.optimizer.load_state_dict(ckpt["optimizer"])),
                 ("scheduler", lambda: p.scheduler.load_state_dict(ckpt["scheduler"])),
                 ("scaler", lambda: p.scaler.load_state_dict(ckpt["scaler"])),
                 ("rng", lambda: set_rng_state(ckpt["rng"]))]
        for name, load in parts:
            try:
                load()
            except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as err:
                reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
                raise CheckpointError(f"--resume: the checkpoint's '{name}' does not load into this run "
                                      f"({type(err).__name__}: {reason}); the file is damaged or was not "
                                      f"written by this train.py") from err
        state = TrainState(**ckpt["train_state"])
        self.saved_state = TrainState(**dataclasses.asdict(state))
        log.info("resumed at epoch %d, batch %d, optimizer step %d", state.epoch + 1, state.batch_in_epoch, state.step)
        return state


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of `tensors` is finite (one host sync). A tensor's sum is finite only if all its
    elements are, and summing is ~10x cheaper than an elementwise isfinite per tensor; a sum that overflows
    (finite elements near the float limit) is settled by the exact check."""
    sums = torch.stack([t.sum(dtype=torch.float32) for t in tensors])
    if bool(torch.isfinite(sums).all()):
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


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


# what a last.pt must hold, with the type of each part
TRAINING_STATE_TYPES = {"model": dict, "optimizer": dict, "scheduler": dict, "scaler": dict, "rng": dict,
                        "train_state": dict, "epoch": int, "step": int, "batch_in_epoch": int}


def training_state_problems(ckpt: dict, ema: bool) -> list[str]:
    """What is missing or malformed in a last.pt's training state (an empty list for a sound one)."""
    problems = [f"'{key}' is missing" if key not in ckpt else f"'{key}' is not a {kind.__name__}"
                for key, kind in TRAINING_STATE_TYPES.items()
                if not isinstance(ckpt.get(key), kind) or isinstance(ckpt.get(key), bool)]
    if ema and not isinstance(ckpt.get("model_ema"), dict):
        problems.append("'model_ema' is missing (the run has model.ema_decay set)")
    for key in ("model", "model_ema"):
        if isinstance(ckpt.get(key), dict) and not all(isinstance(v, torch.Tensor) for v in ckpt[key].values()):
            problems.append(f"'{key}' holds values that are not tensors")
    rng = ckpt.get("rng")
    if isinstance(rng, dict):
        missing = [k for k in ("python", "numpy", "torch") if k not in rng]
        if missing:
            problems.append(f"'rng' lacks {', '.join(missing)}")
    train_state = ckpt.get("train_state")
    if isinstance(train_state, dict):
        known = {f.name for f in dataclasses.fields(TrainState)}
        unknown = sorted(set(map(str, train_state)) - known)
        if unknown:
            problems.append(f"'train_state' has unknown keys {unknown}")
        progress = train_state.get("progress") or {}
        counters = {f.name for f in dataclasses.fields(EpochCounters)} | {"bad_indices"}
        if not isinstance(progress, dict) or set(map(str, progress)) - counters:
            problems.append("'train_state.progress' is not a saved epoch's counters")
    return problems


def check_resume_compatible(ckpt: dict, cfg: Config, classes: list[str], world_size: int,
                            data_source: Optional[dict] = None, fingerprint: Optional[dict] = None) -> None:
    """ConfigError (exit 2) listing what differs when `ckpt` is not a state this run can continue: the
    config keys the math depends on (those not marked resume-free), the classes, the process count, the
    files of each split (`fingerprint`, against the one last.pt recorded). CheckpointError (exit 2) when its
    training state is incomplete or malformed."""
    saved = ckpt.get("config")
    if not isinstance(saved, dict) or "optimizer" not in ckpt:
        raise ConfigError("--resume: this checkpoint holds no training state (is it a best.pt? use last.pt, "
                          "or --finetune to start a new schedule from its weights)")
    problems = training_state_problems(ckpt, ema=cfg.model.ema_decay is not None)
    if problems:
        raise CheckpointError("--resume: the checkpoint is damaged or was not written by this train.py: "
                              + "; ".join(problems))
    diffs = config_differences(saved, cfg.to_dict())
    if ckpt.get("classes") != classes:
        diffs.append(f"classes: {ckpt.get('classes')} -> {classes}")
    if ckpt.get("world_size", 1) != world_size:
        diffs.append(f"world size: {ckpt.get('world_size', 1)} -> {world_size}")
    diffs += data_source_differences(ckpt.get("data_source"), data_source)
    if fingerprint is not None:
        if isinstance(ckpt.get("data_fingerprint"), dict):
            diffs.extend(fingerprint_differences(ckpt["data_fingerprint"], fingerprint))
        else:
            log.info("--resume: the checkpoint records no data fingerprint (an older train.py); the files "
                     "of the splits are not compared")
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
        except CheckpointError as err:
            log.warning("--resume auto: %s; trying the previous state", err)
            continue
        if path.name == "last.pt":
            log.info("--resume auto: resuming from %s", path)
        else:
            log.warning("--resume auto: last.pt in %s is %s; resuming from %s (epoch %s, step %s), the state "
                        "saved before it", run_dir, "damaged" if candidates[0].exists() else "missing", path,
                        ckpt.get("epoch"), ckpt.get("step"))
        return ckpt
    raise ConfigError(f"--resume auto: no loadable checkpoint in {run_dir} (last.pt and last.prev.pt are damaged)")


def load_finetune_source(path: str) -> dict:
    try:
        return load_checkpoint(path)
    except CheckpointError as err:
        raise ConfigError(f"--finetune {path}: {err}") from err


CHECKPOINT_FILES = ("last.pt", "last.prev.pt", "best.pt")
# What output.overwrite=true deletes besides the checkpoints: every other file a run writes (train.log is
# emptied rather than deleted, as this run's log is already open on it). Nothing else in the folder is touched.
RUN_FILES = ("summary.json", "metrics.csv", "config.yaml", "batch_finder.json")


def claim_run_dir(run_dir: Path, resume: Optional[str], overwrite: bool, is_main: bool) -> None:
    """Before a new run writes into `run_dir` (call right after the log is set up): a folder holding another
    run's checkpoints is refused (ConfigError, exit 2) unless `output.overwrite`, which deletes that run's
    files first. `--resume PATH` continues a run, and so does `--resume auto` when a last.pt is there."""
    found = [name for name in CHECKPOINT_FILES if (run_dir / name).exists()]
    resuming = resume is not None and (resume != "auto" or "last.pt" in found or "last.prev.pt" in found)
    if resuming or not found:
        return
    if not overwrite:
        if "last.pt" in found or "last.prev.pt" in found:
            keep = "Continue that run with --resume auto"
        else:
            keep = f"Train on from its weights with --finetune {run_dir / 'best.pt'} and a new output.dir"
        raise ConfigError(f"output.dir {run_dir} holds checkpoints of another run ({', '.join(found)}), which a new "
                          f"run would replace. {keep}, start a new run in a new output.dir=..., or pass "
                          f"output.overwrite=true to delete that run's files (checkpoints, metrics.csv, "
                          f"summary.json, TensorBoard events, train.log) and start afresh here")
    if not is_main:
        return
    removed = [*found, *(name for name in RUN_FILES if (run_dir / name).exists())]
    for name in removed:
        (run_dir / name).unlink()
    events = sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    for path in events:
        path.unlink()
    if (run_dir / "train.log").exists():
        os.truncate(run_dir / "train.log", 0)
    log.warning("output.overwrite=true: deleted the previous run's %s%s from %s and emptied its train.log",
                ", ".join(removed), f" and {len(events)} TensorBoard event file(s)" if events else "", run_dir)


# Below this share of the model's parameters, a --finetune source is most likely another architecture.
FINETUNE_MIN_SHARE = 0.5


def apply_finetune(model: torch.nn.Module, ckpt: dict, source: str, allow_partial: bool = False) -> float:
    """Load the checkpoint's tensors that match `model` by name and shape; returns the share of the model's
    parameters (by count) they cover. Under FINETUNE_MIN_SHARE a ConfigError (exit 2) unless `allow_partial`;
    under all of them a warning naming the share and what starts from random."""
    weights = ckpt.get("model") if isinstance(ckpt.get("model"), dict) else {}
    loaded, skipped = load_matching_weights(model, weights)
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    share = sum(params[name].numel() for name in loaded if name in params) / max(total, 1)
    source_model = ((ckpt.get("config") or {}).get("model") or {}).get("name", "unknown")
    if share < FINETUNE_MIN_SHARE and not allow_partial:
        raise ConfigError(f"--finetune {source}: only {share:.1%} of the model's parameters ({len(loaded)} tensors) "
                          f"match the checkpoint's by name and shape (it was trained as model.name={source_model}); "
                          f"the rest would start from random. Use a checkpoint of this architecture, or pass "
                          f"--finetune-partial to train from it anyway")
    if share < 1.0:
        log.warning("--finetune: %.1f%% of the model's parameters loaded from %s (%d tensors, model.name=%s); "
                    "starting from random: %s", 100 * share, source, len(loaded), source_model,
                    ", ".join(skipped[:20]) + (", ..." if len(skipped) > 20 else ""))
    else:
        log.info("--finetune: all %d tensors loaded from %s", len(loaded), source)
    return share


# ---------------------------------------------------------------- reading back for eval.py and infer.py


@dataclass
class LoadedCheckpoint:
    path: Path
    cfg: Config
    classes: list[str]
    state_dict: dict
    epoch: int
    saved_val_limit: Optional[int] = None  # data.limit_val_batches of the training run
    threads: Optional[int] = None          # CPU threads the training run validated with
    data_source: Optional[dict] = None     # the training run's data record (split file lists, ...)
    thresholds: Optional[list] = None      # data.task=multilabel: per-class thresholds (best.pt)

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
    classes = check_class_names(ckpt["classes"], f"checkpoint {path}")
    cfg, saved_val_limit = eval_config(ckpt["config"], ckpt.get("preprocessing") or {}, overrides,
                                       f"checkpoint {path}")
    return LoadedCheckpoint(path, cfg, classes, ckpt["model"], int(ckpt.get("epoch", 0)), saved_val_limit,
                            recorded_threads(ckpt), ckpt.get("data_source"),
                            check_thresholds(ckpt.get("thresholds"), len(classes), f"checkpoint {path}"))


def check_thresholds(thresholds, count: int, where: str) -> Optional[list]:
    """A multi-label model's per-class thresholds: None, or `count` numbers in [0, 1] (CheckpointError)."""
    if thresholds is None:
        return None
    if (not isinstance(thresholds, list) or len(thresholds) != count
            or not all(isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t <= 1 for t in thresholds)):
        raise CheckpointError(f"{where}: 'thresholds' must be {count} numbers in [0, 1], one per class")
    return [float(t) for t in thresholds]


def recorded_threads(ckpt: Optional[dict]) -> Optional[int]:
    """The CPU thread count a checkpoint's run computed with (None: no checkpoint, or none recorded)."""
    threads = ckpt.get("threads") if ckpt is not None else None
    return threads if isinstance(threads, int) and threads > 0 else None


def check_class_names(classes, where: str) -> list[str]:
    """`classes` as a list of distinct names, or CheckpointError (exit 2) naming `where` they came from."""
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes) or not classes:
        raise CheckpointError(f"{where}: 'classes' must be a non-empty list of class names")
    if len(set(classes)) != len(classes):
        raise CheckpointError(f"{where}: duplicate class names in 'classes'")
    return list(classes)


def eval_config(saved_config: dict, preprocessing: dict, overrides: list[str] = (),
                where: str = "checkpoint") -> tuple[Config, Optional[int]]:
    """The config eval.py and infer.py run with: the saved training config, then the saved eval
    preprocessing, then `overrides`. Returns it with the training run's data.limit_val_batches."""
    try:
        cfg = config_from_dict(saved_config)
    except ConfigError as err:
        raise CheckpointError(f"{where}: its saved config does not load: {err}") from err
    saved_val_limit = cfg.data.limit_val_batches
    # The loaded config describes evaluation: data.img_size is the size validation used, so an override
    # data.img_size=N (or data.eval_img_size=N) sets the eval size.
    cfg.data.img_size, cfg.data.eval_img_size = eval_size(cfg.data), None
    for key in PREPROCESSING_KEYS:
        if key in preprocessing:
            setattr(cfg.data, key, preprocessing[key])
    cfg.data.limit_val_batches = None  # a training dry-run setting; evaluation reads the whole split unless asked
    apply_overrides(cfg, overrides)
    validate(cfg)
    return cfg, saved_val_limit


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
