"""Any number of tags per image (`data.task: multilabel`): one sigmoid per class, BCE or the asymmetric
loss, mAP and F1 at per-class thresholds tuned on validation (carried by best.pt and every export)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from imgcls.core.errors import ConfigError
from imgcls.tasks.base import LOSS, NUM_SAMPLES, Metric, Task

if TYPE_CHECKING:  # the task registry loads without torch (config validation, --help)
    import torch

CALLED_AT_THRESHOLDS = "each tag is called at its threshold (--threshold X)"


def _figure(name: str, **kw) -> Metric:
    return Metric(name, selectable=False, **kw)


class MultiLabel(Task):
    name = "multilabel"
    title = "multi-label"
    label_format = "tags"
    activation = "sigmoid"
    explains_each_label = True
    metrics = (Metric("mAP"), _figure("micro_f1"), _figure("macro_f1"), _figure("precision", in_csv=False),
               _figure("recall", in_csv=False), _figure("micro_f1_at_0.5", in_csv=False),
               _figure("macro_f1_at_0.5", in_csv=False),
               _figure("precision_at_0.5", in_csv=False, scalar=False, in_best=False),
               _figure("recall_at_0.5", in_csv=False, scalar=False, in_best=False), LOSS, NUM_SAMPLES)
    default_metric = "mAP"
    unsupported = {
        "--reject": f"not for multi-label models ({CALLED_AT_THRESHOLDS})",
        "--reject-below": f"not for multi-label models ({CALLED_AT_THRESHOLDS})",
        "--reliability": "the reliability diagram is for single-label models (one softmax over the classes)",
        "calibration": "single-label models only; a multi-label model calls each tag at the threshold tuned on "
                       "validation (best.pt 'thresholds')",
        "--quantize int8": "its agreement check compares single-label top-1 predictions; a multi-label model is "
                           "exported in fp32 (drop --quantize)",
        "label errors": "the label-error search (cleanlab on out-of-sample class probabilities) is for "
                        "single-label data",
        "--knn": "the kNN vote picks one class per image; a multi-label model's features are evaluated by mAP",
        "--linear-probe": "the probe fits one class per image; a multi-label model's features are evaluated by mAP",
        "incremental.base": "class-incremental training (docs/incremental.md) extends single-label models; adding "
                            "tags to a multi-label model is not built in (train a new run on every tag)",
        "semi.method": "pseudo-labels pick one class per unlabelled image (FixMatch / FlexMatch); pseudo-labels for "
                       "tags are a different method: set semi.method=none for data.task=multilabel",
        "--pseudo-labels": "pseudo-label rows carry one class per image; a multi-label model's tags are not written "
                           "as extra training data",
        "misclassified images": "eval.py --json's <name>_errors.csv / .html list images whose one top-1 label is "
                                "wrong; a multi-label model's per-tag errors are the per_class figures",
    }

    def check_config(self, cfg, explicit: set[str]) -> None:
        """Multi-label takes its own defaults (train.loss bce, early_stop.metric mAP) where the keys were left
        at the single-label ones; what cannot mean anything for it is refused by name."""
        d, t, es = cfg.data, cfg.train, cfg.early_stop
        if not d.label_delimiter:
            raise ConfigError(f"'data.label_delimiter' = {d.label_delimiter!r}: one or more characters between tags, "
                              f"e.g. ' ' (the default), ',', ';' or '|'")
        if t.loss == "focal":
            raise ConfigError("'train.loss' = focal is the single-label (softmax) focal loss; with data.task=multilabel "
                              "use train.loss=asl, the focal loss of per-tag sigmoids (train.asl_gamma_pos/neg)")
        if t.class_weights != "none":
            raise ConfigError(f"'train.class_weights' = {t.class_weights} weights the one label of a single-label "
                              f"image; with data.task=multilabel use train.loss=asl for rare tags, or "
                              f"train.class_weights=none")
        if t.loss == "ce":
            if "train.loss" in explicit:
                raise ConfigError("'train.loss' = ce gives one softmax over the classes, one label per image; "
                                  "data.task=multilabel trains one sigmoid per class: use train.loss=bce or asl")
            t.loss = "bce"
        if es.metric not in self.selectable_metrics() and "early_stop.metric" not in explicit:
            es.metric = self.default_metric
        if es.metric not in self.selectable_metrics():
            raise ConfigError(f"'early_stop.metric' = {es.metric} is a one-label-per-image metric; with "
                              f"data.task=multilabel use {' or '.join(self.selectable_metrics())} (mAP is the default)")
        if d.format == "folder":
            raise ConfigError("'data.task' = multilabel needs tags per image, which a class-folder tree cannot hold: "
                              "use data.format=csv (a tag column, data.label_delimiter between tags) or webdataset "
                              "shards written by python -m imgcls.data.shards --from LIST.csv --multilabel")
        if d.sampler == "weighted":
            raise ConfigError("'data.sampler' = weighted draws images by the inverse frequency of their one class; a "
                              "multi-label image has several or none. Use data.sampler=random with data.task=multilabel "
                              "(train.loss=asl down-weights the many easy negatives instead)")

    def explained_labels(self, row: dict) -> list[str]:
        """Each called tag of the row (one overlay per tag)."""
        return list(row["labels"])

    def model_file_extras(self, metrics: dict) -> dict:
        return {"thresholds": [float(t) for t in metrics["thresholds"]]}

    def new_sums(self, num_classes: int, device: torch.device, classes: list[str]):
        from imgcls.tasks.metrics import MultiLabelSums

        return MultiLabelSums(num_classes, device, classes)

    def merge_flip(self, logits: torch.Tensor, flipped: torch.Tensor) -> torch.Tensor:
        import torch

        return torch.logit((logits.sigmoid() + flipped.sigmoid()) / 2)

    def criterion(self, train_cfg) -> torch.nn.Module:
        from imgcls.tasks.losses import build_criterion

        return build_criterion(train_cfg)

    def startup_lines(self, cfg) -> list[str]:
        return [f"task: multilabel, one sigmoid per class (tags split by {cfg.data.label_delimiter!r}); validation "
                f"mAP, F1 at per-class thresholds tuned for F1 on the validation split (stored in best.pt); best.pt "
                f"by {cfg.early_stop.metric}"]

    def startup_warnings(self, cfg) -> list[str]:
        low = cfg.data.scale[0]
        if low >= 0.25:
            return []
        return [f"data.scale {cfg.data.scale}: a random-resized crop down to {low:.0%} of the image can cut a "
                f"tagged object out while its tag stays on; for tags of objects, keep more of the image "
                f"(data.scale=[0.5,1.0], as configs/multilabel.yaml does)"]

    def epoch_text(self, metrics: dict, top5_k: int) -> str:
        """A multi-label validation in one line: mAP, and F1 at the tuned thresholds and at 0.5."""
        mean_ap = "undefined (no tag in the split)" if metrics["mAP"] is None else f"{metrics['mAP']:.2f}"
        return (f"val mAP {mean_ap}  micro F1 {metrics['micro_f1']:.2f} (at 0.5: "
                f"{metrics['micro_f1_at_0.5']:.2f})  macro F1 {metrics['macro_f1']:.2f} (at 0.5: "
                f"{metrics['macro_f1_at_0.5']:.2f})  loss {metrics['loss']:.4f}  ({metrics['num_samples']} samples)")

    def prediction(self, logits: torch.Tensor) -> torch.Tensor:
        """The tags called at probability 0.5 (a bool per tag)."""
        return logits > 0

    def probabilities(self, logits, temperature=None):
        from imgcls.tasks.rows import sigmoid

        return sigmoid(logits)

    def outputs(self, logits, topk, temperature=None) -> dict:
        """Every class's probability (no calibration: each tag is called at its threshold)."""
        from imgcls.tasks.rows import tag_outputs

        return tag_outputs(logits)

    def rows(self, names, preds, classes, thresholds, delimiter) -> list[dict]:
        from imgcls.tasks.rows import tag_rows

        return tag_rows(names, preds, classes, thresholds, delimiter)

    def format_rows(self, rows: list[dict], delimiter: str) -> str:
        from imgcls.tasks.rows import format_tag_table

        return format_tag_table(rows, delimiter)

    def write_rows(self, rows, path, classes, topk, delimiter, extra=()) -> None:
        from imgcls.tasks.rows import write_tag_rows

        write_tag_rows(rows, path, classes, delimiter, extra)

    def evaluation_figures(self, sums, classes, thresholds) -> tuple:
        """F1, precision and recall at the model's tuned thresholds (those infer.py applies; 0.5 where the
        model records none) and at 0.5, mAP over the classes with a positive."""
        from imgcls.tasks.rows import DEFAULT_THRESHOLD

        metrics = sums.compute(thresholds or [DEFAULT_THRESHOLD] * len(classes))
        return metrics, metrics.pop("per_class"), None

    def eval_table(self, metrics, per_class, classes) -> str:
        from imgcls.tasks.metrics import format_multilabel_table

        return format_multilabel_table(metrics, per_class)

    def eval_document(self, metrics, per_class, confusion, classes, **extra) -> dict:
        from imgcls.tasks.metrics import multilabel_document

        return multilabel_document([m.name for m in self.metrics], metrics, per_class, classes, **extra)
