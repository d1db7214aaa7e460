"""A trained checkpoint turned back into what training evaluated: the model, its classes, its config and
its eval preprocessing; class matching by name against a data folder.

Used by eval.py and infer.py. The config is the checkpoint's resolved training config (so batch size,
AMP, channels_last and preprocessing are what validation used), with the caller's overrides on top.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from data.folder import DataTreeError, ImageFolderIndex
from data.transforms import EvalTransform
from engine.checkpoint import CheckpointError, load_checkpoint
from engine.config import Config, ConfigError, apply_dict, config_from_dict, nest, parse_override, validate
from models.factory import create_model

log = logging.getLogger("train")

# keys of a checkpoint's `preprocessing` that are also `data.*` config keys
_PREPROCESSING_KEYS = ("img_size", "crop_pct", "interpolation", "mean", "std")


@dataclass
class LoadedCheckpoint:
    path: Path
    cfg: Config
    classes: list[str]
    state_dict: dict
    epoch: int
    saved_val_limit: int | None = None  # data.limit_val_batches of the training run

    def eval_transform(self) -> EvalTransform:
        d = self.cfg.data
        return EvalTransform(d.img_size, d.crop_pct, d.interpolation)


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
    for key in _PREPROCESSING_KEYS:
        if key in preprocessing:
            setattr(cfg.data, key, preprocessing[key])
    cfg.data.limit_val_batches = None  # a training dry-run setting; evaluation reads the whole split unless asked
    for text in overrides:
        key, value = parse_override(text)
        apply_dict(cfg, nest(key, value), source="command line")
    validate(cfg)
    return LoadedCheckpoint(path, cfg, list(classes), ckpt["model"], int(ckpt.get("epoch", 0)), saved_val_limit)


def build_model(loaded: LoadedCheckpoint, device: torch.device, channels_last: bool) -> torch.nn.Module:
    """The bare model with the checkpoint's weights (strict), in eval mode, on `device`."""
    m = loaded.cfg.model
    model = create_model(m.name, len(loaded.classes), m.drop_rate, m.drop_path_rate, m.norm, m.group_norm_groups)
    try:
        model.load_state_dict(loaded.state_dict, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"checkpoint {loaded.path}: its weights do not fit model '{m.name}' with "
                              f"{len(loaded.classes)} classes: {str(err).splitlines()[0]}") from err
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    return model.to(device, memory_format=memory_format).eval()


def match_classes(index: ImageFolderIndex, classes: list[str]) -> ImageFolderIndex:
    """Relabel a scanned split so that label i means `classes[i]` (the model's order).

    The folder must hold exactly the checkpoint's class names; the same names in another order are
    remapped, any difference is a DataTreeError (exit 2) that lists it."""
    found = set(index.classes)
    wanted = set(classes)
    if found != wanted:
        missing = sorted(wanted - found)
        extra = sorted(found - wanted)
        raise DataTreeError(f"{index.root}: its class folders differ from the checkpoint's classes; "
                            f"missing here: {missing or 'none'}; not in the checkpoint: {extra or 'none'}")
    if index.classes == classes:
        return index
    position = {name: i for i, name in enumerate(classes)}
    remap = [position[name] for name in index.classes]
    log.info("class folders are in another order than the checkpoint's classes; labels remapped by name")
    return ImageFolderIndex(index.root, list(classes), list(index.paths), [remap[label] for label in index.labels])


def find_newest_checkpoint(search_root: str | Path = "runs", name: str = "best.pt") -> Path:
    """The most recently written `name` under `search_root` (recursively)."""
    search_root = Path(search_root)
    candidates = [p for p in search_root.rglob(name) if p.is_file()] if search_root.is_dir() else []
    if not candidates:
        raise CheckpointError(f"no --checkpoint given and no {name} under {search_root.resolve()}/; "
                              f"pass --checkpoint PATH (a best.pt or last.pt written by train.py)")
    return max(candidates, key=lambda p: (p.stat().st_mtime_ns, str(p)))


@dataclass
class EvalResult:
    metrics: dict
    per_class: dict
    confusion: torch.Tensor
    classes: list[str]
    skipped_files: list[str]
    settings: dict


def evaluate_checkpoint(checkpoint: str | Path, data_root: str | None = None, split: str | None = None,
                        batch_size: int | None = None, tta: bool = False, overrides: list[str] = ()) -> EvalResult:
    """Evaluate a checkpoint on a split exactly as training validated it: the same preprocessing, batch
    size, AMP setting (resolved by `resolve_amp`), channels_last and `engine.loop.evaluate`."""
    from data.build import prepare_root
    from data.datasets import EvalDataset
    from data.folder import scan_split
    from data.loaders import build_eval_loader
    from engine.device import pin_memory_for, resolve_amp, select_device
    from engine.loop import evaluate
    from engine.metrics import per_class_report

    loaded = read_checkpoint(checkpoint, overrides)
    cfg = loaded.cfg
    if data_root is not None:
        cfg.data.root = data_root
    if batch_size is not None:
        if batch_size < 1:
            raise ConfigError(f"--batch-size {batch_size}: must be >= 1")
        cfg.train.batch_size = batch_size
    split = split or cfg.data.val_split
    if not cfg.data.root:
        raise ConfigError("no data folder: the checkpoint's config has no data.root; pass --data ROOT")
    if isinstance(cfg.train.batch_size, str):  # 'auto' is resolved before training saves its config
        raise ConfigError("the checkpoint's train.batch_size is 'auto'; pass --batch-size N")
    root = Path(cfg.data.root).expanduser()
    if cfg.data.builtin and data_root is None and not (root / split).is_dir():
        prepare_root(cfg)  # the checkpoint's own built-in data set, written anew; never a folder the user named
    if loaded.saved_val_limit and not cfg.data.limit_val_batches:
        log.warning("training validated this checkpoint on its first %d batch(es) only (data.limit_val_batches); "
                    "this evaluation reads the whole split (pass data.limit_val_batches=%d to match training)",
                    loaded.saved_val_limit, loaded.saved_val_limit)
    index = match_classes(scan_split(root / split), loaded.classes)

    device = select_device(cfg.train.device)
    amp_dtype = resolve_amp(cfg.train.amp, device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # as in training, so the same conv algorithms are chosen
    model = build_model(loaded, device, cfg.train.channels_last)
    dataset = EvalDataset(index, loaded.eval_transform(), cfg.data.img_size)
    pin = pin_memory_for(cfg.data.pin_memory, device)
    limit = cfg.data.limit_val_batches * cfg.train.batch_size if cfg.data.limit_val_batches else None
    loader = build_eval_loader(dataset, cfg.train.batch_size, cfg.data.num_workers, pin,
                               prefetch_factor=cfg.data.prefetch_factor, limit_samples=limit)
    sums, bad = evaluate(model, loader, device, len(loaded.classes), cfg.data.mean, cfg.data.std,
                         cfg.train.channels_last, amp_dtype, tta_flip=tta)
    metrics = sums.compute()
    confusion = sums.confusion.cpu()
    skipped = [index.paths[i] for i in sorted(bad)]
    settings = {"checkpoint": str(loaded.path), "epoch": loaded.epoch, "data": str(root), "split": split,
                "batch_size": cfg.train.batch_size, "amp": {None: "none", torch.bfloat16: "bf16",
                                                            torch.float16: "fp16"}[amp_dtype],
                "channels_last": cfg.train.channels_last, "tta": tta, "device": str(device),
                "preprocessing": {"img_size": cfg.data.img_size, "crop_pct": cfg.data.crop_pct,
                                  "interpolation": cfg.data.interpolation, "mean": list(cfg.data.mean),
                                  "std": list(cfg.data.std)}}
    return EvalResult(metrics, per_class_report(confusion, loaded.classes), confusion, loaded.classes, skipped,
                      settings)
