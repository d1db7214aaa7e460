"""The typed config tree: defaults, YAML loading, dotted overrides and validation.

Every knob of the application lives here. `configs/base.yaml` mirrors these defaults with a comment
per key (a test keeps the two in step). Errors raise `ConfigError`, which the entry scripts turn into
exit status 2 before any work starts.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from core.errors import ConfigError
from core.temperature import MAX_TEMPERATURE, MIN_TEMPERATURE
from core.paths import not_a_regular_file

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def _range(lo=None, hi=None, lo_open=False, resume_free=False, hi_open=False):
    """Field metadata: the allowed range (`lo_open` / `hi_open`: that end excluded), and whether the key may
    change on --resume (it does not change the math of the run: paths, workers, logging, checkpoint cadence,
    stopping policy)."""
    return {"min": lo, "max": hi, "lo_open": lo_open, "hi_open": hi_open, "resume_free": resume_free}


FREE = _range(resume_free=True)  # a key without a range that may change on --resume
# torchvision's RandAugment magnitudes are bins 0..30 (num_magnitude_bins=31, as timm's scale)
RANDAUGMENT_MAX_MAGNITUDE = 30
# Bounds every key obeys besides its own range: floats are finite; ints without a stated upper end stay below
# INT_LIMIT (counts, sizes, intervals); seeds below 2^63 (what torch's generators take).
INT_LIMIT = 2**31 - 1
SEED_LIMIT = 2**63 - 1
MAX_IMG_SIZE = 4096
# A config (or an override value) that expands past this many values, or nests deeper, is refused: YAML
# anchors and aliases can make a 1 KB file expand to billions of values (an "alias bomb").
MAX_CONFIG_VALUES = 10_000
MAX_CONFIG_DEPTH = 32


@dataclass
class DataConfig:
    root: Optional[str] = field(default=None, metadata=FREE)
    train_split: str = "train"
    val_split: str = "val"
    builtin: Optional[Literal["digits"]] = None
    img_size: int = field(default=224, metadata=_range(8, MAX_IMG_SIZE))
    crop_pct: float = field(default=0.875, metadata=_range(0.1, 1.0))
    interpolation: Literal["bilinear", "bicubic", "nearest"] = "bilinear"
    scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    ratio: list[float] = field(default_factory=lambda: [3 / 4, 4 / 3])
    hflip: float = field(default=0.5, metadata=_range(0.0, 1.0))
    color_jitter: float = field(default=0.0, metadata=_range(0.0, 1.0))
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])
    sampler: Literal["random", "weighted", "sequential"] = "random"
    num_workers: int = field(default=2, metadata=_range(0, 256, resume_free=True))
    pin_memory: Optional[bool] = field(default=None, metadata=FREE)
    persistent_workers: bool = field(default=True, metadata=FREE)
    prefetch_factor: int = field(default=4, metadata=_range(1, 1024, resume_free=True))
    max_bad_fraction: float = field(default=0.01, metadata=_range(0.0, 1.0, resume_free=True))
    limit_train_batches: Optional[int] = field(default=None, metadata=_range(1))
    limit_val_batches: Optional[int] = field(default=None, metadata=_range(1, resume_free=True))
    auto_augment: Optional[Literal["randaugment", "trivialaugment", "autoaugment", "augmix"]] = None
    auto_augment_magnitude: int = field(default=9, metadata=_range(0, RANDAUGMENT_MAX_MAGNITUDE))
    auto_augment_ops: int = field(default=2, metadata=_range(1))
    repeated_augment: int = field(default=1, metadata=_range(1))
    eval_img_size: Optional[int] = field(default=None, metadata=_range(8))
    random_erasing: float = field(default=0.0, metadata=_range(0.0, 1.0))
    format: Literal["folder", "csv", "webdataset"] = "folder"
    val_fraction: Optional[float] = field(default=None, metadata=_range(0.0, 1.0, lo_open=True, hi_open=True))
    split_seed: int = 0
    # Paths may move on --resume; the checkpoint's record of the lists' contents decides whether they changed.
    train_csv: Optional[str] = field(default=None, metadata=FREE)
    val_csv: Optional[str] = field(default=None, metadata=FREE)
    csv_path_column: str = "path"
    csv_label_column: str = "label"
    classes: Optional[str] = field(default=None, metadata=FREE)
    # Shard locations may move on --resume (the checkpoint records the shard names and the sample count).
    train_shards: Union[str, list[str], None] = field(default=None, metadata=FREE)
    val_shards: Union[str, list[str], None] = field(default=None, metadata=FREE)
    shuffle_buffer: int = field(default=1000, metadata=_range(0))
    train_samples: Optional[int] = field(default=None, metadata=_range(1))
    task: str = "multiclass"  # a task registered in tasks/ (checked there)
    label_delimiter: str = " "


@dataclass
class ModelConfig:
    name: str = "resnet50"
    weights: Optional[str] = None
    norm: Literal["batch", "group"] = "batch"
    group_norm_groups: int = field(default=32, metadata=_range(1))
    sync_bn: bool = False
    drop_rate: float = field(default=0.0, metadata=_range(0.0, 1.0))
    drop_path_rate: float = field(default=0.0, metadata=_range(0.0, 1.0))
    ema_decay: Optional[float] = field(default=None, metadata=_range(0.0, 1.0, lo_open=True))
    ema_every_steps: int = field(default=1, metadata=_range(1))
    ema_warmup: bool = False
    pretrained: bool = False
    freeze: Optional[Literal["backbone"]] = None
    unfreeze_epoch: Optional[int] = field(default=None, metadata=_range(1))
    # not resume-free: with BatchNorm in training mode the recomputed forward updates the statistics again
    grad_checkpointing: bool = False


@dataclass
class TrainConfig:
    epochs: int = field(default=90, metadata=_range(1))
    batch_size: Union[int, Literal["auto"]] = 128
    accum_steps: int = field(default=1, metadata=_range(1))
    amp: Literal["none", "fp16", "bf16", "auto"] = "auto"
    label_smoothing: float = field(default=0.0, metadata=_range(0.0, 1.0))
    clip_grad_norm: Optional[float] = field(default=None, metadata=_range(0.0, lo_open=True))
    seed: int = field(default=0, metadata=_range(0, SEED_LIMIT))
    channels_last: bool = True
    compile: bool = field(default=False, metadata=FREE)
    device: str = field(default="auto", metadata=FREE)
    nonfinite: Literal["stop", "skip"] = field(default="stop", metadata=FREE)
    max_nonfinite_in_row: int = field(default=10, metadata=_range(1, resume_free=True))
    memory_budget_gb: Optional[float] = field(default=None, metadata=_range(0.0, lo_open=True, resume_free=True))
    target_effective_batch: Optional[int] = field(default=None, metadata=_range(1))
    threads: Union[int, Literal["auto", "idle_cores"]] = field(default="auto", metadata=_range(1, resume_free=True))
    reuse_host_memory: bool = field(default=True, metadata=FREE)
    val_interval: int = field(default=1, metadata=_range(1, resume_free=True))
    mixup_alpha: float = field(default=0.0, metadata=_range(0.0))
    cutmix_alpha: float = field(default=0.0, metadata=_range(0.0))
    mix_prob: float = field(default=1.0, metadata=_range(0.0, 1.0))
    mix_switch_prob: float = field(default=0.5, metadata=_range(0.0, 1.0))
    mix_off_epoch: Optional[int] = field(default=None, metadata=_range(1))
    loss: Literal["ce", "bce", "asl"] = "ce"
    bce_target_thresh: Optional[float] = field(default=None, metadata=_range(0.0, 1.0))
    asl_gamma_neg: float = field(default=4.0, metadata=_range(0.0, 100.0))
    asl_gamma_pos: float = field(default=0.0, metadata=_range(0.0, 100.0))
    asl_clip: float = field(default=0.05, metadata=_range(0.0, 1.0))


@dataclass
class OptimConfig:
    name: Literal["sgd", "adamw", "lamb", "lars", "lion", "rmsprop"] = "sgd"
    lr: float = field(default=0.1, metadata=_range(0.0, 1e6, lo_open=True))
    lr_scaling: Literal["linear", "sqrt", "none"] = "linear"
    base_batch_size: int = field(default=256, metadata=_range(1))
    momentum: float = field(default=0.9, metadata=_range(0.0, 1.0))
    nesterov: bool = True
    weight_decay: float = field(default=5e-5, metadata=_range(0.0, 1.0))
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = field(default=1e-8, metadata=_range(0.0, 1.0, lo_open=True))
    layer_decay: Optional[float] = field(default=None, metadata=_range(0.0, 1.0, lo_open=True))
    head_lr_scale: float = field(default=1.0, metadata=_range(0.0, 1e6, lo_open=True))


@dataclass
class ScheduleConfig:
    warmup_epochs: float = field(default=5.0, metadata=_range(0.0, 1e6))
    warmup_start_factor: float = field(default=0.0, metadata=_range(0.0, 1.0))
    min_lr: float = field(default=0.0, metadata=_range(0.0))
    name: Literal["cosine", "step", "multistep", "poly", "constant", "plateau"] = "cosine"
    milestones: list[float] = field(default_factory=lambda: [30.0, 60.0, 80.0])
    gamma: float = field(default=0.1, metadata=_range(0.0, 1.0, lo_open=True))
    step_epochs: float = field(default=30.0, metadata=_range(0.0, lo_open=True))
    power: float = field(default=1.0, metadata=_range(0.0, lo_open=True))
    plateau_patience: int = field(default=10, metadata=_range(1))


@dataclass
class EarlyStopConfig:
    metric: str = "top1"  # a metric the task declares selectable (tasks/); checked by its Task
    patience: Optional[int] = field(default=None, metadata=_range(1, resume_free=True))
    min_delta: float = field(default=0.0, metadata=_range(0.0, resume_free=True))


@dataclass
class CheckpointConfig:
    every_steps: int = field(default=0, metadata=_range(0, resume_free=True))


@dataclass
class OutputConfig:
    dir: str = field(default="runs/default", metadata=FREE)
    log_interval: int = field(default=50, metadata=_range(1, resume_free=True))
    tensorboard: bool = field(default=True, metadata=FREE)
    progress_bar: Union[bool, Literal["auto"]] = field(default="auto", metadata=FREE)
    overwrite: bool = field(default=False, metadata=FREE)
    # curves.png in the run directory at every epoch end: loss, LR and validation metrics per epoch
    curves: bool = field(default=True, metadata=FREE)


@dataclass
class CalibrationConfig:
    # auto: fit one temperature on the validation split after training; none: plain softmax; a number: that T
    temperature: Union[float, Literal["auto", "none"]] = field(default="auto", metadata=_range(
        MIN_TEMPERATURE, MAX_TEMPERATURE, resume_free=True))
    coverage: float = field(default=0.95, metadata=_range(0.0, 1.0, lo_open=True, resume_free=True))


@dataclass
class DistillConfig:
    """Knowledge distillation from a frozen teacher (objectives/distillation). Another setting is another training, so
    --resume refuses it; the teacher is compared by its identity (file or weight digest, recorded in last.pt),
    not its path, so a moved copy of the same teacher resumes."""
    # our checkpoint (best.pt), a timm folder (local-dir:PATH or a folder path), or a timm / hf-hub: model name
    teacher: Optional[str] = field(default=None, metadata=FREE)
    type: Literal["soft", "hard", "feature"] = "soft"
    # below 0.05 the softened logits overflow (1e-300: inf, a non-finite first step); the soft term is stable above
    temperature: float = field(default=4.0, metadata=_range(0.05, 100.0))
    alpha: float = field(default=0.5, metadata=_range(0.0, 1.0))
    feature_loss: Literal["cosine", "mse"] = "cosine"


@dataclass
class AuditConfig:
    """audit.py's knobs (never read by training; free to change on --resume)."""
    folds: int = field(default=4, metadata=_range(0, 100, resume_free=True))
    fold_epochs: Optional[int] = field(default=None, metadata=_range(1, resume_free=True))
    near_threshold: int = field(default=6, metadata=_range(0, 64, resume_free=True))
    # a pHash candidate is a copy when its 32x32 thumbnails' aligned NCC reaches this (null: pHash alone)
    pixel_threshold: Optional[float] = field(default=0.99, metadata=_range(-1.0, 1.0, resume_free=True))
    min_class_images: int = field(default=20, metadata=_range(0, resume_free=True))
    drop_label_issues: int = field(default=0, metadata=_range(0, resume_free=True))
    seed: int = field(default=0, metadata=_range(0, SEED_LIMIT, resume_free=True))


@dataclass
class TrackingConfig:
    """Experiment tracking (tracking/): where a run's parameters, curves and files are also logged."""
    backend: Literal["none", "mlflow"] = field(default="none", metadata=FREE)
    uri: Optional[str] = field(default=None, metadata=FREE)  # null: MLflow's own (MLFLOW_TRACKING_URI, else local)
    experiment: Optional[str] = field(default=None, metadata=FREE)  # null: the config's name
    run_name: Optional[str] = field(default=None, metadata=FREE)  # null: output.dir's name
    log_checkpoints: Union[bool, Literal["best"]] = field(default=False, metadata=FREE)


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self):
        # Dotted keys that a config file or an override set (not base.yaml, which only restates the
        # defaults): defaults that depend on something else (the pretrained model's preprocessing) leave
        # these alone. Not a config key; never saved.
        self.explicit_keys: set[str] = set()
        # the --config name it was loaded from (the tracking experiment's default); not a key, never saved
        self.source_name: Optional[str] = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- loading


def available_configs() -> list[str]:
    """The config names in configs/ (what `--config NAME` takes besides a path)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def resolve_config_path(name: str) -> Path:
    """`resnet50`, `resnet50.yaml` or a path to a YAML file."""
    candidates = [Path(name)]
    if not name.endswith((".yaml", ".yml")):
        candidates.append(CONFIG_DIR / f"{name}.yaml")
    candidates.append(CONFIG_DIR / name)
    for path in candidates:
        if path.is_file():
            return path
    problem = not_a_regular_file(name)
    if problem and problem != "no such file":  # it exists, as something a config cannot be read from
        raise ConfigError(f"config '{name}': {problem}; it must name a regular YAML file")
    known = available_configs()
    hint = _did_you_mean(Path(name).stem, known)
    raise ConfigError(f"config '{name}' not found (a YAML path or one of: {', '.join(known)}){hint}")


def read_yaml(path: Path) -> dict:
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err}") from err
    try:
        loaded = yaml.safe_load(text)
    except yaml.constructor.ConstructorError as err:
        raise ConfigError(f"config file {path} is not plain YAML (tags and Python objects are refused): {err}") from err
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from err
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    check_expanded_size(loaded, f"config file {path}")
    return loaded


def check_expanded_size(value: Any, source: str) -> None:
    """ConfigError when `value` (as YAML loaded it, aliases shared) expands to more than MAX_CONFIG_VALUES
    values or nests deeper than MAX_CONFIG_DEPTH; a self-referencing alias nests without end."""
    count, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        count += 1
        if count > MAX_CONFIG_VALUES or depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"{source}: refused, it expands to more than {MAX_CONFIG_VALUES} values or nests "
                              f"deeper than {MAX_CONFIG_DEPTH} levels (YAML anchors and aliases that repeat "
                              f"each other?); a config has about a hundred keys")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, depth + 1) for v in item)


# keys whose override value is taken as written (unless quoted): YAML reads ',' as an error and '|' as an
# empty block scalar, though both are delimiters people use
LITERAL_STRING_KEYS = ("data.label_delimiter",)


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like KEY=VALUE (for example train.epochs=3)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if key in LITERAL_STRING_KEYS and raw and not (len(raw) > 1 and raw[0] == raw[-1] and raw[0] in "'\""):
        return key, raw
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {key}: value '{raw}' is not valid YAML: {err}") from err
    check_expanded_size(value, f"override {key}")
    return key, value


def nest(key: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def load_config(name: Optional[str], overrides: list[str] = ()) -> Config:
    """Defaults, then the YAML file, then the dotted overrides; validated."""
    cfg = Config()
    if name:
        path = resolve_config_path(name)
        keys = apply_dict(cfg, read_yaml(path), source=str(name))
        if path.resolve() != (CONFIG_DIR / "base.yaml").resolve():
            cfg.explicit_keys |= keys
        cfg.source_name = path.stem
    apply_overrides(cfg, overrides)
    validate(cfg)
    return cfg


def apply_overrides(cfg: Config, overrides: list[str]) -> None:
    """Dotted KEY=VALUE overrides (values parsed as YAML) on top of `cfg`; the caller validates."""
    for text in overrides:
        key, value = parse_override(text)
        cfg.explicit_keys |= apply_dict(cfg, nest(key, value), source="command line")


def config_from_dict(values: dict) -> Config:
    cfg = Config()
    apply_dict(cfg, values, source="checkpoint")
    validate(cfg)
    return cfg


def all_keys(obj=None, prefix="") -> list[str]:
    obj = obj if obj is not None else Config()
    keys = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys.extend(all_keys(value, f"{prefix}{f.name}."))
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else ""


def apply_dict(obj, values: dict, source: str, prefix: str = "") -> set[str]:
    """Set `values` (nested like the YAML) on `obj`; returns the dotted keys set."""
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: '{prefix.rstrip('.')}' must be a mapping of keys")
    names = {f.name: f for f in dataclasses.fields(obj)}
    hints = typing.get_type_hints(type(obj))
    keys = set()
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            hint = _did_you_mean(dotted, all_keys())
            raise ConfigError(f"{source}: unknown config key '{dotted}'{hint}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            keys |= apply_dict(current, value, source, prefix=f"{dotted}.")
        else:
            setattr(obj, key, _coerce(dotted, value, hints[key], source))
            keys.add(dotted)
    return keys


def fill_unset(cfg: Config, values: dict, origin: str) -> list[str]:
    """Set each dotted key of `values` that the user did not set (`cfg.explicit_keys`), validated; returns
    one line per key saying which value is used and where it came from."""
    lines = []
    for key, value in values.items():
        section, name = key.rsplit(".", 1)
        current = getattr(getattr(cfg, section), name)
        if key in cfg.explicit_keys:
            lines.append(f"{key} = {current!r} (set in the config; {origin} has {value!r})")
        else:
            apply_dict(cfg, nest(key, value), source=origin)
            lines.append(f"{key} = {getattr(getattr(cfg, section), name)!r} (from {origin})")
    validate(cfg)
    return lines


# ---------------------------------------------------------------- types


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin is Union:
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp, source: str) -> Any:
    ok, out = _try_coerce(value, tp)
    if not ok and isinstance(value, str) and _NON_FINITE.match(value.strip()) and _accepts_float(tp):
        raise ConfigError(f"{source}: '{key}' = {value!r} is not allowed: NaN and infinity are refused; it must be "
                          f"a finite number")
    if not ok:
        raise ConfigError(f"{source}: '{key}' = {value!r} is not allowed; expected {_describe(tp)}")
    return out


# what a user means by NaN or infinity when YAML reads it as a string (YAML's own `.nan` and `.inf` are floats)
_NON_FINITE = re.compile(r"^[-+]?(nan|inf|infinity)$", re.IGNORECASE)


def _accepts_float(tp) -> bool:
    return tp is float or any(_accepts_float(a) for a in typing.get_args(tp))


_EXPONENT_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _try_coerce(value: Any, tp) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if origin is Union:
        for arg in typing.get_args(tp):
            ok, out = _try_coerce(value, arg)
            if ok:
                return True, out
        return False, None
    if origin is Literal:
        return (value in typing.get_args(tp) and not isinstance(value, bool)), value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            return False, None
        items = [_try_coerce(v, typing.get_args(tp)[0]) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if tp is type(None):
        return value is None, None
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, str) and _EXPONENT_FLOAT.match(value.strip()):
            value = float(value)  # PyYAML (YAML 1.1) reads 1e-3 (no dot) as a string
        return isinstance(value, (int, float)) and not isinstance(value, bool), float(value) if isinstance(value, (int, float)) else None
    if tp is str:
        return isinstance(value, str), value
    return False, None


# ---------------------------------------------------------------- validation


def _check_ranges(obj, prefix="") -> None:
    """Every number finite (NaN passes no `<` test, so it is refused here by name), and within its field's
    range; ints without a stated upper end below INT_LIMIT."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_ranges(value, f"{key}.")
            continue
        if isinstance(value, list):
            if any(isinstance(v, float) and not math.isfinite(v) for v in value):
                raise ConfigError(f"'{key}' = {value}: every value must be a finite number")
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"'{key}' = {value} is not allowed; it must be a finite number")
        lo, hi = f.metadata.get("min"), f.metadata.get("max")
        lo_open, hi_open = f.metadata.get("lo_open", False), f.metadata.get("hi_open", False)
        if hi is None and isinstance(value, int):
            hi = INT_LIMIT
        below = lo is not None and (value < lo or (lo_open and value == lo))
        above = hi is not None and (value > hi or (hi_open and value == hi))
        if below or above:
            low = f"{'>' if lo_open else '>='} {lo}" if lo is not None else ""
            high = f"{'<' if hi_open else '<='} {hi}" if hi is not None else ""
            raise ConfigError(f"'{key}' = {value} is out of range; it must be " + " and ".join(x for x in (low, high) if x))


def validate(cfg: Config) -> None:
    _check_ranges(cfg)
    d = cfg.data
    for key, pair in (("data.scale", d.scale), ("data.ratio", d.ratio)):
        if len(pair) != 2 or not (0 < pair[0] <= pair[1]):
            raise ConfigError(f"'{key}' = {pair} must be two numbers [low, high] with 0 < low <= high")
    if d.scale[1] > 1.0:
        raise ConfigError(f"'data.scale' = {d.scale}: the high end must be <= 1.0 (a fraction of the image area)")
    if not (0.01 <= d.ratio[0] and d.ratio[1] <= 100):
        raise ConfigError(f"'data.ratio' = {d.ratio}: aspect ratios must lie within [0.01, 100]")
    for key, triple in (("data.mean", d.mean), ("data.std", d.std)):
        if len(triple) != 3:
            raise ConfigError(f"'{key}' must hold 3 numbers (R, G, B), got {triple}")
    if not all(0 <= m <= 1 for m in d.mean):
        raise ConfigError(f"'data.mean' = {d.mean}: every value must be within [0, 1] (pixels are scaled to [0, 1])")
    if not all(0.001 <= s <= 1 for s in d.std):
        raise ConfigError(f"'data.std' = {d.std}: every value must be within [0.001, 1] (pixels are scaled to [0, 1])")
    if len(cfg.optim.betas) != 2 or not all(0 <= b < 1 for b in cfg.optim.betas):
        raise ConfigError(f"'optim.betas' = {cfg.optim.betas} must be two numbers in [0, 1)")
    if isinstance(cfg.train.batch_size, int) and cfg.train.batch_size < 1:
        raise ConfigError(f"'train.batch_size' = {cfg.train.batch_size} must be >= 1 or 'auto'")
    if d.repeated_augment > 1 and d.sampler != "random":
        raise ConfigError(f"'data.repeated_augment' = {d.repeated_augment} needs 'data.sampler' = random (it is "
                          f"{d.sampler}): repeats are drawn from a shuffled epoch; set data.repeated_augment=1 "
                          f"for the {d.sampler} sampler")
    m = cfg.model
    if m.unfreeze_epoch is not None and m.freeze is None:
        raise ConfigError(f"'model.unfreeze_epoch' = {m.unfreeze_epoch} needs 'model.freeze' = backbone "
                          "(the backbone is not frozen otherwise); set model.freeze=backbone or model.unfreeze_epoch=null")
    if m.pretrained and m.weights:
        raise ConfigError("'model.pretrained' = true and 'model.weights' are both set: use one source of weights "
                          "(model.pretrained=false with model.weights=FILE, or model.weights=null)")
    if cfg.model.norm == "group" and cfg.model.sync_bn:
        raise ConfigError("'model.sync_bn' = true has no effect with 'model.norm' = group; set one of them")
    if cfg.audit.folds == 1:
        raise ConfigError("'audit.folds' = 1: cross-validation needs at least 2 folds (each image is predicted by a "
                          "model trained on the others); use 2 or more, or 0 to skip the label-issue search")
    if cfg.distill.teacher is not None and not cfg.distill.teacher.strip():
        raise ConfigError("'distill.teacher' = '': name a teacher (a best.pt, a timm folder or local-dir:PATH, a timm "
                          "model name) or null to train without distillation")
    _check_optimizer_options(cfg.optim)
    _check_task(cfg)
    _check_recipe(cfg)
    _check_data_source(d)
    check_tracking(cfg.tracking)


# The optim.* options each optimizer takes besides lr and weight_decay (training/optim.py passes exactly these).
OPTIMIZER_OPTIONS = {
    "sgd": ("momentum", "nesterov"),
    "adamw": ("betas", "eps"),
    "lamb": ("betas", "eps"),
    "lars": ("momentum", "nesterov", "eps"),
    "lion": ("betas",),
    "rmsprop": ("momentum", "eps"),
}

# torch's fused (one kernel for every tensor) implementations: the same update rule, on the CPU several times
# cheaper per step than the per-tensor loop torch defaults to there (docs/performance.md)
FUSED_OPTIMIZERS = ("sgd", "adamw")


def _check_optimizer_options(o: OptimConfig) -> None:
    """An option set away from its default that `optim.name` does not take is a mistake, not a no-op."""
    defaults, taken = OptimConfig(), OPTIMIZER_OPTIONS[o.name]
    for option in ("momentum", "nesterov", "betas", "eps"):
        if option not in taken and getattr(o, option) != getattr(defaults, option):
            raise ConfigError(f"'optim.{option}' = {getattr(o, option)!r}: optim.name={o.name} does not take it "
                              f"({o.name} takes {', '.join(('lr', 'weight_decay') + taken)}); remove it or choose "
                              f"an optimizer that uses it")


def _check_recipe(cfg: Config) -> None:
    """Combinations of the schedule, loss and EMA keys that cannot do what they say."""
    s, t, m = cfg.schedule, cfg.train, cfg.model
    if s.name == "multistep":
        if not s.milestones or s.milestones[0] <= 0 or any(b <= a for a, b in zip(s.milestones, s.milestones[1:])):
            raise ConfigError(f"'schedule.milestones' = {s.milestones}: schedule.name=multistep needs a non-empty, "
                              f"strictly increasing list of epochs > 0 (fractions allowed), e.g. [30, 60, 80]")
    patience = cfg.early_stop.patience
    if s.name == "plateau" and patience is not None and patience <= s.plateau_patience:
        raise ConfigError(f"'early_stop.patience' = {patience} with 'schedule.plateau_patience' = "
                          f"{s.plateau_patience}: early stopping would end the run before the plateau schedule "
                          f"ever lowers the LR; make early_stop.patience larger than schedule.plateau_patience")
    if t.bce_target_thresh is not None and t.loss != "bce":
        raise ConfigError(f"'train.bce_target_thresh' = {t.bce_target_thresh} applies to train.loss=bce only "
                          f"(train.loss is {t.loss}); set train.loss=bce or remove it")
    if m.ema_decay is None and (m.ema_every_steps != 1 or m.ema_warmup):
        key = "model.ema_every_steps" if m.ema_every_steps != 1 else "model.ema_warmup"
        raise ConfigError(f"'{key}' needs the weight EMA on: set model.ema_decay (e.g. 0.9998)")


def _check_task(cfg: Config) -> None:
    """`data.task`: its Task refuses what cannot mean anything for it and fills its own defaults."""
    from tasks import check_config

    check_config(cfg, getattr(cfg, "explicit_keys", set()))


# tracking.uri schemes MLflow serves (a plain path is a local store); anything else is refused before any work
TRACKING_URI_SCHEMES = ("file", "sqlite", "http", "https", "postgresql", "mysql", "mssql")
TRACKING_NAME_MAX = 250  # MLflow's limit on experiment and run names


def check_tracking(t: TrackingConfig) -> None:
    """tracking.*: a URI MLflow can use (a known scheme, a host for http(s), no credentials in it: those go in
    MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN), printable names."""
    if t.log_checkpoints is True:
        raise ConfigError("'tracking.log_checkpoints' = true: allowed are false or best (log best.pt at the end)")
    for key, value in (("tracking.uri", t.uri), ("tracking.experiment", t.experiment),
                       ("tracking.run_name", t.run_name)):
        if value is not None and (not value.strip() or not value.isprintable() or len(value) > 2000):
            raise ConfigError(f"'{key}' = {value!r}: must be non-empty printable text (no control characters)")
    for key, value in (("tracking.experiment", t.experiment), ("tracking.run_name", t.run_name)):
        if value is not None and len(value) > TRACKING_NAME_MAX:
            raise ConfigError(f"'{key}' is {len(value)} characters long; MLflow takes at most {TRACKING_NAME_MAX}")
    if t.uri is not None:
        problem = tracking_uri_problem(t.uri)
        if problem:
            raise ConfigError(f"'tracking.uri' = {t.uri!r}: {problem}; allowed: null (MLflow's own: "
                              f"MLFLOW_TRACKING_URI, else a local store), a folder, sqlite:///FILE.db, "
                              f"http(s)://HOST:PORT, or {', '.join(TRACKING_URI_SCHEMES[4:])}://...")


def tracking_client_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("mlflow") is not None


def check_tracking_client(t: TrackingConfig) -> None:
    """A job that logs (train.py, tune.py) needs the client installed; eval.py and infer.py of a tracked
    run's checkpoint do not."""
    if t.backend == "mlflow" and not tracking_client_installed():
        raise ConfigError("'tracking.backend' = mlflow needs the MLflow client: pip install mlflow-skinny (a "
                          "tracking server) or pip install mlflow (also the local SQLite store and mlflow ui)")


def tracking_uri_problem(uri: str) -> Optional[str]:
    """What is wrong with a tracking URI (None: nothing). A string without `scheme:` is a folder."""
    from urllib.parse import urlsplit

    if any(c.isspace() for c in uri):
        return "it contains white space"
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):", uri)
    if match is None or re.match(r"^[A-Za-z]:[\\/]", uri):  # no scheme, or a Windows drive letter
        return None
    scheme = match.group(1).lower()
    if scheme not in TRACKING_URI_SCHEMES:
        return f"unknown scheme '{scheme}'"
    try:
        parts = urlsplit(uri)
        port = parts.port
    except ValueError as err:
        return f"malformed ({err})"
    if parts.username is not None or parts.password is not None:
        return ("it holds credentials, which would be saved in config.yaml and the checkpoints; put them in "
                "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) instead")
    if scheme in ("http", "https") and not parts.hostname:
        return "no host (http://HOST:PORT)"
    if scheme == "sqlite" and not uri.lower().startswith("sqlite:///"):
        return "a SQLite store is sqlite:///RELATIVE.db or sqlite:////ABSOLUTE.db"
    if port == 0:
        return "port 0"
    return None


def eval_size(data_cfg: DataConfig) -> int:
    """The evaluation input size: `data.eval_img_size`, or `data.img_size` when that is null."""
    return data_cfg.eval_img_size or data_cfg.img_size


def _check_data_source(d: DataConfig) -> None:
    """The keys of `data.format` that belong together."""
    if d.builtin and (d.val_fraction is not None or d.format != "folder"):
        raise ConfigError(f"'data.builtin' = {d.builtin} writes its own train/ and val/ folders: drop "
                          f"data.val_fraction and keep data.format=folder")
    if d.format == "csv":
        if not d.train_csv:
            raise ConfigError("'data.format' = csv needs 'data.train_csv' (a CSV file with a header and the columns "
                              f"'{d.csv_path_column}' and '{d.csv_label_column}')")
        if d.val_csv and d.val_fraction is not None:
            raise ConfigError("'data.val_csv' and 'data.val_fraction' are both set: validate on the CSV list or "
                              "hold out a fraction of data.train_csv, not both")
        if not d.val_csv and d.val_fraction is None:
            raise ConfigError("'data.format' = csv needs 'data.val_csv', or 'data.val_fraction' to hold out a "
                              "fraction of data.train_csv")
    elif d.train_csv or d.val_csv:
        raise ConfigError(f"'data.train_csv' / 'data.val_csv' are set but 'data.format' = {d.format}; "
                          f"set data.format=csv to train from CSV lists")
    if d.format == "webdataset":
        _check_shard_keys(d)
    elif d.train_shards or d.val_shards:
        raise ConfigError(f"'data.train_shards' / 'data.val_shards' are set but 'data.format' = {d.format}; "
                          f"set data.format=webdataset to train from shards")


def _check_shard_keys(d: DataConfig) -> None:
    missing = [f"data.{k}" for k in ("train_shards", "val_shards", "classes") if not getattr(d, k)]
    if missing:
        raise ConfigError(f"'data.format' = webdataset needs {', '.join(missing)} (shard patterns such as "
                          f"train-{{000000..000127}}.tar, and the class list, one name per line)")
    if d.val_fraction is not None:
        raise ConfigError("'data.val_fraction' does not apply to shards: write the validation samples as their "
                          "own shards (data.val_shards)")
    if d.sampler == "weighted":
        raise ConfigError("'data.sampler' = weighted needs random access to every sample; a shard stream reads "
                          "in sequence. Use data.sampler=random with data.format=webdataset, or write "
                          "class-balanced shards")
    if d.repeated_augment > 1:
        raise ConfigError(f"'data.repeated_augment' = {d.repeated_augment} needs random access to every sample; "
                          f"a shard stream reads each sample once per epoch. Use data.repeated_augment=1 with "
                          f"data.format=webdataset")


def check_data_root(cfg: Config) -> Optional[Path]:
    """The data root must exist (or be creatable from a built-in data set); the files the data keys name
    (CSV lists, the class list) must be regular files, whatever the format."""
    check_named_files(cfg.data)
    if cfg.data.format in ("csv", "webdataset"):
        return _check_csv_files(cfg.data)
    if not cfg.data.root:
        raise ConfigError("'data.root' is not set: pass data.root=/path/to/images (a folder with train/ and val/)")
    root = Path(cfg.data.root).expanduser()
    if cfg.data.builtin:
        return root
    if not root.is_dir():
        raise ConfigError(f"'data.root' = {cfg.data.root}: {not_a_folder(root)}")
    if cfg.data.val_fraction is not None:
        return root  # one class-folder tree, split by data.val_fraction
    for split in (cfg.data.train_split, cfg.data.val_split):
        if not (root / split).is_dir():
            raise ConfigError(f"'data.root' = {cfg.data.root}: missing split folder '{split}/' (data.train_split / data.val_split)")
    return root


def not_a_folder(path: Path) -> str:
    """What a path that should be a folder is: "no such folder", or "not a folder (a regular file)", ..."""
    problem = not_a_regular_file(path)
    if problem in ("no such file", "a broken link"):
        return "no such folder" if problem == "no such file" else "no such folder (a broken link)"
    return f"not a folder ({problem or 'a regular file'})"


def check_named_files(d: DataConfig) -> None:
    """Every file a data key names is a regular file (a FIFO would block the read for ever), or ConfigError
    saying what it is instead; shards are checked when they are read."""
    for key in ("train_csv", "val_csv", "classes"):
        value = getattr(d, key)
        problem = not_a_regular_file(value) if value else None
        if problem:
            raise ConfigError(f"'data.{key}' = {value}: {problem}; it must name a regular file")


def _check_csv_files(d: DataConfig) -> Optional[Path]:
    if d.root and not Path(d.root).expanduser().is_dir():
        meant = ("the CSV lists' relative paths resolve against it" if d.format == "csv" else
                 "relative shard patterns are read as given; data.root is not used by data.format=webdataset, "
                 "set it to null")
        raise ConfigError(f"'data.root' = {d.root}: {not_a_folder(Path(d.root).expanduser())} ({meant})")
    return Path(d.root).expanduser() if d.root else None


# ---------------------------------------------------------------- resume


def resume_free_keys(obj=None, prefix: str = "") -> set[str]:
    """Dotted keys whose field metadata says they may change between a run and its resume."""
    obj = obj if obj is not None else Config()
    keys = set()
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys |= resume_free_keys(value, f"{prefix}{f.name}.")
        elif f.metadata.get("resume_free"):
            keys.add(f"{prefix}{f.name}")
    return keys


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(saved: dict, current: dict) -> list[str]:
    """`key: old -> new` for every key that differs and is not resume-free (what --resume refuses). A key the
    saved config lacks (written before the key existed) counts as its default, which is what that run did."""
    free = resume_free_keys()
    a, b = {**flatten(Config().to_dict()), **flatten(saved)}, flatten(current)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if k not in free and a.get(k) != b.get(k)]


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
