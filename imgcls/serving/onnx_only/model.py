"""The model behind serve.py without torch: an ONNX export run by onnxruntime on the CPU, with the methods
serving.app calls on serving.model.ServedModel (`decode`, `classify`, `warm_up`, `health`, `max_batch`). The
preprocessing is data.eval_preprocessing's description of the export's record, run in PIL and NumPy; the
rows and the reject option are the task's own (tasks/*_rows.py), which the torch path makes its rows with."""
from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
from PIL import Image

from imgcls.core.errors import ConfigError, ImageDecodeError
from imgcls.data.eval_preprocessing import EvalPreprocessing
from imgcls.data.images import open_image, oriented_size
from imgcls.serving.batch_shapes import batch_shapes, padded_size
from imgcls.serving.errors import BadImage, classify_decode_error
from imgcls.serving.onnx_only.export_file import REJECT_METHOD, OnnxExport
from imgcls.tasks.base import Predictions
from imgcls.tasks.multi_label_rows import applied_thresholds
from imgcls.tasks.single_label_rows import energy_score, reject_rows

log = logging.getLogger("serve")
SOURCE_NAME = "<image bytes>"   # how the torch path names a request's image in its messages


@dataclass
class OnnxServedModel:
    export: OnnxExport
    preprocess: EvalPreprocessing
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
        return cls(export, EvalPreprocessing.of(export.cfg.data), min(topk, len(export.classes)), max_batch, shapes,
                   threshold)

    @property
    def classes(self) -> list[str]:
        return self.export.classes

    def decode(self, body: bytes) -> np.ndarray:
        """One request's image: BadImage when the bytes are empty, not an image, truncated, or above PIL's
        decompression-bomb limit (as serving.model.decode_image)."""
        if not body:
            raise BadImage("empty_body", "the request carried no image bytes")
        try:
            pil = open_image(io.BytesIO(body), name=SOURCE_NAME)
            width, height = oriented_size(pil)
            limit = Image.MAX_IMAGE_PIXELS
            if limit is not None and width * height > limit:
                raise BadImage("decompression_bomb", f"{width}x{height} = {width * height} pixels, above the limit "
                                                     f"of {limit} (PIL.Image.MAX_IMAGE_PIXELS)")
            return self.preprocess.decode(pil, SOURCE_NAME)
        except (ImageDecodeError, OSError) as err:
            message = str(err).removeprefix(f"{SOURCE_NAME}: ")
            raise BadImage(classify_decode_error(message), message) from err

    def classify(self, images: list[np.ndarray], names: list[Optional[str]]) -> list[dict]:
        """serve.py's rows for decoded images, run as one batch padded with zero images to a fixed shape: the
        task's rows of the calibrated probabilities, the reject option by energy where it is on."""
        n = len(images)
        batch = np.stack(images)
        pad = padded_size(n, self.shapes) - n
        if pad:
            batch = np.concatenate([batch, np.zeros((pad, *batch.shape[1:]), dtype=batch.dtype)])
        logits = self.export.logits(self.preprocess.normalise(batch))[:n]
        task, cfg = self.export.task, self.export.cfg
        preds = Predictions(task.outputs(logits, self.topk, self.export.temperature), np.ones(n, dtype=bool))
        thresholds = applied_thresholds(self.export.tag_thresholds, None, len(self.classes))
        rows = task.rows(names, preds, self.classes, thresholds, cfg.data.label_delimiter)
        if self.reject_threshold is not None:
            reject_rows(rows, energy_score(logits), self.reject_threshold)
        return rows

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
                "preprocessing": self.preprocess.record(train_img_size=e.cfg.data.img_size), "device": "cpu", "precision": "fp32", "batch_shapes": self.shapes,
                "runtime": "onnxruntime"}
