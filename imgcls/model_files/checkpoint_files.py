"""Reading a checkpoint written by train.py back for eval.py, infer.py and export.py: its weights, class
names and config, with the eval preprocessing it recorded (`preprocessing_record`, which the checkpoint
writer also uses), and the newest best.pt when none is named."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from imgcls.compute.device import memory_format
from imgcls.config import Config
from imgcls.core.errors import CheckpointError
from imgcls.core.safe_load import load_checkpoint
from imgcls.data.eval_preprocessing import EvalPreprocessing
from imgcls.model_files.model_file import ModelFile
from imgcls.model_files.stored_metadata import check_class_names, check_thresholds, eval_config
from imgcls.models.factory import build_model


def preprocessing_record(cfg: Config) -> dict:
    """The eval preprocessing saved beside the weights, which eval.py and infer.py apply: `img_size` is the
    eval input size (`data.eval_img_size` when set), `train_img_size` the training crop's."""
    return EvalPreprocessing.of(cfg.data).record(train_img_size=cfg.data.img_size)


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
                       thresholds=check_thresholds(ckpt.get("thresholds"), len(classes), f"checkpoint {path}"),
                       old_classes=recorded_old_classes(ckpt, classes))
    return opened


def recorded_old_classes(ckpt: dict, classes: list[str]) -> Optional[list[str]]:
    """The base classes a class-incremental checkpoint records (`incremental.old_classes`, the first of its
    classes), or None: not an extension, or a record that does not match its classes."""
    old = (ckpt.get("incremental") or {}).get("old_classes") if isinstance(ckpt.get("incremental"), dict) else None
    if isinstance(old, list) and 0 < len(old) <= len(classes) and list(classes[:len(old)]) == old:
        return list(old)
    return None


def recorded_threads(ckpt: Optional[dict]) -> Optional[int]:
    """The CPU thread count a checkpoint's run computed with (None: no checkpoint, or none recorded)."""
    threads = ckpt.get("threads") if ckpt is not None else None
    return threads if isinstance(threads, int) and threads > 0 else None


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
