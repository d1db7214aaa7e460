"""One class per image (`data.task: multiclass`): a softmax over the classes, cross-entropy (or BCE on one-hot
targets), top-1 / top-5 / balanced accuracy, a calibrated probability and the reject option."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from imgcls.core.errors import ConfigError
from imgcls.tasks.base import LOSS, NUM_SAMPLES, Metric, Task

if TYPE_CHECKING:  # the task registry loads without torch (config validation, --help)
    import torch


class SingleLabel(Task):
    name = "multiclass"
    title = "single-label"
    label_format = "class"
    activation = "softmax"
    metrics = (Metric("top1"), Metric("top5"), LOSS, Metric("mean_class_acc"), NUM_SAMPLES)
    default_metric = "top1"
    unsupported = {"--threshold": "applies to a multi-label model (data.task=multilabel); this model gives one "
                                  "label per image"}

    def check_config(self, cfg, explicit: set[str]) -> None:
        if cfg.train.loss == "asl":
            raise ConfigError("'train.loss' = asl is the multi-label asymmetric loss; set data.task=multilabel "
                              "(with CSV or shard tags) or use train.loss=ce / bce")

    def new_sums(self, num_classes: int, device: torch.device, classes: list[str]):
        from imgcls.tasks.metrics import MetricSums

        return MetricSums(num_classes, device)

    def merge_flip(self, logits: torch.Tensor, flipped: torch.Tensor) -> torch.Tensor:
        import torch

        # log of the mean of the two probabilities, in log space so it never underflows to -inf
        return torch.logsumexp(torch.stack([logits.log_softmax(1), flipped.log_softmax(1)]), 0) - math.log(2)

    def criterion(self, train_cfg) -> torch.nn.Module:
        from imgcls.tasks.losses import build_criterion

        return build_criterion(train_cfg)

    def epoch_text(self, metrics: dict, top5_k: int) -> str:
        from imgcls.tasks.metrics import top5_label

        return (f"val top1 {metrics['top1']:.2f}  {top5_label(top5_k)} {metrics['top5']:.2f}  loss "
                f"{metrics['loss']:.4f}  mean class acc {metrics['mean_class_acc']:.2f}  "
                f"({metrics['num_samples']} samples)")

    def prediction(self, logits: torch.Tensor) -> torch.Tensor:
        """The top class (int32: a stored row per image costs 4 bytes)."""
        return logits.argmax(dim=1).int()

    def probabilities(self, logits, temperature=None):
        from imgcls.tasks.rows import softmax

        return softmax(logits, temperature)

    def outputs(self, logits, topk, temperature=None) -> dict:
        from imgcls.tasks.rows import label_outputs

        return label_outputs(logits, topk, temperature)

    def rows(self, names, preds, classes, thresholds, delimiter) -> list[dict]:
        from imgcls.tasks.rows import result_rows

        return result_rows(names, preds, classes)

    def format_rows(self, rows: list[dict], delimiter: str) -> str:
        from imgcls.tasks.rows import format_predictions_table

        return format_predictions_table(rows)

    def write_rows(self, rows, path, classes, topk, delimiter, extra=()) -> None:
        from imgcls.tasks.rows import write_rows

        write_rows(rows, path, min(topk, len(classes)), extra)

    def evaluation_figures(self, sums, classes, thresholds) -> tuple:
        from imgcls.tasks.metrics import per_class_report

        confusion = sums.confusion.cpu()
        return sums.compute(), per_class_report(confusion, classes), confusion

    def eval_table(self, metrics, per_class, classes) -> str:
        from imgcls.tasks.metrics import format_eval_table

        return format_eval_table(metrics, per_class, min(5, len(classes)))

    def eval_document(self, metrics, per_class, confusion, classes, **extra) -> dict:
        from imgcls.tasks.metrics import eval_document

        return eval_document([m.name for m in self.metrics], metrics, per_class, confusion, classes, **extra)
