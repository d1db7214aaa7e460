"""eval.py's work: evaluate a checkpoint on a split exactly as training validated it."""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from imgcls.core.errors import ConfigError
from imgcls.data.build import build_eval_loader_for, prepare_root
from imgcls.data.listing.sources.registry import eval_source
from imgcls.runtime.device import amp_setting, pin_memory_for
from imgcls.commands.evaluation.eval_errors import misclassified
from imgcls.commands.evaluation.eval_representation import features_line, representation_figures
from imgcls.commands.output_roles import check_eval_outputs
from imgcls.evaluation.calibration import apply_temperature, reliability_bins
from imgcls.evaluation.evaluate import check_finite_outputs, evaluate
from imgcls.evaluation.split_outputs import OutputRecorder
from imgcls.evaluation.trust import trust_metrics
from imgcls.model_files.loading import load_model_file
from imgcls.prediction.predictor import Predictor
from imgcls.tasks.base import Predictions, Task

log = logging.getLogger(__name__)


@dataclass
class EvalResult:
    metrics: dict
    per_class: dict
    confusion: torch.Tensor
    classes: list[str]
    skipped_files: list[str]
    settings: dict
    task: Task
    trust: dict = None          # ece, ece_uncalibrated, nll, temperature, selective (evaluation.trust)
    reliability: list = None    # the reliability diagram's bins (calibrated probabilities)
    rows: list = None           # the Predictor's rows of every evaluated image (infer.py's, with `target`)
    delimiter: str = " "        # between tags in a multi-label row
    errors: list = None         # the misclassified images, worst first (commands/evaluation/eval_errors.py); None: not the task's
    representation: dict = None  # --knn / --linear-probe: knn_top1, linear_probe_top1 (commands/evaluation/eval_representation.py)


def amp_override(overrides: list[str]) -> str | None:
    """eval.py's `train.amp=X` (its --amp): used as named, where the checkpoint's own train.amp is resolved for
    this machine (a bf16 checkpoint runs in fp32 on a CPU that emulates bf16)."""
    given = [o.split("=", 1)[1].strip() for o in overrides if o.split("=", 1)[0].strip() == "train.amp"]
    return given[-1] if given else None


def evaluate_checkpoint(checkpoint: str | Path, data_root: str | None = None, split: str | None = None,
                        batch_size: int | None = None, tta: bool = False, overrides: list[str] = (),
                        classes_file: str | None = None, reject_below: float | None = None,
                        outputs: dict | None = None, knn: int | None = None,
                        linear_probe: bool = False) -> EvalResult:
    """Evaluate a checkpoint on a split exactly as training validated it: the same preprocessing, batch
    size, AMP setting (resolved by `resolve_amp`), channels_last, cudnn autotuning and
    `evaluation.evaluate.evaluate`. An exported model (ONNX, .pt2, timm folder) runs the same way from the
    config it records; ONNX in fp32. The model is the Predictor's, as trained (BatchNorm not folded)."""
    loaded = load_model_file(checkpoint, overrides, classes_file)
    task = loaded.task
    cfg = loaded.cfg
    list_arg = data_root is not None and data_root.lower().endswith((".csv", ".tar"))  # a CSV list or shards
    set_eval_data_and_batch(loaded, data_root, batch_size, list_arg)
    if loaded.saved_val_limit and not cfg.data.limit_val_batches:
        log.warning("training validated this checkpoint on its first %d batch(es) only (data.limit_val_batches); "
                    "this evaluation reads the whole split (pass data.limit_val_batches=%d to match training)",
                    loaded.saved_val_limit, loaded.saved_val_limit)
    source = eval_source(cfg.data, loaded.classes, loaded.data_source, data_root if list_arg else None, split)
    index = source.index
    given = {"--reject-below": reject_below, "--reliability": (outputs or {}).get("--reliability"), "--knn": knn,
             "--linear-probe": linear_probe or None}
    for flag in (name for name, value in given.items() if value is not None):
        loaded.task.check_supported(flag)  # a multi-label model has neither (they were ignored)
    check_eval_outputs(outputs or {}, checkpoint, classes_file, data_root, cfg.data.root, index.files)

    predictor = Predictor.from_model_file(loaded, None, amp=amp_override(overrides), for_serving=False)
    model, transform = predictor.model, predictor.transform
    pin = pin_memory_for(cfg.data.pin_memory, predictor.runtime.device)
    limit = cfg.data.limit_val_batches * cfg.train.batch_size if cfg.data.limit_val_batches else None
    loader = build_eval_loader_for(index, transform, transform.img_size, cfg.train.batch_size,
                                   cfg.data.num_workers, pin, prefetch_factor=cfg.data.prefetch_factor,
                                   limit_samples=limit)
    calibrated = task.supports("calibration")
    recorder = OutputRecorder(model, with_features=calibrated,
                              layers=(loaded.calibration or {}).get("layer_names") if calibrated else None)
    try:
        sums, unreadable = evaluate(model, loader, predictor.device_input, task, loaded.classes, tta_flip=tta,
                                    on_outputs=recorder)
    finally:
        recorder.close()
    skipped = [index.paths[i] for i in sorted(unreadable)]
    settings = evaluation_settings(predictor, source, tta)
    recorded = recorder.outputs()
    trust, reliability = None, None
    if calibrated and len(recorded):
        trust = trust_metrics(recorded, loaded.calibration, reject_below, log_probs=tta)
        reliability = reliability_bins(apply_temperature(recorded.logits, trust["temperature"]), recorded.labels)
    if not calibrated:
        settings["thresholds"] = ("tuned in training (recorded in the model)" if loaded.thresholds else
                                  "0.5 (none recorded)")
    errors = (misclassified(recorded, index.paths, loaded.classes, trust and trust["temperature"])
              if task.supports("misclassified images") else None)
    metrics, per_class, confusion = task.evaluation_figures(sums, loaded.classes, loaded.thresholds)
    check_finite_outputs(int(getattr(sums, "nonfinite", 0)), metrics["num_samples"], loaded.path)
    rows = prediction_rows(predictor, recorded, index.paths, tta)
    return EvalResult(metrics, per_class, confusion, loaded.classes, skipped, settings, task, trust, reliability, rows,
                      predictor.delimiter, errors, representation_figures(predictor, index, knn, linear_probe))


def set_eval_data_and_batch(loaded, data_root: str | None, batch_size: int | None, list_arg: bool) -> None:
    """The loaded model's config as this evaluation reads it: --data's root, --batch-size (or the batch an
    export was traced for); usage errors (exit 2) when neither the checkpoint nor the command names them."""
    cfg = loaded.cfg
    if data_root is not None and not list_arg:
        cfg.data.root = data_root
    if batch_size is not None:
        if batch_size < 1:
            raise ConfigError(f"--batch-size {batch_size}: must be >= 1")
        cfg.train.batch_size = batch_size
    if loaded.fixed_batch is not None:  # an export traced for one batch runs that batch (as infer.py does)
        if batch_size is not None and batch_size != loaded.fixed_batch:
            log.warning("%s was exported for a fixed batch of %d: using --batch-size %d, not %d", loaded.path,
                        loaded.fixed_batch, loaded.fixed_batch, batch_size)
        cfg.train.batch_size = loaded.fixed_batch
    if not cfg.data.root and cfg.data.format == "folder" and not list_arg:
        raise ConfigError("no data folder: the checkpoint's config has no data.root; pass --data ROOT")
    if isinstance(cfg.train.batch_size, str):  # 'auto' is resolved before training saves its config
        raise ConfigError("the checkpoint's train.batch_size is 'auto'; pass --batch-size N")
    if cfg.data.builtin and data_root is None and not (Path(cfg.data.root).expanduser() / cfg.data.val_split).is_dir():
        prepare_root(cfg)  # the checkpoint's own built-in data set, written anew; never a folder the user named


def evaluation_settings(predictor: Predictor, source, tta: bool) -> dict:
    """What the evaluation ran with, as eval.py prints it and its JSON records it."""
    loaded, transform = predictor.model_file, predictor.transform
    cfg = loaded.cfg
    return {"checkpoint": str(loaded.path), "model_format": loaded.kind, "epoch": loaded.epoch,
            "data": source.data, "split": source.split, "source": source.described,
            "batch_size": cfg.train.batch_size, "fixed_batch": loaded.fixed_batch,
            "amp": amp_setting(predictor.runtime.amp_dtype), "channels_last": cfg.train.channels_last, "tta": tta,
            "device": str(predictor.runtime.device),
            "preprocessing": {"img_size": transform.img_size, "resize": transform.resize_to,
                              "crop_pct": cfg.data.crop_pct, "interpolation": cfg.data.interpolation,
                              "mean": list(cfg.data.mean), "std": list(cfg.data.std)}}


def prediction_rows(predictor: Predictor, outputs, paths: list[str], log_probs: bool) -> list[dict]:
    """The Predictor's rows (infer.py's columns) for the evaluated images in split order, each with its
    `target` (the label name, or the tag list). `log_probs`: the outputs are --tta's log-probabilities."""
    order = outputs.indices.argsort()
    logits, indices = outputs.logits[order], outputs.indices[order]
    task = predictor.task
    temperature = None if log_probs else predictor.temperature
    kept = task.outputs(logits.float().numpy(), predictor.topk, temperature)
    preds = Predictions(kept, torch.ones(len(indices), dtype=torch.bool))
    rows = task.rows([paths[i] for i in indices.tolist()], preds, predictor.classes, predictor.thresholds,
                     predictor.delimiter)
    for row, target in zip(rows, outputs.labels[order].tolist()):
        row["target"] = target_name(target, predictor.classes, predictor.delimiter)
    return rows


def target_name(target, classes: list[str], delimiter: str) -> str:
    """A label index as its name; a multi-hot vector as its tags joined by the delimiter."""
    if isinstance(target, list):
        return delimiter.join(name for name, on in zip(classes, target) if on)
    return classes[target]


def report_evaluation(result: EvalResult, json_path: str | None, reliability_path: str | None,
                      predictions_path: str | None) -> None:
    """eval.py's output: the settings line, the unreadable files, the task's table and the calibration line on
    the terminal; the JSON with the confusion PNG and the misclassified images, the prediction rows and the
    reliability diagram where asked for."""
    from imgcls.commands.evaluation.reliability_plot import draw_reliability
    from imgcls.commands.evaluation.report import confusion_png_path, draw_confusion, format_trust_line
    from imgcls.core.outputs import write_json

    task = result.task
    s = result.settings
    kind = "" if s["model_format"] == "checkpoint" else f"{s['model_format']}, "
    fixed = " (fixed by the export)" if s["fixed_batch"] else ""
    print(f"checkpoint {s['checkpoint']} ({kind}epoch {s['epoch']}) on {s['source']}: batch {s['batch_size']}{fixed}, "
          f"precision {'fp32' if s['amp'] == 'none' else s['amp']}, channels_last {s['channels_last']}, "
          f"tta {s['tta']}, device {s['device']}")
    if result.skipped_files:
        print(f"{len(result.skipped_files)} file(s) could not be read and were left out:", file=sys.stderr)
        for path in result.skipped_files:
            print(f"  {path}", file=sys.stderr)
    print(task.eval_table(result.metrics, result.per_class, result.classes))
    if result.trust:
        print(format_trust_line(result.trust))
    figures = result.representation or {}
    if figures:
        print(f"features: {features_line(figures)}")
    if json_path:
        doc = task.eval_document(result.metrics, result.per_class, result.confusion, result.classes,
                                 skipped_files=result.skipped_files, **(result.trust or {}), **figures, **s)
        write_json(doc, json_path)
        written = [json_path]
        if result.confusion is not None:
            written.append(draw_confusion(result.confusion, result.classes, confusion_png_path(json_path)))
        print(f"wrote {' and '.join(map(str, written))}")
        if result.errors is not None:
            from imgcls.commands.evaluation.eval_errors import write_errors

            errors_csv, errors_html = write_errors(result.errors, json_path)
            print(f"wrote {len(result.errors)} misclassified image(s) to {errors_csv} and {errors_html}")
    if predictions_path:
        task.write_rows(result.rows, predictions_path, result.classes, 5, result.delimiter, ["target"])
        print(f"wrote {predictions_path}")
    if reliability_path and result.trust:
        t = result.trust
        png = draw_reliability(result.reliability, reliability_path, t["ece"], t["ece_uncalibrated"], t["temperature"])
        print(f"wrote {png}")
