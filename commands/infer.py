"""infer.py's work: classify a file list with a checkpoint in padded fixed-shape batches, and the
result rows (a table on stdout, CSV or JSON files)."""
from __future__ import annotations

import csv
import json
import logging
import sys
from pathlib import Path
from typing import Optional

import torch

from commands.infer_trust import (EXPLAIN_COLUMNS, ScoreRecorder, TrustOptions, apply_reject, build_rejector,
                                  check_trust_options, explain_rows, extra_columns)
from core.errors import ConfigError
from core.outputs import finite_or_null
from data.file_list import FileListDataset, build_inference_loader, expand_inputs
from engine.model_io.checkpoint_files import find_newest_checkpoint
from engine.runtime.device import DeviceInput, amp_setting, select_device
from engine.runtime.runtime import Runtime, build_runtime
from engine.evaluation.evaluate import Predictions, check_finite_outputs, predict
from engine.evaluation.rejection import classifier_name
from commands.output_roles import check_infer_outputs
from commands.infer_multilabel import check_threshold_flag, run_tag_inference
from engine.model_io.model_file import KIND_NAMES
from engine.model_io.model_files import load_model_file
from models.factory import fold_batchnorm

log = logging.getLogger(__name__)


def result_columns(k: int) -> list[str]:
    columns = ["path", "label", "prob"]
    for j in range(1, k + 1):
        columns += [f"top{j}_label", f"top{j}_prob"]
    return columns + ["error"]


def result_rows(paths: list[str], preds: Predictions, classes: list[str]) -> list[dict]:
    """One dict per input file, in input order; unreadable files get `error` and no prediction."""
    k = preds.top_probs.shape[1] if preds.top_probs.ndim == 2 else 0
    probs = preds.top_probs.tolist()
    labels = preds.top_indices.tolist()
    valid = preds.valid.tolist()
    rows = []
    for i, path in enumerate(paths):
        row = dict.fromkeys(result_columns(k))
        row["path"] = path
        if valid[i]:
            row["label"], row["prob"] = classes[labels[i][0]], probs[i][0]
            for j in range(k):
                row[f"top{j + 1}_label"] = classes[labels[i][j]]
                row[f"top{j + 1}_prob"] = probs[i][j]
        else:
            row["error"] = preds.errors.get(i, "could not be read")
        rows.append(row)
    return rows


def table_text(text: str) -> str:
    """A name as one table cell: quoted with escapes (Python's repr) when it holds a newline, a tab or
    another unprintable character, so one row stays one line."""
    return text if text.isprintable() else repr(text)


def format_predictions_table(rows: list[dict]) -> str:
    paths = [table_text(r["path"]) for r in rows]
    width = max([len("path")] + [len(p) for p in paths])
    label_width = max([len("label")] + [len(r["label"]) for r in rows if r["label"] is not None])
    lines = [f"{'path':<{width}}  {'label':<{label_width}}  {'prob':>6}"]
    for path, r in zip(paths, rows):
        if r["error"] is None:
            lines.append(f"{path:<{width}}  {r['label']:<{label_width}}  {r['prob']:>6.4f}")
        else:
            lines.append(f"{path:<{width}}  {'-':<{label_width}}  {'-':>6}  error: {table_text(r['error'])}")
    return "\n".join(lines)


def write_rows(rows: list[dict], path: str | Path, k: int, extra: list[str] = ()) -> None:
    """`extra`: columns after the standard ones (infer_trust's); the JSON keeps `explain` as a list instead
    of the CSV's flat explain columns."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".json":
        json_rows = [{key: value for key, value in row.items() if key not in EXPLAIN_COLUMNS} for row in rows]
        path.write_text(json.dumps(finite_or_null(json_rows), indent=1, allow_nan=False) + "\n")
        return
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=result_columns(k) + list(extra), lineterminator="\n",
                                extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: "" if value is None else value for key, value in row.items()})


DEFAULT_BATCH_SIZE = 32


def run_inference(inputs: list[str], checkpoint: Optional[str], batch_size: Optional[int], topk: int,
                  output: Optional[str], amp: Optional[str], compile_model: bool, num_workers: int,
                  device_setting: str = "auto", classes_file: Optional[str] = None, host=None,
                  trust: Optional[TrustOptions] = None, threshold: Optional[float] = None) -> int:
    """Classify every input file with a checkpoint or an exported model (ONNX, .pt2, timm folder);
    returns the exit status (0: at least one classified, 1: none)."""
    paths = expand_inputs(inputs)
    if checkpoint is None:
        checkpoint_path = find_newest_checkpoint("runs")
        print(f"checkpoint: {checkpoint_path} (the newest best.pt under runs/)", file=sys.stderr)
    else:
        checkpoint_path = checkpoint
        print(f"checkpoint: {checkpoint_path}", file=sys.stderr)
    check_infer_outputs(inputs, paths, checkpoint_path, classes_file, output, trust and trust.explain_dir)
    loaded = load_model_file(checkpoint_path, classes_file=classes_file)
    if loaded.kind != "checkpoint":
        log.info("%s: %s", checkpoint_path, KIND_NAMES[loaded.kind])
    check_threshold_flag(threshold, loaded.multilabel)
    if compile_model and loaded.kind == "onnx":
        raise ConfigError("--compile: an ONNX model runs in onnxruntime, not in torch; drop --compile")
    trust = trust or TrustOptions()
    if loaded.multilabel and trust.rejecting:
        raise ConfigError("--reject / --reject-below: not for multi-label models (calibration and the reject "
                          "option are single-label; a multi-label model calls each tag at its threshold, "
                          "--threshold X)")
    check_trust_options(loaded, trust)
    cfg = loaded.cfg
    runtime = _runtime(loaded, device_setting, amp, host)
    device, amp_dtype = runtime.device, runtime.amp_dtype
    batch_size = _batch_size(loaded, batch_size)
    log.info("classifying %d file(s) in batches of %d%s on %s (%s)", len(paths), batch_size,
             " (fixed by the export)" if loaded.fixed_batch else "", device, amp_setting(amp_dtype))
    k = min(topk, len(loaded.classes))

    model = loaded.build_model(device, channels_last=True)
    head_name = classifier_name(model)  # the penultimate features' tap, found before folding renames nothing
    model = inference_model(loaded, device, model=model)
    rejector = build_rejector(loaded, trust, head_name is not None)
    # the recorder's feature tap goes on before compiling
    scores = ScoreRecorder(model, rejector, head_name) if rejector is not None else None
    if compile_model:
        model = torch.compile(model, dynamic=False)
    transform = loaded.eval_transform()
    dataset = FileListDataset(paths, transform, transform.img_size)
    loader = build_inference_loader(dataset, batch_size, num_workers, pin_memory=device.type == "cuda")
    if loaded.multilabel:
        return run_tag_inference(paths, model, loader, DeviceInput.from_config(cfg, device, amp_dtype,
                                                                               channels_last=True),
                                 loaded, threshold, output, trust.explain_dir)
    temperature = (loaded.calibration or {}).get("temperature")
    try:
        preds = predict(model, loader, DeviceInput.from_config(cfg, device, amp_dtype, channels_last=True), k,
                        temperature, on_logits=scores)
    finally:
        if scores is not None:
            scores.close()
    check_finite_outputs(preds.nonfinite, int(preds.valid.sum()), loaded.path)
    rows = result_rows(paths, preds, loaded.classes)
    _apply_trust(loaded, paths, rows, trust, rejector, scores)

    print(format_predictions_table(rows))
    failed = [r for r in rows if r["error"] is not None]
    for r in failed:
        log.warning("could not read %s: %s", r["path"], r["error"])
    if output:
        write_rows(rows, output, k, extra_columns(trust))
    classified = len(rows) - len(failed)
    print(f"classified {classified} of {len(rows)} file(s)" + (f"; {len(failed)} could not be read" if failed else "")
          + (f"; wrote {output}" if output else ""), file=sys.stderr)
    return 0 if classified else 1


def _apply_trust(loaded, paths: list[str], rows: list[dict], trust: TrustOptions, rejector, scores) -> None:
    """--reject / --reject-below: `unknown` below the threshold; --explain: Grad-CAM overlays."""
    if rejector is not None:
        rejected = apply_reject(rows, scores.all_scores(), rejector)
        classified = sum(1 for r in rows if r["error"] is None)
        print(f"rejected {rejected} of {classified} image(s) as {'unknown'!r} ({rejector.method} score < "
              f"{rejector.threshold:.4g})", file=sys.stderr)
    if trust.explain_dir:
        explain_rows(loaded, paths, rows, loaded.classes, trust.explain_dir)
        print(f"wrote Grad-CAM overlays to {trust.explain_dir}", file=sys.stderr)


def inference_model(loaded, device: torch.device, compile_model: bool = False,
                    model: Optional[torch.nn.Module] = None) -> torch.nn.Module:
    """The model infer.py (and serve.py) runs: `model` (default: the file's, built channels_last), its
    BatchNorm folded, optionally compiled."""
    model = loaded.build_model(device, channels_last=True) if model is None else model
    model, folded = fold_batchnorm(model)
    if folded:
        model = model.to(memory_format=torch.channels_last)  # the folded weights are new tensors
        log.info("folded %d BatchNorm layers into the preceding convolutions", folded)
    if compile_model:
        model = torch.compile(model, dynamic=False)
    return model


def _runtime(loaded, device_setting: str, amp: Optional[str], host) -> Runtime:
    """The runtime eval.py would set up, on `--device`, at `--amp` (else the checkpoint's train.amp resolved
    for this device; an ONNX model always runs in fp32), with the checkpoint's thread count. cudnn
    autotuning pays here: padded batches have one input shape, tuned once."""
    try:
        if loaded.fp32_only and amp not in (None, "none", "auto"):
            log.warning("--amp %s: an ONNX model runs its fp32 graph in onnxruntime; running in fp32", amp)
        setting = amp or loaded.cfg.train.amp
        if amp is None and setting == "fp16" and select_device(device_setting).type != "cuda":
            setting = "auto"  # trained with fp16 on a GPU, classifying on a CPU
        return build_runtime(loaded.cfg, host, saved_threads=loaded.threads, device_setting=device_setting,
                             amp_setting=setting, fp32_only=loaded.fp32_only)
    except ConfigError as err:
        raise ConfigError(f"--device {device_setting} / --amp {amp or 'from the checkpoint'}: {err}") from err


inference_runtime = _runtime  # serve.py sets up as infer.py does


def _batch_size(loaded, asked: Optional[int]) -> int:
    """--batch-size, or the batch an exported model was traced for (a fixed-batch model takes no other)."""
    if loaded.fixed_batch is None:
        return asked or DEFAULT_BATCH_SIZE
    if asked is not None and asked != loaded.fixed_batch:
        log.warning("%s was exported for a fixed batch of %d: using --batch-size %d, not %d", loaded.path,
                    loaded.fixed_batch, loaded.fixed_batch, asked)
    return loaded.fixed_batch
