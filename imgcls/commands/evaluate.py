"""eval.py's work: the evaluation of a model file, its report, the error gallery, the representation figures.

eval.py's misclassified images: every validation image whose top-1 prediction is wrong, worst first (the
lowest calibrated probability given to its true class), as a CSV and a self-contained HTML gallery of
thumbnails (the audit's), written beside `--json` as <name>_errors.csv and <name>_errors.html.

eval.py --reliability: the reliability diagram (matplotlib, no display). eval.py --json, single-label: each
class's average precision and the macro PR-AUC in the JSON, and the precision-recall curves beside it as
<name>_pr.png, from the probabilities infer.py would write for the split.

What eval.py draws and prints beside the task's report (tasks/): the calibration line and the confusion PNG.

eval.py --knn K / --linear-probe: the model's pooled pre-logits features of the training split (the
memory bank, the probe's fit set) and of the evaluated split, through the evaluation loader and
preprocessing, scored without the classifier head (embedding/embedder.py).

eval.py's work: evaluate a checkpoint on a split exactly as training validated it."""
from __future__ import annotations

import csv
import html
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from PIL import Image, ImageDraw, ImageFont

from imgcls.auditing.report import MAX_SHOWN, STYLE, thumbnail_uri
from imgcls.commands.output_roles import check_eval_outputs, confusion_png_path, errors_paths, pr_png_path
from imgcls.compute.device import DeviceInput, amp_setting, pin_memory_for
from imgcls.core.errors import ConfigError
from imgcls.data.build import build_eval_loader_for, prepare_root
from imgcls.data.sources import eval_source, scan_sources, train_source
from imgcls.embedding.embedder import Embedder, embedding_module, knn_top1, linear_probe_top1, split_features
from imgcls.evaluation.calibration import apply_temperature, reliability_bins
from imgcls.evaluation.evaluate import check_finite_outputs, evaluate
from imgcls.evaluation.rejection import OutputRecorder
from imgcls.evaluation.trust import trust_metrics
from imgcls.model_files.formats import format_of
from imgcls.model_files.loading import load_model_file
from imgcls.model_files.predictor import Predictor, prediction_runtime
from imgcls.tasks.base import Predictions, Task
from imgcls.tasks.metrics import precision_recall_curve, single_label_precision_recall

COLUMNS = ["path", "label", "predicted", "prob_predicted", "prob_label"]


def misclassified(outputs, paths: Optional[list[str]], classes: list[str], temperature: Optional[float]) -> list[dict]:
    """Rows (COLUMNS) of the wrongly predicted samples in `outputs` (a SplitOutputs; `paths` by sample index;
    None, as for shards: "sample N"), the most confidently wrong first."""
    if not len(outputs):
        return []
    probs = apply_temperature(outputs.logits, temperature)
    predicted = probs.argmax(1)
    rows = []
    for i in (predicted != outputs.labels).nonzero().flatten().tolist():
        label, guess = int(outputs.labels[i]), int(predicted[i])
        index = int(outputs.indices[i])
        rows.append({"path": paths[index] if paths is not None else f"sample {index}", "label": classes[label],
                     "predicted": classes[guess], "prob_predicted": round(float(probs[i, guess]), 4),
                     "prob_label": round(float(probs[i, label]), 4)})
    return sorted(rows, key=lambda r: (r["prob_label"], -r["prob_predicted"], r["path"]))


def write_errors(rows: list[dict], json_path: str | Path) -> tuple[Path, Path]:
    """The CSV and the HTML gallery beside `json_path`, each written to a temp file and renamed."""
    csv_path, html_path = errors_paths(json_path)
    tmp = csv_path.with_name(f".{csv_path.name}.tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, csv_path)
    tmp = html_path.with_name(f".{html_path.name}.tmp")
    tmp.write_text(render_gallery(rows), encoding="utf-8")
    os.replace(tmp, html_path)
    return csv_path, html_path


def render_gallery(rows: list[dict]) -> str:
    figures = []
    for r in rows[:MAX_SHOWN]:
        uri = thumbnail_uri(r["path"])
        image = f'<img src="{uri}" alt="{html.escape(r["path"])}">' if uri else '<div class="bad">unreadable</div>'
        caption = (f"<b>{html.escape(r['label'])} &rarr; {html.escape(r['predicted'])}</b><br>"
                   f"p(pred) {r['prob_predicted']:.3f}, p(true) {r['prob_label']:.3f}<br>{html.escape(r['path'])}")
        figures.append(f"<figure>{image}<figcaption>{caption}</figcaption></figure>")
    more = (f'<p class="note">the first {MAX_SHOWN} of {len(rows)} shown; the CSV lists all</p>'
            if len(rows) > MAX_SHOWN else "")
    body = (f'<div class="row">{"".join(figures)}</div>' if rows else '<p class="note">no misclassified image</p>')
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>misclassified images</title>"
            f"<style>{STYLE}</style></head><body><h1>misclassified images ({len(rows)})</h1>"
            f'<p class="note">true label &rarr; prediction, the most confidently wrong first (calibrated '
            f"probabilities)</p>{more}{body}</body></html>")

def draw_reliability(bins: list[dict], path: str | Path, ece: float, ece_uncalibrated: float,
                     temperature: Optional[float]) -> Path:
    """Accuracy against mean confidence per confidence bin (bars; the diagonal is perfect calibration),
    with each bin's share of the samples beneath."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = bins[0]["high"] - bins[0]["low"]
    total = max(1, sum(b["count"] for b in bins))
    shares = [b["count"] / total for b in bins]
    bins = [b for b in bins if b["count"]]  # empty bins draw nothing
    centres = [(b["low"] + b["high"]) / 2 for b in bins]
    accuracy = [b["accuracy"] for b in bins]
    confidence = [b["confidence"] for b in bins]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(5.5, 6.5), dpi=100, height_ratios=[3, 1], sharex=True)
    top.bar(centres, accuracy, width=width * 0.95, color="#4c72b0", edgecolor="black", label="accuracy")
    top.bar(centres, [c - a for c, a in zip(confidence, accuracy)], bottom=accuracy, width=width * 0.95,
            color="#dd8452", alpha=0.5, edgecolor="#dd8452", label="gap to mean confidence")
    top.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
    t = "none" if temperature is None else f"{temperature:.3f}"
    top.set_title(f"reliability diagram: ECE {ece:.2f}% (uncalibrated {ece_uncalibrated:.2f}%)\n"
                  f"temperature {t}", fontsize=10)
    top.set_ylabel("accuracy")
    top.set_ylim(0, 1)
    top.legend(loc="upper left", fontsize=8)
    bottom.bar([width * (i + 0.5) for i in range(len(shares))], shares, width=width * 0.95, color="gray")
    bottom.set_xlabel("confidence (top-1 probability)")
    bottom.set_ylabel("share of samples")
    bottom.set_xlim(0, 1)
    return save_figure(fig, path)


def save_figure(fig, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def draw_precision_recall(probs: torch.Tensor, labels: torch.Tensor, classes: list[str], figures: dict,
                          path: str | Path, max_named: int = 10) -> Path:
    """Each class's one-vs-rest precision-recall curve (a step at each distinct threshold, as scikit-learn's),
    its AP in the legend; beyond `max_named` classes the rest are drawn in grey, unnamed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5), dpi=100)
    aps = figures["average_precision"]
    named = sorted((c for c, name in enumerate(classes) if aps[name] is not None), key=lambda c: aps[classes[c]])
    for rank, c in enumerate(named):
        recall, precision = precision_recall_curve(probs[:, c], labels == c)
        if rank < len(named) - max_named:
            ax.step([0.0] + recall, precision[:1] + precision, where="pre", color="0.75", linewidth=0.8)
        else:
            ax.step([0.0] + recall, precision[:1] + precision, where="pre", linewidth=1.3,
                    label=f"{classes[c]} (AP {aps[classes[c]]:.3f})")
    macro = figures["pr_auc_macro"]
    ax.set_title("precision-recall, one class against the rest" +
                 (f"\nmacro PR-AUC {macro:.3f}" if macro is not None else ""), fontsize=10)
    ax.set_xlabel("recall")
    ax.set_ylabel("precision")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    if named:
        ax.legend(loc="lower left", fontsize=7)
    return save_figure(fig, path)


def format_trust_line(trust: dict) -> str:
    """Calibration and selective-prediction figures in one line."""
    t = trust["temperature"]
    sel = trust["selective"]
    line = (f"calibration: ECE {trust['ece']:.2f}% (uncalibrated {trust['ece_uncalibrated']:.2f}%), NLL "
            f"{trust['nll']:.4f}, temperature {'none' if t is None else f'{t:.4f}'}")
    if sel["threshold"] is not None:
        line += (f"; selective ({sel['method']} score >= {sel['threshold']:.4g}): coverage {sel['coverage']:.2f}%, "
                 f"accuracy {sel['accuracy']:.2f}%")
    return (line + "".join(f"\ncalibration warning: {note}" for note in trust.get("calibration_notes") or []) +
            "".join(f"\nreject warning: {note}" for note in trust.get("reject_notes") or []))


LABEL_GAP = 4   # pixels between a rotated column label and the grid


def draw_confusion(confusion: torch.Tensor, classes: list[str], path: str | Path, max_side: int = 1600) -> Path:
    """Rows are true classes, columns predictions; each cell is shaded by its share of the row (recall),
    blue on the diagonal and red off it, with the count written in it when the cells are large enough."""
    counts = confusion.to(torch.int64)
    n = len(classes)
    cell = max(1, min(48, max_side // max(n, 1)))
    font = ImageFont.load_default()
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    title = "confusion matrix: rows = true class, columns = predicted class (shade = share of the row)"
    show_labels = cell >= 10
    names = [name[:20] for name in classes]
    label_w = int(max(measure.textlength(name, font=font) for name in names)) + 8 if show_labels else 0
    title_h = 22
    left, top = 8 + label_w, title_h + label_w
    side = n * cell
    width = max(left + side + 8, int(measure.textlength(title, font=font)) + 16)
    img = Image.new("RGB", (width, top + side + 8), "white")
    draw = ImageDraw.Draw(img)
    draw.text((8, 5), title, fill="black", font=font)
    row_totals = counts.sum(dim=1).clamp(min=1).to(torch.float64)
    share = (counts.to(torch.float64) / row_totals[:, None]).tolist()
    values = counts.tolist()
    for i in range(n):
        for j in range(n):
            level = share[i][j]
            shade = int(round(255 * (1 - level)))
            color = (shade, shade, 255) if i == j else (255, shade, shade)
            x0, y0 = left + j * cell, top + i * cell
            draw.rectangle([x0, y0, x0 + cell - 1, y0 + cell - 1], fill=color,
                           outline=(200, 200, 200) if cell >= 4 else None)
            if cell >= 28 and values[i][j]:
                text = str(values[i][j])
                if measure.textlength(text, font=font) <= cell - 4:
                    draw.text((x0 + 3, y0 + cell // 2 - 5), text, fill="white" if level > 0.6 else "black", font=font)
    if show_labels:
        for i, name in enumerate(names):
            draw.text((8, top + i * cell + cell // 2 - 5), name, fill="black", font=font)
            # column labels: drawn on a strip, rotated to read bottom-up, ending LABEL_GAP pixels above the
            # grid (the strip's start becomes its bottom), no wider than a cell so neighbours do not cover it
            high = min(12, cell)
            strip = Image.new("RGB", (label_w, high), "white")
            ImageDraw.Draw(strip).text((LABEL_GAP, 0), name, fill="black", font=font)
            img.paste(strip.rotate(90, expand=True), (left + i * cell + (cell - high) // 2, title_h))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path

log = logging.getLogger(__name__)


def representation_figures(predictor: Predictor, evaluated_index, knn: Optional[int], linear_probe: bool) -> dict:
    """{"knn_top1", "knn_k", "linear_probe_top1", "memory_bank"} for what was asked (empty: nothing asked)."""
    if not knn and not linear_probe:
        return {}
    loaded = predictor.model_file
    model = embedding_module(loaded, predictor.runtime.device, predictor.device_input.channels_last, fold=False)
    embedder = Embedder(loaded, predictor.runtime, model, predictor.device_input, predictor.transform, digest="")
    bank = train_source(loaded.cfg.data, loaded.classes, loaded.data_source)
    figures = figures_of(embedder, bank.index, bank.described, evaluated_index, len(loaded.classes), knn, linear_probe)
    figures.pop("num_samples")  # the classifier's evaluation counts the same images
    return figures


def figures_of(embedder: Embedder, bank_index, bank_described: str, evaluated_index, num_classes: int,
               knn: Optional[int], linear_probe: bool) -> dict:
    cfg = embedder.model_file.cfg
    pin = pin_memory_for(cfg.data.pin_memory, embedder.runtime.device)

    def features(index):
        loader = build_eval_loader_for(index, embedder.transform, embedder.transform.img_size, cfg.train.batch_size,
                                       cfg.data.num_workers, pin, prefetch_factor=cfg.data.prefetch_factor)
        return split_features(embedder, loader)

    print(f"features of the memory bank: {bank_described} ({len(bank_index)} image(s))", file=sys.stderr)
    train, train_labels = features(bank_index)
    queries, labels = features(evaluated_index)
    figures = {"memory_bank": bank_described, "memory_bank_size": len(train), "num_samples": len(queries)}
    if knn:
        if knn > len(train):  # a vote of more neighbours than the bank holds is a vote of the whole bank: say so
            print(f"--knn {knn}: the memory bank holds {len(train)} image(s); k clipped to {len(train)} "
                  f"(knn_k in the report)", file=sys.stderr)
            knn = len(train)
        figures.update(knn_top1=knn_top1(train, train_labels, queries, labels, knn, num_classes), knn_k=knn)
    if linear_probe:
        figures["linear_probe_top1"] = linear_probe_top1(train, train_labels, queries, labels)
    return figures


def pretrained_features_only(checkpoint: str, data_root: Optional[str], overrides: list[str], knn: Optional[int],
                             linear_probe: bool) -> Optional[dict]:
    """eval.py --knn / --linear-probe with a timm folder whose head is not the data's (pretrained weights with
    another class list): the features alone, on the data's own classes, its training and validation splits
    found as train.py finds them. None when that is not the case (the classifier's evaluation stands)."""
    if not (knn or linear_probe):
        return None
    check_embeddable(checkpoint)
    if not os.path.isdir(checkpoint):  # a timm folder is a folder
        return None
    loaded = load_model_file(checkpoint, overrides)
    if loaded.kind != "timm":
        return None
    if data_root is not None:
        loaded.cfg.data.root = data_root
    sources = scan_sources(loaded.cfg)
    if set(sources.classes) == set(loaded.classes):
        return None
    log.info("%s: its %d-class head is not the data's %d classes: features only (no top1)", checkpoint,
             len(loaded.classes), len(sources.classes))
    runtime = prediction_runtime(loaded, None, None)
    cfg = loaded.cfg
    model = embedding_module(loaded, runtime.device, cfg.train.channels_last, fold=False)
    embedder = Embedder(loaded, runtime, model, DeviceInput.from_config(cfg, runtime.device, runtime.amp_dtype),
                        loaded.eval_transform(), digest="")
    figures = figures_of(embedder, sources.train_index, f"{cfg.data.root} ({cfg.data.train_split})",
                         sources.val_index, len(sources.classes), knn, linear_probe)
    return {**figures, "checkpoint": str(loaded.path), "model_format": loaded.kind, "classes": sources.classes,
            "features_only": True}


def features_line(figures: dict) -> str:
    return "   ".join(f"{name} {figures[key]:.2f}%" for key, name in
                      (("knn_top1", f"knn_top1 (k={figures.get('knn_k')})"), ("linear_probe_top1", "linear_probe_top1"))
                      if key in figures)


def check_embeddable(checkpoint: str) -> None:
    """ConfigError (exit 2) before the evaluation for a model file whose features cannot be read: a .pt2
    program, an ONNX file without the `embedding` output."""
    kind = format_of(checkpoint).name
    if kind == "pt2" or (kind == "onnx" and os.path.isfile(checkpoint)
                         and load_model_file(checkpoint).build_embedding is None):
        raise ConfigError(f"--knn / --linear-probe: {checkpoint} gives logits only; evaluate the checkpoint, a timm "
                          f"folder, or an ONNX file written by export.py --embedding")


def report_features_only(figures: dict, json_path: Optional[str]) -> None:
    from imgcls.core.files import write_json

    print(f"{figures['checkpoint']} (features only, {figures['num_samples']} image(s)): {features_line(figures)}")
    if json_path:
        write_json(figures, json_path)
        print(f"wrote {json_path}")


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
    errors: list = None         # the misclassified images, worst first (commands/evaluate.py); None: not the task's
    representation: dict = None  # --knn / --linear-probe: knn_top1, linear_probe_top1 (commands/evaluate.py)
    precision_recall: dict = None  # single-label: average_precision (per class), pr_auc_macro
    scored: tuple = None         # single-label: ([N, C] probabilities as infer.py writes them, [N] labels)
    split: dict = None          # a class-incremental checkpoint: old_top1, new_top1, old_classes


def class_split(confusion: Optional[torch.Tensor], old_classes: Optional[list[str]]) -> Optional[dict]:
    """Top-1 over the evaluated images of the old classes and of the new ones (rows: true classes), for a
    checkpoint that records which of its classes are old (a class-incremental run's best.pt)."""
    if not old_classes or confusion is None:
        return None
    old = len(old_classes)
    counts, hits = confusion.sum(dim=1).double(), confusion.diagonal().double()

    def top1(part: slice) -> Optional[float]:
        seen = float(counts[part].sum())
        return 100.0 * float(hits[part].sum()) / seen if seen else None

    return {"old_top1": top1(slice(0, old)), "new_top1": top1(slice(old, None)), "old_classes": list(old_classes)}


def split_line(split: dict) -> str:
    figures = [f"{name} classes top1 {'-' if split[key] is None else f'{split[key]:.2f}%'}"
               for name, key in (("old", "old_top1"), ("new", "new_top1"))]
    return f"class-incremental: {len(split['old_classes'])} old classes; " + ", ".join(figures)


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
    scored = scored_outputs(predictor, recorded, tta) if calibrated and len(recorded) else None
    if scored is not None:
        pr = single_label_precision_recall(*scored, loaded.classes)
        for name, entry in per_class.items():
            entry["average_precision"] = pr["average_precision"][name]
    return EvalResult(metrics, per_class, confusion, loaded.classes, skipped, settings, task, trust, reliability, rows,
                      predictor.delimiter, errors, representation_figures(predictor, index, knn, linear_probe),
                      pr if scored is not None else None, scored, class_split(confusion, loaded.old_classes))


def scored_outputs(predictor: Predictor, outputs, log_probs: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A single-label evaluation's [N, C] float32 probabilities, the numbers infer.py writes (calibrated by the
    stored temperature; --tta's are log-probabilities), and the [N] labels."""
    temperature = None if log_probs else predictor.temperature
    probs = predictor.task.probabilities(outputs.logits.float().numpy(), temperature)
    return torch.from_numpy(probs), outputs.labels


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
    from imgcls.core.files import write_json

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
    if result.split:
        print(split_line(result.split))
    if json_path:
        doc = task.eval_document(result.metrics, result.per_class, result.confusion, result.classes,
                                 skipped_files=result.skipped_files, **(result.precision_recall or {}),
                                 **(result.trust or {}), **figures,
                                 **(result.split or {}), **s)
        write_json(doc, json_path)
        written = [json_path]
        if result.confusion is not None:
            written.append(draw_confusion(result.confusion, result.classes, confusion_png_path(json_path)))
        if result.scored is not None:
            written.append(draw_precision_recall(*result.scored, result.classes, result.precision_recall,
                                                 pr_png_path(json_path)))
        print(f"wrote {' and '.join(map(str, written))}")
        if result.errors is not None:

            errors_csv, errors_html = write_errors(result.errors, json_path)
            print(f"wrote {len(result.errors)} misclassified image(s) to {errors_csv} and {errors_html}")
    if predictions_path:
        task.write_rows(result.rows, predictions_path, result.classes, 5, result.delimiter, ["target"])
        print(f"wrote {predictions_path}")
    if reliability_path and result.trust:
        t = result.trust
        png = draw_reliability(result.reliability, reliability_path, t["ece"], t["ece_uncalibrated"], t["temperature"])
        print(f"wrote {png}")
        if result.scored is not None and not json_path:  # the precision-recall curves beside it, where no --json
            pr_png = draw_precision_recall(*result.scored, result.classes, result.precision_recall,
                                           pr_png_path(reliability_path))
            print(f"wrote {pr_png}")
