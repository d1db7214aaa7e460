"""How a package declares its config section: a dataclass in its own torch-free `settings` module whose fields
are `setting(default, help, ...)`. The field carries everything said about the key: its default, the one-line
help that configs/base.yaml and the configuration reference print (config.py writes both), the
allowed range, and whether the key may change on --resume. A section class may define `check(self, cfg)`: its
own validation, which may read other sections; config.py composes the sections and runs the checks.

Settings modules import only the standard library, core and other settings modules (tests/config_cli/
test_layers.py), so loading and validating a config never imports torch.

The softmax temperature's allowed range, one rule for every place a temperature is set (the config key
calibration.temperature), fitted (evaluation.calibration) or read back (a checkpoint's or an
export's calibration record): a finite number in [MIN_TEMPERATURE, MAX_TEMPERATURE]. Outside it the
probabilities are useless (0, NaN, a tiny T: every image one label at prob nan or 1.0) or inverted
(a negative T reverses the ranking)."""
from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, Optional

from imgcls.core.errors import CheckpointError

# Bounds every key obeys besides its own range: floats are finite; ints without a stated upper end stay below
# INT_LIMIT (counts, sizes, intervals); seeds below 2^63 (what torch's generators take).
INT_LIMIT = 2**31 - 1


SEED_LIMIT = 2**63 - 1


def setting(default: Any, help: str, *, lo: Optional[float] = None, hi: Optional[float] = None,
            lo_open: bool = False, hi_open: bool = False, resume_free: bool = False,
            allowed: Optional[str] = None) -> Any:
    """A config key: `default` (a list or mapping is copied for each config), its one-line `help`, the allowed
    range [lo, hi] (`lo_open` / `hi_open`: that end excluded), and `resume_free`: the key may change on --resume
    (it does not change the math of the run: paths, workers, logging, checkpoint cadence, stopping policy).
    `allowed`: the values in words, for a key that a registry checks (the reference shows its type otherwise)."""
    if not help or "\n" in help:
        raise ValueError(f"a setting's help is one line of text, got {help!r}")
    metadata = {"help": help, "min": lo, "max": hi, "lo_open": lo_open, "hi_open": hi_open,
                "resume_free": resume_free, "allowed": allowed}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def section_help(cls) -> str:
    """The line base.yaml prints beside a section's name: the class's `HELP`, or nothing."""
    return getattr(cls, "HELP", "")


def range_text(metadata: dict) -> str:
    """A field's range in words (">= 1", "> 0.0 and <= 1.0"), or "" when it has none."""
    lo, hi = metadata.get("min"), metadata.get("max")
    low = f"{'>' if metadata.get('lo_open') else '>='} {lo}" if lo is not None else ""
    high = f"{'<' if metadata.get('hi_open') else '<='} {hi}" if hi is not None else ""
    return " and ".join(x for x in (low, high) if x)

MIN_TEMPERATURE, MAX_TEMPERATURE = 0.05, 20.0


def temperature_problem(value) -> Optional[str]:
    """None when `value` is a usable temperature, else what is wrong with it (for a message)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{value!r} is not a number"
    if not math.isfinite(value) or not MIN_TEMPERATURE <= value <= MAX_TEMPERATURE:
        return f"{value!r} is outside [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}] (a finite number)"
    return None


def reject_threshold_problem(value) -> Optional[str]:
    """None when `value` is a usable reject score threshold (a finite number), else what is wrong."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"{value!r} is not a finite number"
    return None


def check_calibration_record(record: Optional[dict], path) -> None:
    """A stored calibration record's numbers (CheckpointError, exit 2, naming the file): the temperature
    None or a finite number in core.settings's range, each reject threshold a finite number."""
    if not record:
        return
    t = record.get("temperature")
    if t is not None and temperature_problem(t):
        raise CheckpointError(f"{path}: the stored calibration temperature {temperature_problem(t)}; re-export "
                              f"the model from its checkpoint, or evaluate it again to refit the temperature")
    thresholds = record.get("thresholds") or {}
    if not isinstance(thresholds, dict):
        raise CheckpointError(f"{path}: the stored reject thresholds are not a mapping of score -> number")
    for method, value in thresholds.items():
        if reject_threshold_problem(value):
            raise CheckpointError(f"{path}: the stored reject threshold ({method}) {reject_threshold_problem(value)}")
