"""infer.py's work: classify a file list with a model file through the Predictor, in padded fixed-shape
batches, and write the task's rows (a table on stdout, CSV or JSON files)."""
from __future__ import annotations

import csv
import io
import logging
import os
import sys
from dataclasses import dataclass
from typing import Optional

from imgcls.commands.output_roles import check_infer_outputs
from imgcls.compute.device import precision_name
from imgcls.core.files import print_table, write_text_atomic
from imgcls.data.datasets import expand_inputs, inference_batches
from imgcls.data.urls import downloaded, is_url, url_name
from imgcls.model_files.checkpoint_files import find_newest_checkpoint
from imgcls.model_files.predictor import (Predictor, TrustOptions, explain_rows, extra_columns, overlay_base,
                                          overlay_name)

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 32


@dataclass(frozen=True)
class PseudoLabels:
    """--pseudo-labels FILE.csv --pseudo-threshold X: the confident rows as extra training data."""

    path: str
    threshold: float

    def write(self, rows: list[dict], classes: list[str]) -> None:
        """path (absolute), label, prob, threshold of every classified row whose calibrated prob is at least the
        threshold (a rejected image's `unknown` is no label; an image URL's row is left out: training reads files),
        with the spread over classes on stderr."""
        kept = [r for r in rows if r["error"] is None and r["label"] in classes and r["prob"] >= self.threshold
                and not is_url(r["path"])]
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["path", "label", "prob", "threshold"])
        for r in kept:
            writer.writerow([os.path.abspath(r["path"]), r["label"], float(r["prob"]), self.threshold])
        write_text_atomic(out.getvalue(), self.path)
        counts = {c: sum(1 for r in kept if r["label"] == c) for c in classes}
        spread = ", ".join(f"{c} {n}" for c, n in counts.items() if n)
        print(f"pseudo-labels: {len(kept)} of {len(rows)} image(s) at prob >= {self.threshold} ({spread or 'none'}); "
              f"wrote {self.path} (train with data.extra_train_csv={self.path})", file=sys.stderr)


def run_inference(inputs: list[str], checkpoint: Optional[str], batch_size: Optional[int], topk: int,
                  output: Optional[str], amp: Optional[str], compile_model: bool, num_workers: int,
                  device_setting: str = "auto", classes_file: Optional[str] = None,
                  trust: Optional[TrustOptions] = None, threshold: Optional[float] = None,
                  save_images: Optional[str] = None, pseudo: Optional[PseudoLabels] = None) -> int:
    """Classify every input file or image URL with a checkpoint or an exported model (ONNX, .pt2, timm folder);
    returns the exit status (0: at least one classified, 1: none). `save_images`: a folder for each classified
    image with its label drawn on it; `pseudo`: the confident rows as extra training data."""
    with downloaded(inputs) as fetched:
        return _run_inference(inputs, fetched, checkpoint, batch_size, topk, output, amp, compile_model,
                              num_workers, device_setting, classes_file, trust, threshold, save_images, pseudo)


def _run_inference(inputs, fetched, checkpoint, batch_size, topk, output, amp, compile_model, num_workers,
                   device_setting, classes_file, trust, threshold, save_images, pseudo) -> int:
    paths = expand_inputs(fetched.inputs)
    if checkpoint is None:
        checkpoint = find_newest_checkpoint("runs")
        print(f"checkpoint: {checkpoint} (the newest best.pt under runs/)", file=sys.stderr)
    else:
        print(f"checkpoint: {checkpoint}", file=sys.stderr)
    trust = trust or TrustOptions()
    local_files = [p for p in paths if p not in fetched.url_of]  # downloads sit in a private temporary folder
    check_infer_outputs(inputs, local_files, checkpoint, classes_file, output, trust.explain_dir, save_images,
                        pseudo.path if pseudo else None)
    predictor = Predictor.open(checkpoint, device_setting, amp, topk, trust, threshold, classes_file,
                               compile_model=compile_model)
    if pseudo is not None:
        predictor.task.check_supported("--pseudo-labels")
    loaded = predictor.model_file
    batch_size = fixed_batch_size(loaded, batch_size)
    log.info("classifying %d file(s) in batches of %d%s on %s (%s)", len(paths), batch_size,
             " (fixed by the export)" if loaded.fixed_batch else "", predictor.runtime.device,
             precision_name(predictor.runtime.amp_dtype))
    if threshold is not None or loaded.thresholds:
        source = (f"--threshold {threshold}" if threshold is not None else
                  "the per-class thresholds tuned in training")
        print(f"multi-label: a tag is called at {source}", file=sys.stderr)
    loader = inference_batches(paths, predictor.transform, batch_size, num_workers, predictor.runtime.device)
    try:
        rows = predictor.predict_rows(loader, paths)
    finally:
        predictor.close()
    report_trust(predictor, paths, rows, trust)
    if save_images:
        written = save_annotated(predictor.model_file, paths, rows, save_images,
                                 [fetched.url_of.get(p, p) for p in paths])
        print(f"wrote {written} annotated image(s) to {save_images}", file=sys.stderr)
    fetched.restore(rows)

    task = predictor.task
    print_table(task.format_rows(rows, predictor.delimiter))
    failed = [r for r in rows if r["error"] is not None]
    for r in failed:
        log.warning("could not read %s: %s", r["path"], r["error"])
    if output:
        task.write_rows(rows, output, predictor.classes, predictor.topk, predictor.delimiter, extra_columns(trust))
    if pseudo is not None:
        pseudo.write(rows, predictor.classes)
    classified = len(rows) - len(failed)
    print(f"classified {classified} of {len(rows)} file(s)" + (f"; {len(failed)} could not be read" if failed else "")
          + (f"; wrote {output}" if output else ""), file=sys.stderr)
    return 0 if classified else 1


def report_trust(predictor: Predictor, paths: list[str], rows: list[dict], trust: TrustOptions) -> None:
    """--reject / --reject-below: how many became `unknown`; --explain: Grad-CAM overlays."""
    rejector = predictor.rejector
    if rejector is not None:
        rejected = sum(1 for r in rows if r["error"] is None and r["label"] == "unknown" and "predicted" in r)
        classified = sum(1 for r in rows if r["error"] is None)
        print(f"rejected {rejected} of {classified} image(s) as {'unknown'!r} ({rejector.method} score < "
              f"{rejector.threshold:.4g})", file=sys.stderr)
        record = predictor.model_file.calibration or {}
        if rejector.method == record.get("method"):  # the notes measured this method (not an export's energy)
            for note in record.get("reject_notes", []):
                print(f"reject warning: {note}", file=sys.stderr)
    if trust.explain_dir:
        explain_rows(predictor.model_file, paths, rows, predictor.classes, trust.explain_dir)
        each = " (one per called tag)" if predictor.task.explains_each_label else ""
        print(f"wrote Grad-CAM overlays{each} to {trust.explain_dir}", file=sys.stderr)


def fixed_batch_size(loaded, asked: Optional[int]) -> int:
    """--batch-size, or the batch an exported model was traced for (a fixed-batch model takes no other)."""
    if loaded.fixed_batch is None:
        return asked or DEFAULT_BATCH_SIZE
    if asked is not None and asked != loaded.fixed_batch:
        log.warning("%s was exported for a fixed batch of %d: using --batch-size %d, not %d", loaded.path,
                    loaded.fixed_batch, loaded.fixed_batch, asked)
    return loaded.fixed_batch


def caption(row: dict) -> str:
    """What an annotated image says: `label 0.93`; a rejected image's would-be label beside `unknown`; a
    multi-label row's called tags with their probabilities."""
    if "labels" in row and isinstance(row["labels"], list):
        probs = row.get("probs") or {}
        return ", ".join(f"{tag} {probs.get(tag, 0.0):.2f}" for tag in row["labels"]) or "(no tag)"
    if row.get("predicted") and row["label"] != row["predicted"]:
        return f"{row['label']} (would be {row['predicted']} {row['prob']:.2f})"
    return f"{row['label']} {row['prob']:.2f}"


def save_annotated(loaded, paths: list[str], rows: list[dict], out_dir: str, names: list[str]) -> int:
    """infer.py --save-images: each classified image as an 8-bit RGB PNG in `out_dir` (longer side at most
    the overlays' limit; N-band and 16-bit images as --explain shows them) with its caption drawn on a dark
    band at the top; named `00007_stem.png` (the position keeps equal names from different folders apart,
    a URL's (`names`: the inputs as given) its path's). Returns how many were written."""
    from pathlib import Path

    from PIL import Image, ImageDraw, ImageFont

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = 0
    for i, (path, row) in enumerate(zip(paths, rows)):
        if row.get("error") is not None:
            continue
        shown = overlay_base(path, loaded.cfg.data)[-1]
        image = Image.fromarray(shown if shown.ndim == 3 else shown[..., None].repeat(3, 2)).convert("RGB")
        text = caption(row)
        font = ImageFont.load_default(size=max(10, min(image.size) // 12))
        draw = ImageDraw.Draw(image)
        left, top, right, bottom = draw.textbbox((4, 2), text, font=font)
        draw.rectangle((0, 0, min(image.width, right + 4), bottom + 3), fill=(0, 0, 0))
        draw.text((4, 2), text, fill=(255, 255, 255), font=font)
        image.save(out / overlay_name(i, url_name(names[i]) if is_url(names[i]) else path, None))
        written += 1
    return written
