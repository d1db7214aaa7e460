"""The config tree, assembled here from the sections their owners declare (so core/ imports nothing above it):
YAML loading, dotted KEY=VALUE overrides, typed coercion and validation, and the config a --resume PATH
recorded.

Each section is declared once, beside the code that reads it, in a torch-free `settings` module (core/settings.py
says how): its keys with their defaults, one-line help, allowed values and ranges, and its own checks. Errors
raise `ConfigError`, which the commands turn into exit status 2 before any work starts. configs/base.yaml and
docs/configuration.md are written from those declarations, so a key is written once:

python -m imgcls.config --write   # rewrite both files
python -m imgcls.config --check   # exit 1 naming each file that differs from what --write would write

`train.py --resume PATH` without `--config`: the run's config as its checkpoint recorded it (resolved), with
the command line's KEY=VALUE overrides on top (the resume rules then refuse the keys a resume may not change)."""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import re
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from imgcls.auditing.settings import AuditConfig
from imgcls.core.errors import CheckpointError, ConfigError
from imgcls.core.files import not_a_regular_file, write_text_atomic
from imgcls.core.settings import INT_LIMIT, range_text, section_help
from imgcls.data.settings import DataConfig
from imgcls.evaluation.settings import CalibrationConfig
from imgcls.incremental.settings import IncrementalConfig
from imgcls.models.settings import ModelConfig
from imgcls.objectives.settings import DistillConfig, SemiConfig
from imgcls.tracking.settings import TrackingConfig
from imgcls.training.settings import (CheckpointConfig, EarlyStopConfig, OptimConfig, OutputConfig, ScheduleConfig,
                                      TrainConfig)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


# A config (or an override value) that expands past this many values, or nests deeper, is refused: YAML
# anchors and aliases can make a 1 KB file expand to billions of values (an "alias bomb").
MAX_CONFIG_VALUES = 10_000


MAX_CONFIG_DEPTH = 32


@dataclass
class Config:
    """The sections, in the order base.yaml lists them; a new section is its owner's settings class and a line
    here."""
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
    incremental: IncrementalConfig = field(default_factory=IncrementalConfig)
    semi: SemiConfig = field(default_factory=SemiConfig)
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
    if cfg.tracking.experiment is None and cfg.source_name:
        # resolved here, so config.yaml and the checkpoints keep it: a resumed run (which has no --config name)
        # that turns tracking on goes into the same experiment
        cfg.tracking.experiment = cfg.source_name
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
            hint = _did_you_mean(dotted, ([] if prefix else list(names)) + all_keys())
            where = f"section '{prefix.rstrip('.')}' has" if prefix else "the sections are"
            raise ConfigError(f"{source}: unknown config key '{dotted}'{hint} ({where}: {', '.join(names)})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            keys |= apply_dict(current, value, source, prefix=f"{dotted}.")
        elif typing.get_origin(hints[key]) is dict:
            # a mapping key (optim.options): a mapping merges into it (so optim.options.NAME=VALUE sets one
            # entry), null empties it
            merged = {} if value is None else {**current, **value} if isinstance(value, dict) else value
            setattr(obj, key, _coerce(dotted, merged, hints[key], source))
            keys.add(dotted)
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


def _describe(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin is Union:
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping of names to values (numbers, text, true / false, null or lists of them)"
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
    if origin is dict:
        ok = isinstance(value, dict) and all(isinstance(k, str) and _plain_value(v) for k, v in value.items())
        return ok, {k: _exponent_float(v) for k, v in value.items()} if ok else None
    if tp is type(None):
        return value is None, None
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        value = _exponent_float(value)
        return isinstance(value, (int, float)) and not isinstance(value, bool), float(value) if isinstance(value, (int, float)) else None
    if tp is str:
        return isinstance(value, str), value
    return False, None


def _exponent_float(value: Any) -> Any:
    """PyYAML (YAML 1.1) reads 1e-3 (no dot) as a string: such a string is the number."""
    if isinstance(value, str) and _EXPONENT_FLOAT.match(value.strip()):
        return float(value)
    if isinstance(value, list):
        return [_exponent_float(v) for v in value]
    return value


def _plain_value(value: Any) -> bool:
    """What a mapping key may hold: a YAML scalar or a list of them (a keyword argument's value)."""
    if isinstance(value, list):
        return all(_plain_value(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _check_ranges(obj, prefix="") -> None:
    """Every number finite (NaN passes no `<` test, so it is refused here by name), and within its field's
    range; ints without a stated upper end below INT_LIMIT."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_ranges(value, f"{key}.")
            continue
        if isinstance(value, (list, dict)):
            if not _all_finite(value):
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
            limits = range_text({**f.metadata, "max": hi})
            raise ConfigError(f"'{key}' = {value} is out of range; it must be {limits}")


def _all_finite(value) -> bool:
    if isinstance(value, dict):
        return all(_all_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_all_finite(v) for v in value)
    return not isinstance(value, float) or math.isfinite(value)


def validate(cfg: Config) -> None:
    """Ranges and types of every key, then each section's own checks (in the order of the sections), then the
    task's (tasks/: what `data.task` allows)."""
    _check_ranges(cfg)
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if hasattr(section, "check"):
            section.check(cfg)
    _check_task(cfg)


def _check_task(cfg: Config) -> None:
    """`data.task`: its Task refuses what cannot mean anything for it and fills its own defaults."""
    from imgcls.tasks import check_config

    check_config(cfg, getattr(cfg, "explicit_keys", set()))


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

REPO = CONFIG_DIR.parent.parent  # the checkout: docs/ beside imgcls/


BASE = CONFIG_DIR / "base.yaml"


PAGE = REPO / "docs" / "configuration.md"


COMMAND = "python -m imgcls.config --write"


HEADER = ("Every config key with its default and what it does. Other configs state only what differs from this file. "
          "Override any key on the command line by its dotted path: train.epochs=3.")


COMMENT_COLUMN = 28  # where base.yaml's comments start (one space later on a longer line)


def sections() -> list[tuple[str, type, object]]:
    """(name, settings class, its defaults) of each section, in Config's order."""
    cfg = Config()
    return [(f.name, type(getattr(cfg, f.name)), getattr(cfg, f.name)) for f in dataclasses.fields(cfg)]


def keys_of(cls, defaults) -> list[tuple[str, object, object, dict]]:
    """(name, default, type, field metadata) of each key of a section."""
    hints = typing.get_type_hints(cls)
    return [(f.name, getattr(defaults, f.name), hints[f.name], f.metadata) for f in dataclasses.fields(cls)]


def declared_in(cls, key: str) -> str:
    """The file of the settings class that declares `key` (a data source's keys: its own module)."""
    owner = next(c for c in cls.__mro__ if key in getattr(c, "__annotations__", {}))
    return f"{owner.__module__.replace('.', '/')}.py"


def show(value) -> str:
    """A default as YAML writes it on one line (null, true, [0.08, 1.0], ' ', ...)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("...").strip()


def allowed(tp, metadata: dict) -> str:
    """The values a key takes, from its type and range: "int >= 1", "none | fp16 | bf16", ..."""
    if metadata.get("allowed"):
        return metadata["allowed"]
    origin = typing.get_origin(tp)
    if origin is Union:
        return " or ".join(allowed(arg, metadata) for arg in typing.get_args(tp))
    if origin is Literal:
        return " | ".join(str(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {allowed(typing.get_args(tp)[0], {})}s"
    if origin is dict:
        return "mapping"
    names = {int: "int", float: "number", bool: "true / false", str: "text", type(None): "null"}
    limits = range_text(metadata) if tp in (int, float) else ""
    return f"{names.get(tp, getattr(tp, '__name__', str(tp)))} {limits}".strip()


def render_base_yaml() -> str:
    lines = [f"# {line}" for line in _wrap(HEADER, 110)]
    lines += [f"# Generated from the settings modules by `{COMMAND}`: edit a key's setting(...) there.", ""]
    for name, cls, defaults in sections():
        note = section_help(cls)
        lines.append(f"{name + ':':<{COMMENT_COLUMN - 1}} # {note}" if note else f"{name}:")
        for key, default, _, metadata in keys_of(cls, defaults):
            lines.append(f"{f'  {key}: {show(default)}':<{COMMENT_COLUMN - 1}} # {metadata['help']}")
        lines.append("")
    return "\n".join(lines)


def render_page() -> str:
    lines = ["# Configuration reference", "",
             f"<!-- generated by `{COMMAND}` from the settings modules: edit a key's setting(...) there, then "
             f"regenerate -->", "",
             f"Generated from the sections' declarations, as `configs/base.yaml` is. {HEADER} The value is parsed as "
             f"YAML (`data.scale=[0.5,1.0]`).", ""]
    for name, cls, defaults in sections():
        modules = dict.fromkeys(declared_in(cls, f.name) for f in dataclasses.fields(cls))
        lines += [f"## `{name}`", "", f"Declared in {', '.join(f'`{m}`' for m in modules)}.", ""]
        if section_help(cls):
            lines += [section_help(cls), ""]
        lines += ["| key | default | allowed | meaning |", "| --- | --- | --- | --- |"]
        for key, default, tp, metadata in keys_of(cls, defaults):
            lines.append(f"| `{name}.{key}` | `{show(default).replace('|', chr(92) + '|')}` | "
                         f"{cell(allowed(tp, metadata))} | {cell(metadata['help'])} |")
        lines.append("")
    return "\n".join(lines)


def cell(text: str) -> str:
    """Text shown as written inside a Markdown table cell: Markdown's emphasis, link and table characters
    escaped, angle brackets as entities (else `<train_split>` would be read as an HTML tag)."""
    for ch in "\\*_[]|":
        text = text.replace(ch, "\\" + ch)
    return text.replace("<", "&lt;").replace(">", "&gt;")


def _wrap(text: str, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return lines + [line]


def outputs() -> dict[Path, str]:
    return {BASE: render_base_yaml(), PAGE: render_page()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m imgcls.config", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite configs/base.yaml and docs/configuration.md")
    mode.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 when one differs")
    args = parser.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(path)
        else:
            write_text_atomic(text, path)
            print(f"wrote {path.relative_to(REPO)}")
    for path in stale:
        print(f"{path.relative_to(REPO)} is not what the settings modules give: run {COMMAND}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())

def config_from_checkpoint(path: str, overrides: list[str]) -> Config:
    """The resolved config that `path` (a last.pt) records, then `overrides`; validated. ConfigError (exit 2)
    when the file cannot be read or records no config."""
    from imgcls.core.safe_load import load_checkpoint  # imports torch: only on this path

    try:
        ckpt = load_checkpoint(path)
    except CheckpointError as err:
        raise ConfigError(f"--resume {path}: {err}") from err
    saved = ckpt.get("config")
    if not isinstance(saved, dict):
        raise ConfigError(f"--resume {path}: the checkpoint records no config to continue with; pass "
                          f"--config CONFIG and the run's overrides beside --resume")
    cfg = Config()
    apply_dict(cfg, saved, source=f"{path} (its recorded config)")
    apply_overrides(cfg, overrides)
    validate(cfg)
    return cfg
