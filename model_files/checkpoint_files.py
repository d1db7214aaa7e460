"""Reading a checkpoint written by train.py back for eval.py, infer.py and export.py: its weights, class
names and config, with the eval preprocessing it recorded (`preprocessing_record`, which the checkpoint
writer also uses), and the newest best.pt when none is named."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from core.config import Config, apply_overrides, config_from_dict, eval_size, validate
from core.errors import CheckpointError, ConfigError
from core.safe_load import load_checkpoint
from data.build import eval_transform
from model_files.model_file import ModelFile
from runtime.device import memory_format
from models.factory import build_model

# keys of a checkpoint's `preprocessing` that are also `data.*` config keys
PREPROCESSING_KEYS = ("img_size", "crop_pct", "interpolation", "mean", "std")


def preprocessing_record(cfg: Config) -> dict:
    """The eval preprocessing saved beside the weights, which eval.py and infer.py apply: `img_size` is the
    eval input size (`data.eval_img_size` when set), `train_img_size` the training crop's."""
    d = cfg.data
    return {"img_size": eval_size(d), "resize": eval_transform(d).resize_to, "crop_pct": d.crop_pct,
            "mean": list(d.mean), "std": list(d.std), "interpolation": d.interpolation,
            "train_img_size": d.img_size}



def read_checkpoint(path: str | Path, overrides: list[str] = ()) -> ModelFile:
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
    opened = ModelFile("checkpoint", path, cfg, classes, int(ckpt.get("epoch", 0)),
                       lambda device, channels_last: build_eval_model(opened, device, channels_last),
                       saved_val_limit=saved_val_limit, threads=recorded_threads(ckpt),
                       data_source=ckpt.get("data_source"), state_dict=ckpt["model"],
                       calibration=ckpt.get("calibration") if isinstance(ckpt.get("calibration"), dict) else None,
                       thresholds=check_thresholds(ckpt.get("thresholds"), len(classes), f"checkpoint {path}"))
    return opened


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


def build_eval_model(loaded: ModelFile, device: torch.device, channels_last: bool) -> torch.nn.Module:
    """The bare model with the checkpoint's weights (strict), in eval mode, on `device`."""
    model = build_model(loaded.cfg.model, len(loaded.classes), loaded.cfg.data.channels)
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
