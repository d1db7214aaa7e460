"""A validation metric, declared once: its name (the key in the metrics dict, summary.json `best`, eval.py's
JSON, `val/<name>` in TensorBoard, `val_<name>` in metrics.csv), which way is better, and how it prints.
Everything that lists, compares or prints metrics reads these declarations.

What a kind of label asks of the rest of the program. A `Task` is the one place that knows how its
targets are read and encoded, its loss, its metric sums and their reduction, which metrics exist and which
is best, how a validation prints, the prediction rows of infer.py and serve.py, and what a model file
carries for it. The rest of the code asks the task (`tasks.task_of(cfg)`), never `data.task`."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np

from imgcls.core.errors import ConfigError


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
# which the student and its teacher agree; objectives/incremental: top-1 on the old and on the new classes' images)
SHARED_METRICS = (Metric("teacher_agreement", selectable=False, in_best=False),
                  Metric("old_top1", selectable=False), Metric("new_top1", selectable=False))


def nonfinite_metrics(metrics: dict) -> list[str]:
    """The names of a validation's numbers that are NaN or infinite (a diverged model): such a validation is
    never the best, whatever its chosen metric says."""
    return [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]

if TYPE_CHECKING:  # the task registry loads without torch (config validation, --help)
    import torch


@dataclass
class Predictions:
    """A prediction pass's results by input order: what the task keeps of each row's probabilities
    (`Task.outputs`), which rows were readable, why the others were not."""

    kept: dict                           # name -> [N, ...] NumPy array; rows of unreadable files are undefined
    valid: "torch.Tensor"                # [N] bool (a tensor, or a NumPy array in the slim server)
    errors: dict = field(default_factory=dict)  # input index -> reason the file could not be read
    nonfinite: int = 0                   # readable inputs whose logits hold a NaN or an infinity

    def __getattr__(self, name: str):
        kept = self.__dict__.get("kept") or {}
        if name in kept:  # preds.top_probs, preds.probs, ...
            return kept[name]
        raise AttributeError(name)


class Task:
    name: str = ""                       # the data.task value
    title: str = ""                      # the kind of model in messages: single-label | multi-label
    explains_each_label: bool = False    # --explain draws one overlay per called label (named by it)
    label_format: str = ""               # how samples carry labels (data/labels.py): class | tags
    activation: str = ""                 # what turns its logits into probabilities: softmax | sigmoid
    metrics: tuple[Metric, ...] = ()     # every validation number, declared once (tasks/base.py)
    default_metric: str = ""             # early_stop.metric when left at another task's default
    # features this kind of label does not have, with what to say when one is asked for ("--reject", ...)
    unsupported: dict[str, str] = {}

    # ---------------------------------------------------------------- config

    def check_config(self, cfg, explicit: set[str]) -> None:
        """Refuse (ConfigError) what cannot mean anything for this task, by key; fill this task's defaults
        where a key was left at another task's. `explicit`: the keys the user set."""

    def check_supported(self, feature: str) -> None:
        """ConfigError naming `feature` (a flag or key) when this task does not have it."""
        if feature in self.unsupported:
            raise ConfigError(f"{feature}: {self.unsupported[feature]}")

    def explained_labels(self, row: dict) -> list[str]:
        """The class names --explain draws an overlay for in a classified row: the predicted class (the
        would-be label of a rejected image)."""
        return [row.get("predicted") or row["label"]]

    def supports(self, feature: str) -> bool:
        return feature not in self.unsupported

    # ---------------------------------------------------------------- metrics

    def metric(self, name: str) -> Metric:
        return next(m for m in self.metrics if m.name == name)

    def selectable_metrics(self) -> list[str]:
        return [m.name for m in self.metrics if m.selectable]

    def scalar_names(self) -> list[str]:
        """TensorBoard's val/<name> scalars: this task's metrics and the shared ones (when a room gives them)."""
        return [m.name for m in (*self.metrics, *SHARED_METRICS) if m.scalar]

    def model_file_extras(self, metrics: dict) -> dict:
        """What best.pt carries for this task beside `best` (multi-label: the tuned thresholds)."""
        return {}

    def new_sums(self, num_classes: int, device: torch.device, classes: list[str]):
        """The evaluation pass's record: `update(logits, targets, valid)`, `all_reduce()`, `compute()`."""
        raise NotImplementedError

    def merge_flip(self, logits: torch.Tensor, flipped: torch.Tensor) -> torch.Tensor:
        """Test-time augmentation: the logits of an image and its mirror image as one output."""
        raise NotImplementedError

    # ---------------------------------------------------------------- training

    def criterion(self, train_cfg) -> torch.nn.Module:
        raise NotImplementedError

    def startup_lines(self, cfg) -> list[str]:
        return []

    def startup_warnings(self, cfg) -> list[str]:
        """What the run's start warns of for this task's config."""
        return []

    def epoch_text(self, metrics: dict, top5_k: int) -> str:
        """A validation's numbers in the epoch line."""
        raise NotImplementedError

    # ---------------------------------------------------------------- prediction

    def prediction(self, logits: torch.Tensor) -> torch.Tensor:
        """Per image, what the model predicts: a row of the result that two models are compared on."""
        raise NotImplementedError

    def predicts_same(self, logits: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """Per image, whether two models' logits give the same prediction (a bool vector)."""
        return self.same_prediction(self.prediction(logits), self.prediction(other))

    @staticmethod
    def same_prediction(prediction: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """Per image, whether two `prediction` results are equal (a bool vector)."""
        return (prediction == other).reshape(len(prediction), -1).all(dim=1)

    def probabilities(self, logits: np.ndarray, temperature: Optional[float] = None) -> np.ndarray:
        """What infer.py reports as probabilities for `logits` ([N, C] NumPy, float32)."""
        raise NotImplementedError

    def outputs(self, logits: np.ndarray, topk: int, temperature: Optional[float] = None) -> dict:
        """What a row needs of a batch's logits [N, C] (NumPy, float32; the torch path hands them over once per
        batch): name -> [N, ...] array, kept until the pass ends (memory grows with the rows, and not with the
        classes where a task needs only a few per row). `temperature`: the stored calibration."""
        raise NotImplementedError

    def rows(self, names: list, preds: Predictions, classes: list[str], thresholds: Optional[list[float]],
             delimiter: str) -> list[dict]:
        """One row per input, in input order; an unreadable input gets `error` and no prediction."""
        raise NotImplementedError

    def format_rows(self, rows: list[dict], delimiter: str) -> str:
        """The rows as infer.py's table on stdout."""
        raise NotImplementedError

    # ---------------------------------------------------------------- eval.py

    def evaluation_figures(self, sums, classes: list[str], thresholds: Optional[list[float]]) -> tuple:
        """(metrics, per_class, confusion or None) of an evaluation pass's all-reduced sums; `thresholds`:
        what the model file records for this task (multi-label's tuned thresholds), else None."""
        raise NotImplementedError

    def eval_table(self, metrics: dict, per_class: dict, classes: list[str]) -> str:
        raise NotImplementedError

    def eval_document(self, metrics: dict, per_class: dict, confusion, classes: list[str], **extra) -> dict:
        """eval.py's JSON: the declared metrics first, `per_class`, then `extra`."""
        raise NotImplementedError

    def write_rows(self, rows: list[dict], path, classes: list[str], topk: int, delimiter: str,
                   extra: list[str] = ()) -> None:
        """infer.py's --output file: CSV, or JSON by the suffix."""
        raise NotImplementedError
