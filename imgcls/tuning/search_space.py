"""The search space of `tune.py --search SPACE.yaml`: one entry per dotted config key, either `{low, high}` (with
optional `log: true` and `step`) or a list of choices. Checked like config overrides before any trial: every
key must exist, every choice and both ends of a range must give a valid config (ConfigError, exit 2, naming the
key). Nothing here imports optuna; `suggest` takes an Optuna trial."""
from __future__ import annotations

import json
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from imgcls.core.config import Config, all_keys, load_config, read_yaml, _did_you_mean
from imgcls.core.errors import ConfigError

RANGE_FIELDS = ("low", "high", "log", "step")
# keys a study sets itself: each trial trains into DIR/trials/<number>/
STUDY_OWNED_KEYS = {"output.dir": "each trial trains into DIR/trials/<number>/ of --study DIR"}
# what Optuna stores as a categorical choice as it is; other choices (lists) are stored as their JSON text
PLAIN_CHOICE_TYPES = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class Dimension:
    """One key of the space: `choices`, or the range [low, high] (`integer` for an int key)."""
    key: str
    choices: Optional[tuple] = None
    low: Optional[float] = None
    high: Optional[float] = None
    log: bool = False
    step: Optional[float] = None
    integer: bool = False

    def describe(self) -> str:
        if self.choices is not None:
            return f"{self.key} in {list(self.choices)}"
        extra = ", log" if self.log else (f", step {self.step}" if self.step else "")
        return f"{self.key} in [{self.low}, {self.high}{extra}]"


def override_text(key: str, value: Any) -> str:
    """A KEY=VALUE override that config loading reads back as `value` (JSON is YAML; floats keep every digit)."""
    return f"{key}={json.dumps(value)}"


def load_space(path: str, config: Optional[str], overrides: list[str]) -> list[Dimension]:
    """SPACE.yaml as dimensions, each checked against the config (`config` with `overrides`)."""
    source = f"--search {path}"
    if not Path(path).is_file():
        raise ConfigError(f"{source}: no such file (a YAML mapping of dotted config keys to {{low, high}} or a "
                          f"list of choices)")
    entries = read_yaml(Path(path))
    if not entries:
        raise ConfigError(f"{source}: the space is empty; give at least one key, e.g. "
                          f"optim.lr: {{low: 0.001, high: 1.0, log: true}}")
    known = all_keys()
    dims = []
    for key, entry in entries.items():
        key = str(key)
        if key not in known:
            raise ConfigError(f"{source}: unknown config key '{key}'{_did_you_mean(key, known)}")
        if key in STUDY_OWNED_KEYS:
            raise ConfigError(f"{source}: '{key}' cannot be searched: {STUDY_OWNED_KEYS[key]}")
        dim = _choices(key, entry, source) if isinstance(entry, list) else _range(key, entry, source)
        for value in (dim.choices if dim.choices is not None else (dim.low, dim.high)):
            _check_value(config, overrides, key, value, source)
        dims.append(dim)
    return dims


def _choices(key: str, entry: list, source: str) -> Dimension:
    if not entry:
        raise ConfigError(f"{source}: '{key}': the list of choices is empty")
    texts = [json.dumps(choice, sort_keys=True) for choice in entry]
    if len(set(texts)) != len(texts):
        raise ConfigError(f"{source}: '{key}': a choice is repeated in {entry}")
    return Dimension(key, choices=tuple(entry))


def _range(key: str, entry: Any, source: str) -> Dimension:
    if not isinstance(entry, dict):
        raise ConfigError(f"{source}: '{key}' = {entry!r}: give {{low, high}} (optional log: true, step) or a list "
                          f"of choices; a fixed value belongs in the config or a KEY=VALUE override")
    unknown = sorted(set(map(str, entry)) - set(RANGE_FIELDS))
    missing = [name for name in ("low", "high") if name not in entry]
    if unknown or missing:
        raise ConfigError(f"{source}: '{key}': {'unknown field(s) ' + ', '.join(unknown) if unknown else 'no ' + missing[0]}"
                          f"; a range takes {', '.join(RANGE_FIELDS)} (low and high required)")
    low, high, step, log = entry["low"], entry["high"], entry.get("step"), entry.get("log", False)
    for name, value in (("low", low), ("high", high), ("step", step)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise ConfigError(f"{source}: '{key}': {name} = {value!r} must be a finite number")
    if not isinstance(log, bool):
        raise ConfigError(f"{source}: '{key}': log = {log!r} must be true or false")
    integer = _key_kind(key, source) == "int"
    if integer and not all(isinstance(v, int) for v in (low, high, step) if v is not None):
        raise ConfigError(f"{source}: '{key}' takes whole numbers: low, high and step must be integers")
    if not low < high:
        raise ConfigError(f"{source}: '{key}': low {low} must be below high {high}")
    if log and low <= 0:
        raise ConfigError(f"{source}: '{key}': log: true needs low > 0 (it is {low})")
    if step is not None and (step <= 0 or (log and not integer)):
        raise ConfigError(f"{source}: '{key}': step = {step} must be > 0" + ("" if step <= 0 else
                          "; and a float range takes log or step, not both (Optuna's rule)"))
    if step is not None and not _is_multiple(high - low, step):
        raise ConfigError(f"{source}: '{key}': high - low = {high - low} is not a multiple of step {step}")
    return Dimension(key, low=low if integer else float(low), high=high if integer else float(high), log=log,
                     step=step, integer=integer)


def _is_multiple(span: float, step: float) -> bool:
    ratio = span / step
    return abs(ratio - round(ratio)) < 1e-9 * max(1.0, abs(ratio))


def _key_kind(key: str, source: str) -> str:
    """'float' or 'int': what a range of `key` draws; ConfigError for a key that takes no number."""
    section, name = key.rsplit(".", 1)
    tp = typing.get_type_hints(type(getattr(Config(), section)))[name]
    accepted = {arg for arg in (typing.get_args(tp) if typing.get_origin(tp) is typing.Union else (tp,))}
    if float in accepted:
        return "float"
    if int in accepted:
        return "int"
    raise ConfigError(f"{source}: '{key}' takes no number (it takes {tp}); give a list of choices instead")


def _check_value(config: Optional[str], overrides: list[str], key: str, value: Any, source: str) -> None:
    try:
        load_config(config, [*overrides, override_text(key, value)])
    except ConfigError as err:
        raise ConfigError(f"{source}: '{key}' = {value!r} gives no valid config: {err}") from None


def suggest(trial, dims: list[Dimension]) -> dict:
    """The trial's value of every key (Optuna's suggest_*; a resumed trial gets the values it drew before)."""
    values = {}
    for dim in dims:
        if dim.choices is not None:
            if all(isinstance(c, PLAIN_CHOICE_TYPES) for c in dim.choices):
                values[dim.key] = trial.suggest_categorical(dim.key, list(dim.choices))
            else:
                text = trial.suggest_categorical(dim.key, [json.dumps(c) for c in dim.choices])
                values[dim.key] = json.loads(text)
        elif dim.integer:
            values[dim.key] = trial.suggest_int(dim.key, dim.low, dim.high, step=dim.step or 1, log=dim.log)
        else:
            values[dim.key] = trial.suggest_float(dim.key, dim.low, dim.high, step=dim.step, log=dim.log)
    return values


def trial_values(params: dict, dims: list[Dimension]) -> dict:
    """A finished trial's stored params as config values (list choices are stored as their JSON text)."""
    values = {}
    for dim in dims:
        if dim.key in params:
            plain = dim.choices is None or all(isinstance(c, PLAIN_CHOICE_TYPES) for c in dim.choices)
            values[dim.key] = params[dim.key] if plain else json.loads(params[dim.key])
    return values


def space_record(dims: list[Dimension]) -> list[dict]:
    """The space as plain data (kept in the study: a re-run with another space is refused)."""
    return [{k: v for k, v in vars(d).items() if v is not None and v is not False} for d in dims]
