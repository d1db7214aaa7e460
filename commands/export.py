"""export.py's work: read a train.py checkpoint, export it, check the export and report."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from core.errors import CheckpointError
from engine.model_io.checkpoint_files import read_checkpoint
from engine.model_io.export import check_output_path, export_checkpoint
from engine.model_io.model_file import KIND_NAMES
from engine.model_io.model_files import model_file_kind


def run_export(checkpoint: str, fmt: str, output: str, batch: Optional[int]) -> int:
    """Export `checkpoint` as `fmt` to `output` (batch None: any batch size); returns the exit status."""
    kind = model_file_kind(checkpoint)
    if kind != "checkpoint" and Path(checkpoint).exists():
        raise CheckpointError(f"--checkpoint {checkpoint} is {KIND_NAMES[kind]}; export.py takes a checkpoint "
                              f"written by train.py (best.pt or last.pt)")
    path = check_output_path(fmt, output)
    if fmt == "timm":
        batch = None  # weights: any batch
    loaded = read_checkpoint(checkpoint)
    report = export_checkpoint(loaded, fmt, path, batch)
    batch_text = "any batch" if report.batch is None else f"batch {report.batch}"
    print(f"wrote {report.path} ({fmt}, {batch_text}, {len(loaded.classes)} classes, "
          f"input {loaded.cfg.data.img_size}px) from {loaded.path} (epoch {loaded.epoch})")
    print(f"check: max |probability difference| {report.max_prob_diff:.2e} vs the checkpoint's PyTorch model "
          f"(limit 1e-04), top-1 agrees on {report.top1_agree}/{report.num_images} images from "
          f"{report.images_from}")
    return 0
