"""The model behind serve.py: opened, prepared and run exactly as infer.py runs it (the same decode and
eval preprocessing, BatchNorm folded, channels_last, normalisation, precision), one request's image
decoded on its own (`decode`) and many classified together (`classify`) in a batch padded to a fixed
shape, with infer.py's result rows.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from PIL import Image

from commands.infer import inference_model, inference_runtime, result_rows
from commands.infer_multilabel import applied_thresholds, tag_rows
from commands.infer_trust import (ScoreRecorder, TrustOptions, apply_reject, build_rejector, check_trust_options)
from core.errors import ConfigError, ImageDecodeError
from data.transforms import EvalTransform, read_source
from engine.evaluation.evaluate import predict, predict_tags
from engine.evaluation.rejection import Rejector, classifier_name
from engine.model_io.checkpoint_files import preprocessing_record
from engine.model_io.model_file import ModelFile
from engine.model_io.model_files import load_model_file
from engine.runtime.device import DeviceInput, precision_name

log = logging.getLogger("serve")


class BadImage(Exception):
    """A request body that is no usable image: `kind` names the problem for the JSON error."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


def classify_decode_error(message: str) -> str:
    """The kind of problem PIL or the decoder reported (an ImageDecodeError's message)."""
    if "DecompressionBomb" in message:
        return "decompression_bomb"
    if "truncated" in message or "broken data stream" in message or "premature end" in message.lower():
        return "truncated_image"
    if "cannot identify image file" in message or "UnidentifiedImageError" in message:
        return "not_an_image"
    return "unreadable_image"


def batch_shapes(max_batch: int) -> list[int]:
    """The padded batch sizes the model sees: powers of two below `max_batch`, and `max_batch` itself. A few
    fixed shapes (cudnn tunes each once), and one waiting request is not padded to the largest."""
    shapes, size = [], 1
    while size < max_batch:
        shapes.append(size)
        size *= 2
    return shapes + [max_batch]


def padded_size(n: int, shapes: list[int]) -> int:
    return next(size for size in shapes if size >= n)


def decode_image(body: bytes, transform: EvalTransform, max_pixels: Optional[int]) -> torch.Tensor:
    """infer.py's decode and eval preprocessing of one image's bytes: uint8 [3, S, S]. BadImage when the
    bytes are empty, not an image, truncated, or above `max_pixels` (PIL's decompression-bomb limit, also
    for the JPEGs that torchvision decodes without PIL)."""
    if not body:
        raise BadImage("empty_body", "the request carried no image bytes")
    try:
        width, height = read_source(body).size
        if max_pixels is not None and width * height > max_pixels:
            raise BadImage("decompression_bomb", f"{width}x{height} = {width * height} pixels, above the limit of "
                                                 f"{max_pixels} (PIL.Image.MAX_IMAGE_PIXELS)")
        return transform(body)
    except (ImageDecodeError, OSError) as err:
        message = str(err).removeprefix("<image bytes>: ")
        raise BadImage(classify_decode_error(message), message) from err


@dataclass
class ServedModel:
    model_file: ModelFile
    model: torch.nn.Module
    device_input: DeviceInput
    transform: EvalTransform
    topk: int
    max_batch: int
    shapes: list[int]
    temperature: Optional[float] = None       # the calibration stored with the model (infer.py's `prob`)
    rejector: Optional[Rejector] = None       # --reject / --reject-below
    scores: Optional[ScoreRecorder] = None    # the reject scores of the batch being classified

    @classmethod
    def load(cls, checkpoint: str, topk: int, max_batch: int, device_setting: str = "auto",
             host=None, trust: Optional[TrustOptions] = None) -> "ServedModel":
        """Open `checkpoint` and set up as infer.py does (device, precision, threads, the folded model, the
        stored temperature, the reject scorer of `trust`)."""
        loaded = load_model_file(checkpoint)
        trust = trust or TrustOptions()
        if loaded.multilabel and trust.rejecting:
            raise ConfigError("--reject / --reject-below: not for multi-label models (each tag is called at its "
                              "tuned threshold)")
        check_trust_options(loaded, trust)
        runtime = inference_runtime(loaded, device_setting, None, host)
        device, amp_dtype = runtime.device, runtime.amp_dtype
        model = loaded.build_model(device, channels_last=True)
        head_name = classifier_name(model)  # found before folding, as infer.py does
        model = inference_model(loaded, device, model=model)
        rejector = build_rejector(loaded, trust, head_name is not None)
        scores = ScoreRecorder(model, rejector, head_name) if rejector is not None else None
        if loaded.fixed_batch is not None and max_batch != loaded.fixed_batch:
            log.warning("%s was exported for a fixed batch of %d: batches of %d, not --max-batch %d", loaded.path,
                        loaded.fixed_batch, loaded.fixed_batch, max_batch)
            max_batch = loaded.fixed_batch
        shapes = [max_batch] if loaded.fixed_batch is not None else batch_shapes(max_batch)
        device_input = DeviceInput.from_config(loaded.cfg, device, amp_dtype, channels_last=True)
        return cls(loaded, model, device_input, loaded.eval_transform(), min(topk, len(loaded.classes)), max_batch,
                   shapes, (loaded.calibration or {}).get("temperature"), rejector, scores)

    @property
    def classes(self) -> list[str]:
        return self.model_file.classes

    def decode(self, body: bytes) -> torch.Tensor:
        return decode_image(body, self.transform, Image.MAX_IMAGE_PIXELS)

    def classify(self, images: list[torch.Tensor], names: list[Optional[str]]) -> list[dict]:
        """infer.py's rows for decoded images, run as one batch padded with zero images to a fixed shape."""
        n = len(images)
        batch = torch.stack(images)
        pad = padded_size(n, self.shapes) - n
        if pad:
            batch = torch.cat([batch, batch.new_zeros((pad, *batch.shape[1:]))])
        item = (batch, torch.ones(n, dtype=torch.bool), torch.arange(n), [""] * n)
        loaded = self.model_file
        if loaded.multilabel:
            preds = predict_tags(self.model, [item], self.device_input, len(self.classes))
            return tag_rows(names, preds, self.classes, applied_thresholds(loaded.thresholds, None, len(self.classes)),
                            loaded.cfg.data.label_delimiter)
        if self.scores is not None:
            self.scores.clear()  # one batch at a time (the model thread): its scores only
        preds = predict(self.model, [item], self.device_input, self.topk, self.temperature, on_logits=self.scores)
        rows = result_rows(names, preds, self.classes)
        if self.rejector is not None:
            apply_reject(rows, self.scores.all_scores(), self.rejector)
        return rows

    def warm_up(self) -> None:
        """One pass per batch shape before the first request (allocator, oneDNN/cudnn choices)."""
        size = self.transform.img_size
        for shape in self.shapes:
            self.classify([torch.zeros(3, size, size, dtype=torch.uint8)] * shape, [None] * shape)

    def health(self) -> dict:
        cfg = self.model_file.cfg
        return {"status": "ok", "model": cfg.model.name, "model_format": self.model_file.kind,
                "checkpoint": self.model_file.path.name,  # the name only: /health needs no key "epoch": self.model_file.epoch,
                "num_classes": len(self.classes), "classes": list(self.classes), "topk": self.topk,
                "preprocessing": preprocessing_record(cfg), "device": str(self.device_input.device),
                "precision": precision_name(self.device_input.amp_dtype), "batch_shapes": self.shapes}
