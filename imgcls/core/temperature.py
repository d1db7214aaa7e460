"""The softmax temperature's allowed range, one rule for every place a temperature is set (the config key
calibration.temperature), fitted (evaluation.calibration) or read back (a checkpoint's or an
export's calibration record): a finite number in [MIN_TEMPERATURE, MAX_TEMPERATURE]. Outside it the
probabilities are useless (0, NaN, a tiny T: every image one label at prob nan or 1.0) or inverted
(a negative T reverses the ranking)."""
from __future__ import annotations

import math
from typing import Optional

from imgcls.core.errors import CheckpointError

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
    None or a finite number in core.temperature's range, each reject threshold a finite number."""
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
