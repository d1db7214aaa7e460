"""eval.py's work: evaluate a checkpoint on a split exactly as training validated it."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from core.errors import ConfigError
from data.build import build_eval_loader_for, prepare_root
from data.listing.sources import eval_source
from engine.runtime.device import DeviceInput, amp_setting, pin_memory_for
from engine.runtime.runtime import build_runtime
from commands.infer_multilabel import check_single_label_flags
from commands.output_roles import check_eval_outputs
from engine.evaluation.calibration import apply_temperature, reliability_bins
from engine.evaluation.evaluate import check_finite_outputs, evaluate
from engine.evaluation.outputs import OutputRecorder
from engine.evaluation.trust import trust_metrics
from engine.evaluation.metrics import per_class_report
from engine.evaluation.multilabel import DEFAULT_THRESHOLD
from engine.model_io.model_files import load_model_file

log = logging.getLogger(__name__)


@dataclass
class EvalResult:
    metrics: dict
    per_class: dict
    confusion: torch.Tensor
    classes: list[str]
    skipped_files: list[str]
    settings: dict
    trust: dict = None          # ece, ece_uncalibrated, nll, temperature, selective (engine.evaluation.trust)
    reliability: list = None    # the reliability diagram's bins (calibrated probabilities)
    multilabel: bool = False   # data.task=multilabel: metrics hold mAP / F1, per_class the per-tag figures


def evaluate_checkpoint(checkpoint: str | Path, data_root: str | None = None, split: str | None = None,
                        batch_size: int | None = None, tta: bool = False, overrides: list[str] = (),
                        classes_file: str | None = None, host=None, reject_below: float | None = None,
                        outputs: dict | None = None) -> EvalResult:
    """Evaluate a checkpoint on a split exactly as training validated it: the same preprocessing, batch
    size, AMP setting (resolved by `resolve_amp`), channels_last, cudnn autotuning and
    `engine.evaluation.evaluate.evaluate`. An exported model (ONNX, .pt2, timm folder) runs the same way from the
    config it records; ONNX in fp32."""
    loaded = load_model_file(checkpoint, overrides, classes_file)
    cfg = loaded.cfg
    list_arg = data_root is not None and data_root.lower().endswith((".csv", ".tar"))  # a CSV list or shards
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
    if loaded.saved_val_limit and not cfg.data.limit_val_batches:
        log.warning("training validated this checkpoint on its first %d batch(es) only (data.limit_val_batches); "
                    "this evaluation reads the whole split (pass data.limit_val_batches=%d to match training)",
                    loaded.saved_val_limit, loaded.saved_val_limit)
    source = eval_source(cfg.data, loaded.classes, loaded.data_source, data_root if list_arg else None, split)
    index = source.index
    check_single_label_flags(loaded.multilabel, **{"--reject-below": reject_below,
                                                   "--reliability": (outputs or {}).get("--reliability")})
    check_eval_outputs(outputs or {}, checkpoint, classes_file, data_root, cfg.data.root,
                       getattr(index, "paths", ()))

    runtime = build_runtime(cfg, host, saved_threads=loaded.threads, fp32_only=loaded.fp32_only)
    device, amp_dtype = runtime.device, runtime.amp_dtype
    model = loaded.build_model(device, cfg.train.channels_last)
    transform = loaded.eval_transform()
    pin = pin_memory_for(cfg.data.pin_memory, device)
    limit = cfg.data.limit_val_batches * cfg.train.batch_size if cfg.data.limit_val_batches else None
    loader = build_eval_loader_for(index, transform, transform.img_size, cfg.train.batch_size,
                                   cfg.data.num_workers, pin, prefetch_factor=cfg.data.prefetch_factor,
                                   limit_samples=limit)
    recorder = None if loaded.multilabel else OutputRecorder(model)
    try:
        sums, unreadable = evaluate(model, loader, DeviceInput.from_config(cfg, device, amp_dtype), len(loaded.classes),
                                    tta_flip=tta, on_outputs=recorder,
                                    classes=loaded.classes if loaded.multilabel else None)
    finally:
        if recorder is not None:
            recorder.close()
    skipped = [index.paths[i] for i in sorted(unreadable)]
    settings = {"checkpoint": str(loaded.path), "model_format": loaded.kind, "epoch": loaded.epoch,
                "data": source.data, "split": source.split, "source": source.described,
                "batch_size": cfg.train.batch_size, "fixed_batch": loaded.fixed_batch, "amp": amp_setting(amp_dtype),
                "channels_last": cfg.train.channels_last, "tta": tta, "device": str(device),
                "preprocessing": {"img_size": transform.img_size, "resize": transform.resize_to,
                                  "crop_pct": cfg.data.crop_pct,
                                  "interpolation": cfg.data.interpolation, "mean": list(cfg.data.mean),
                                  "std": list(cfg.data.std)}}
    if loaded.multilabel:
        return multilabel_result(sums, loaded, skipped, settings)
    outputs = recorder.outputs()
    trust, reliability = None, None
    if len(outputs):
        trust = trust_metrics(outputs, loaded.calibration, reject_below, log_probs=tta)
        reliability = reliability_bins(apply_temperature(outputs.logits, trust["temperature"]), outputs.labels)
    metrics = sums.compute()
    check_finite_outputs(int(sums.nonfinite), metrics["num_samples"], loaded.path)
    confusion = sums.confusion.cpu()
    return EvalResult(metrics, per_class_report(confusion, loaded.classes), confusion, loaded.classes, skipped,
                      settings, trust, reliability)


def multilabel_result(sums, loaded, skipped: list[str], settings: dict) -> EvalResult:
    """A multi-label evaluation: F1, precision and recall at the model's tuned thresholds (those infer.py
    applies; 0.5 where the model records none) and at 0.5, mAP over the classes with a positive."""
    thresholds = loaded.thresholds
    settings["thresholds"] = "tuned in training (recorded in the model)" if thresholds else "0.5 (none recorded)"
    metrics = sums.compute(thresholds or [DEFAULT_THRESHOLD] * len(loaded.classes))
    per_class = metrics.pop("per_class")
    return EvalResult(metrics, per_class, None, loaded.classes, skipped, settings, multilabel=True)
