"""The `calibration` section: the temperature fitted after training and the reject option's coverage."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from imgcls.core.settings import MAX_TEMPERATURE, MIN_TEMPERATURE, setting


@dataclass
class CalibrationConfig:
    temperature: Union[float, Literal["auto", "none"]] = setting(
        "auto", f"auto (fit one temperature on the validation split after training, stored in best.pt) | none "
                f"(plain softmax) | a number in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE:g}]",
        lo=MIN_TEMPERATURE, hi=MAX_TEMPERATURE, resume_free=True)
    coverage: float = setting(0.95, "reject option: the share of validation images whose score clears the stored "
                                    "threshold (0 < coverage <= 1)", lo=0.0, hi=1.0, lo_open=True, resume_free=True)
