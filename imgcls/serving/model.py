"""The model behind serve.py: infer.py's Predictor (the same decode and eval preprocessing, BatchNorm
folded, channels_last, normalisation, precision, rows), one request's image decoded on its own (`decode`)
and many classified together (`classify`) in a batch padded to a fixed shape.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from PIL import Image

from imgcls.compute.device import DeviceInput, precision_name
from imgcls.core.errors import ConfigError, ImageDecodeError
from imgcls.data.transforms import EvalTransform, blank_for, read_source
from imgcls.embedding.embedder import Embedder
from imgcls.model_files.checkpoint_files import preprocessing_record
from imgcls.model_files.predictor import Predictor, TrustOptions
from imgcls.serving import BadImage, batch_shapes, classify_decode_error, padded_size

log = logging.getLogger("serve")


def decode_image(body: bytes, transform: EvalTransform, max_pixels: Optional[int]) -> torch.Tensor:
    """infer.py's decode and eval preprocessing of one image's bytes: uint8 [3, S, S] (float [N, S, S] for
    data.channels other than 3: TIFF, .npy and PNG uploads alike). BadImage when the
    bytes are empty, not an image, truncated, or above `max_pixels` (PIL's decompression-bomb limit)."""
    if not body:
        raise BadImage("empty_body", "the request carried no image bytes")
    try:
        if getattr(transform, "channels", 3) != 3 or getattr(transform, "value_range", None) is not None:
            return transform(body)  # N bands (TIFF, .npy, PNG): data.images refuses a hostile shape before decoding
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
    predictor: Predictor
    max_batch: int
    shapes: list[int]
    embedder: Optional[Embedder] = None   # /embed, /similar: the same model file's pre-logits features

    @classmethod
    def load(cls, checkpoint: str, topk: int, max_batch: int, device_setting: str = "auto",
             trust: Optional[TrustOptions] = None) -> "ServedModel":
        """Open `checkpoint` through the Predictor, as infer.py does (device, precision, threads, the folded
        model, the stored temperature, the reject scorer of `trust`)."""
        predictor = Predictor.open(checkpoint, device_setting, None, topk, trust)
        loaded = predictor.model_file
        if loaded.fixed_batch is not None and max_batch != loaded.fixed_batch:
            log.warning("%s was exported for a fixed batch of %d: batches of %d, not --max-batch %d", loaded.path,
                        loaded.fixed_batch, loaded.fixed_batch, max_batch)
            max_batch = loaded.fixed_batch
        shapes = [max_batch] if loaded.fixed_batch is not None else batch_shapes(max_batch)
        try:
            embedder = Embedder.from_model_file(loaded, device_setting)
        except ConfigError as err:  # a model file without features: /embed answers 404
            log.info("/embed and /similar are off: %s", err)
            embedder = None
        return cls(predictor, max_batch, shapes, embedder)

    @property
    def embeds(self) -> bool:
        return self.embedder is not None

    def embed(self, images: list[torch.Tensor]) -> np.ndarray:
        """The L2-normalised vectors of decoded images, run as one batch padded to a fixed shape."""
        n = len(images)
        batch = torch.stack(images)
        pad = padded_size(n, self.shapes) - n
        if pad > 0:
            batch = torch.cat([batch, batch.new_zeros((pad, *batch.shape[1:]))])
        return self.embedder.vectors(batch, n)

    @property
    def model_file(self):
        return self.predictor.model_file

    @property
    def classes(self) -> list[str]:
        return self.predictor.classes

    @property
    def device_input(self) -> DeviceInput:
        return self.predictor.device_input

    def decode(self, body: bytes) -> torch.Tensor:
        return decode_image(body, self.predictor.transform, Image.MAX_IMAGE_PIXELS)

    def classify(self, images: list[torch.Tensor], names: list[Optional[str]]) -> list[dict]:
        """infer.py's rows for decoded images, run as one batch padded with zero images to a fixed shape
        (one batch at a time: the model thread)."""
        return self.predictor.predict_images(images, names, padded_size(len(images), self.shapes))

    def warm_up(self) -> None:
        """One pass per batch shape before the first request (allocator, oneDNN/cudnn choices)."""
        size = self.predictor.transform.img_size
        for shape in self.shapes:
            self.classify([blank_for(self.predictor.transform, size)] * shape, [None] * shape)
            if self.embeds:
                self.embed([blank_for(self.predictor.transform, size)] * shape)

    def health(self) -> dict:
        cfg = self.model_file.cfg
        return {"status": "ok", "model": cfg.model.name, "model_format": self.model_file.kind,
                "checkpoint": self.model_file.path.name,  # the name only: /health needs no key
                "epoch": self.model_file.epoch,
                "num_classes": len(self.classes), "classes": list(self.classes), "topk": self.predictor.topk,
                "preprocessing": preprocessing_record(cfg), "device": str(self.device_input.device),
                "precision": precision_name(self.device_input.amp_dtype), "batch_shapes": self.shapes}
