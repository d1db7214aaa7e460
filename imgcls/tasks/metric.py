"""A validation metric, declared once: its name (the key in the metrics dict, summary.json `best`, eval.py's
JSON, `val/<name>` in TensorBoard, `val_<name>` in metrics.csv), which way is better, and how it prints.
Everything that lists, compares or prints metrics reads these declarations."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    name: str
    higher_is_better: bool = True
    percent: bool = True        # a percentage, printed with 2 decimals; else a plain number with 4
    selectable: bool = True     # allowed as early_stop.metric (and so as the choice of best.pt)
    in_csv: bool = True         # a metrics.csv column val_<name>
    scalar: bool = True         # a TensorBoard scalar val/<name>
    in_best: bool = True        # kept in summary.json's and best.pt's `best`

    def format(self, value) -> str:
        if value is None:
            return "-"
        return f"{value:.2f}" if self.percent else f"{value:.4f}"

    def is_improvement(self, value: float, best: float | None, min_delta: float) -> bool:
        """A NaN or infinite value is never an improvement (NaN compares false, -inf would be a loss of all
        bests)."""
        if not math.isfinite(value):
            return False
        if best is None:
            return True
        return value > best + min_delta if self.higher_is_better else value < best - min_delta


# every task has these two: the mean loss over the samples, and how many samples were evaluated
LOSS = Metric("loss", higher_is_better=False, percent=False)
NUM_SAMPLES = Metric("num_samples", percent=False, selectable=False, scalar=False)


# metrics of any task, reported when a room provides them (objectives/distillation: the share of validation images on
# which the student and its teacher agree)
SHARED_METRICS = (Metric("teacher_agreement", selectable=False, in_best=False),)


def nonfinite_metrics(metrics: dict) -> list[str]:
    """The names of a validation's numbers that are NaN or infinite (a diverged model): such a validation is
    never the best, whatever its chosen metric says."""
    return [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
