"""What a model file stores beside its weights (the class names, the eval preprocessing, the training config,
the calibration, a multi-label model's thresholds), read back and checked one way for every path that opens a
model file: a checkpoint, an ONNX export, a torch.export program, a timm folder, and the slim server
(serving.slim), which copies this module: it imports no torch.

A value the file cannot mean is a CheckpointError (exit 2) naming the file, the field, its value and what is
allowed; the preprocessing goes through the config's own declarations and checks (config), so a file
is held to exactly what `data.*` allows in a config."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from imgcls.config import Config, apply_dict, apply_overrides, config_from_dict, validate
from imgcls.core.errors import CheckpointError, ConfigError
from imgcls.core.settings import check_calibration_record
from imgcls.data.settings import eval_size

ONNX_METADATA_PREFIX = "imgcls."    # ONNX metadata_props keys: imgcls.classes, imgcls.preprocessing, ...
# keys of a model file's `preprocessing` that are also `data.*` config keys
PREPROCESSING_KEYS = ("img_size", "crop_pct", "interpolation", "mean", "std")


def check_class_names(classes, where: str) -> list[str]:
    """`classes` as a list of distinct names, or CheckpointError (exit 2) naming `where` they came from."""
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes) or not classes:
        raise CheckpointError(f"{where}: 'classes' must be a non-empty list of class names")
    if len(set(classes)) != len(classes):
        raise CheckpointError(f"{where}: duplicate class names in 'classes'")
    return list(classes)


def check_output_count(classes: list[str], outputs: int, where: str) -> None:
    """The model gives one output per class name: a file with fewer names would drop a class from every row
    (and more would name classes the model never scores)."""
    if outputs != len(classes):
        raise CheckpointError(f"{where}: 'classes' names {len(classes)} class(es), but the model has {outputs} "
                              f"outputs; one name per output is allowed: the file was altered after it was "
                              f"written, export it again")


def threshold_problem(thresholds, count: int) -> Optional[str]:
    if not isinstance(thresholds, list):
        return f"{thresholds!r} is not a list"
    if len(thresholds) != count:
        return f"{len(thresholds)} value(s) for {count} class(es)"
    for i, t in enumerate(thresholds):
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 <= t <= 1:
            return f"thresholds[{i}] = {t!r}"
    return None


def check_thresholds(thresholds, count: int, where: str) -> Optional[list]:
    """A multi-label model's per-class thresholds: None, or `count` numbers in [0, 1] (CheckpointError)."""
    if thresholds is None:
        return None
    problem = threshold_problem(thresholds, count)
    if problem:
        raise CheckpointError(f"{where}: 'thresholds' = {problem}: {count} finite numbers in [0, 1], one per "
                              f"class, are allowed")
    return [float(t) for t in thresholds]


def eval_config(saved_config: dict, preprocessing: dict, overrides: list[str] = (),
                where: str = "checkpoint") -> tuple[Config, Optional[int]]:
    """The config eval.py and infer.py run with: the saved training config, then the saved eval
    preprocessing (typed and checked as the `data.*` keys are), then `overrides`. Returns it with the training
    run's data.limit_val_batches."""
    try:
        cfg = config_from_dict(saved_config)
    except ConfigError as err:
        raise CheckpointError(f"{where}: its saved config does not load: {err}") from err
    saved_val_limit = cfg.data.limit_val_batches
    # The loaded config describes evaluation: data.img_size is the size validation used, so an override
    # data.img_size=N (or data.eval_img_size=N) sets the eval size.
    cfg.data.img_size, cfg.data.eval_img_size = eval_size(cfg.data), None
    if not isinstance(preprocessing, dict):
        raise CheckpointError(f"{where}: 'preprocessing' = {preprocessing!r}: a mapping of "
                              f"{', '.join(PREPROCESSING_KEYS)} is allowed")
    try:
        apply_dict(cfg.data, {key: preprocessing[key] for key in PREPROCESSING_KEYS if key in preprocessing},
                   source="its eval preprocessing", prefix="data.")
        validate(cfg)
    except ConfigError as err:
        raise CheckpointError(f"{where}: {err} (the file's eval preprocessing holds what the data.* config key "
                              f"allows; export the model again from its checkpoint)") from err
    cfg.data.limit_val_batches = None  # a training dry-run setting; evaluation reads the whole split unless asked
    apply_overrides(cfg, overrides)
    validate(cfg)
    return cfg, saved_val_limit


@dataclass
class StoredMetadata:
    """The metadata an export carries (export.py writes it: model_files.metadata.export_metadata), checked."""

    cfg: Config
    classes: list[str]
    saved_val_limit: Optional[int]
    epoch: Optional[int]
    batch: Optional[int]
    calibration: Optional[dict]
    thresholds: Optional[list]


def read_metadata(metadata: dict, path: Path, overrides: list[str] = ()) -> StoredMetadata:
    """An export's metadata checked field by field (CheckpointError, exit 2, naming the file and the field)."""
    where = str(path)
    classes = check_class_names(metadata.get("classes"), where)
    cfg, saved_val_limit = eval_config(metadata.get("config") or {}, metadata.get("preprocessing") or {},
                                       overrides, where)
    calibration = metadata.get("calibration")
    if calibration is not None and not isinstance(calibration, dict):
        raise CheckpointError(f"{where}: 'calibration' = {calibration!r}: a mapping (temperature, thresholds) "
                              f"or null is allowed")
    check_calibration_record(calibration, path)
    epoch, batch = metadata.get("epoch"), metadata.get("batch")
    for name, value in (("epoch", epoch), ("batch", batch)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise CheckpointError(f"{where}: '{name}' = {value!r}: a whole number >= 0 or null is allowed")
    return StoredMetadata(cfg, classes, saved_val_limit, epoch, batch, calibration,
                          check_thresholds(metadata.get("thresholds"), len(classes), where))


def metadata_from_onnx_props(props: dict[str, str], path: Path) -> Optional[dict]:
    """The imgcls metadata of an ONNX model's metadata_props (None: a file export.py did not write)."""
    ours = {k[len(ONNX_METADATA_PREFIX):]: v for k, v in props.items() if k.startswith(ONNX_METADATA_PREFIX)}
    if "classes" not in ours:
        return None
    try:
        return {key: json.loads(value) for key, value in ours.items()}
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: its imgcls metadata is not valid JSON ({err})") from err
