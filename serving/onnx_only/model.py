"""The model behind serve.py without torch: an ONNX export run by onnxruntime on the CPU, with the methods
serving.app calls on serving.model.ServedModel (`decode`, `classify`, `warm_up`, `health`, `max_batch`) and
the same rows."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
from PIL import Image

from core.errors import ConfigError
from serving.batch_shapes import batch_shapes, padded_size
from serving.onnx_only.export_file import REJECT_METHOD, OnnxExport
from serving.onnx_only.preprocess import EvalPreprocess
from serving.onnx_only.rows import label_rows, energy, reject, tag_rows

log = logging.getLogger("serve")
DEFAULT_TAG_THRESHOLD = 0.5   # a multi-label export without tuned thresholds (tasks/multi_label_metrics.py)


@dataclass
class OnnxServedModel:
    export: OnnxExport
    preprocess: EvalPreprocess
    topk: int
    max_batch: int
    shapes: list[int]
    reject_threshold: Optional[float] = None   # --reject / --reject-below: the energy score threshold

    @classmethod
    def load(cls, checkpoint: str, topk: int, max_batch: int, reject: bool = False,
             reject_below: Optional[float] = None) -> "OnnxServedModel":
        """Open the export (CheckpointError / ConfigError, exit 2) with the checks serve.py's torch path makes."""
        export = OnnxExport.open(checkpoint)
        rejecting = reject or reject_below is not None
        if rejecting:
            export.task.check_supported("--reject")
        if reject and reject_below is None and export.reject_threshold is None:
            raise ConfigError(f"--reject: {export.path} stores no reject threshold (train.py stores one in best.pt "
                              f"after training; last.pt and older files have none); pass --reject-below X "
                              f"({REJECT_METHOD} score: logsumexp of the logits) or use best.pt")
        threshold = None
        if rejecting:
            threshold = float(reject_below) if reject_below is not None else float(export.reject_threshold)
        if export.fixed_batch is not None and max_batch != export.fixed_batch:
            log.warning("%s was exported for a fixed batch of %d: batches of %d, not --max-batch %d", export.path,
                        export.fixed_batch, export.fixed_batch, max_batch)
            max_batch = export.fixed_batch
        shapes = [max_batch] if export.fixed_batch is not None else batch_shapes(max_batch)
        preprocess = EvalPreprocess.from_record(export.preprocessing, Image.MAX_IMAGE_PIXELS)
        return cls(export, preprocess, min(topk, len(export.classes)), max_batch, shapes, threshold)

    @property
    def classes(self) -> list[str]:
        return self.export.classes

    def decode(self, body: bytes) -> np.ndarray:
        return self.preprocess.decode(body)

    def classify(self, images: list[np.ndarray], names: list[Optional[str]]) -> list[dict]:
        """serve.py's rows for decoded images, run as one batch padded with zero images to a fixed shape."""
        n = len(images)
        batch = np.stack(images)
        pad = padded_size(n, self.shapes) - n
        if pad:
            batch = np.concatenate([batch, np.zeros((pad, *batch.shape[1:]), dtype=batch.dtype)])
        logits = self.export.logits(self.preprocess.normalise(batch))[:n]
        return ROWS[self.export.task.label_format](self, names, logits)

    @property
    def embeds(self) -> bool:
        return self.export.embeds

    @property
    def digest(self) -> str:
        """The checkpoint the export was written from (export.py --embedding records its sha256)."""
        return self.export.source_digest or ""

    def embed(self, images: list[np.ndarray]) -> np.ndarray:
        """L2-normalised vectors of decoded images, one batch padded to a fixed shape."""
        n = len(images)
        batch = np.stack(images)
        pad = padded_size(n, self.shapes) - n
        if pad:
            batch = np.concatenate([batch, np.zeros((pad, *batch.shape[1:]), dtype=batch.dtype)])
        return self.export.embeddings(self.preprocess.normalise(batch))[:n]

    def warm_up(self) -> None:
        """One pass per batch shape before the first request."""
        size = self.preprocess.img_size
        for shape in self.shapes:
            self.classify([np.zeros((3, size, size), dtype=np.uint8)] * shape, [None] * shape)

    def health(self) -> dict:
        e = self.export
        return {"status": "ok", "model": e.model_name, "model_format": "onnx", "checkpoint": e.path.name,
                "epoch": e.epoch, "num_classes": len(self.classes), "classes": list(self.classes), "topk": self.topk,
                "preprocessing": e.preprocessing, "device": "cpu", "precision": "fp32", "batch_shapes": self.shapes,
                "runtime": "onnxruntime"}


def class_rows(served: OnnxServedModel, names: list, logits: np.ndarray) -> list[dict]:
    """One label per image: the calibrated top-k, the reject option by energy where it is on."""
    rows = label_rows(names, logits, served.classes, served.topk, served.export.temperature)
    if served.reject_threshold is not None:
        reject(rows, energy(logits), served.reject_threshold)
    return rows


def tagged_rows(served: OnnxServedModel, names: list, logits: np.ndarray) -> list[dict]:
    """Tags: each called at its tuned threshold (0.5 where the export records none)."""
    thresholds = served.export.tag_thresholds or [DEFAULT_TAG_THRESHOLD] * len(served.classes)
    return tag_rows(names, logits, served.classes, thresholds)


# the rows of a task, by how its samples carry labels (tasks/: Task.label_format) -- numpy's, as the torch path's
ROWS = {"class": class_rows, "tags": tagged_rows}
