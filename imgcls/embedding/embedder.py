"""`Embedder`: a model file opened for vectors. The same runtime (device, precision, the recorded threads),
eval preprocessing and padded fixed-shape batches as infer.py's Predictor; the model gives the pooled
pre-logits features (models/feature_tap.py) instead of the logits, L2-normalised here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from imgcls.core.errors import ConfigError, ModelOutputError
from imgcls.data.transforms import EvalTransform
from imgcls.model_files.digest import model_digest
from imgcls.model_files.loading import load_model_file
from imgcls.model_files.model_file import ModelFile
from imgcls.models.feature_tap import features_and_logits
from imgcls.prediction.predictor import folded, prediction_runtime
from imgcls.runtime.device import DeviceInput
from imgcls.runtime.runtime import Runtime

TORCH_KINDS = ("checkpoint", "timm")  # model files built as torch modules, whose features are tapped


class PreLogits(torch.nn.Module):
    """A classifier as a module answering its pooled pre-logits features."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return features_and_logits(self.model, images)[0]


def embedding_module(loaded: ModelFile, device: torch.device, channels_last: bool,
                     fold: bool = True) -> torch.nn.Module:
    """The model of `loaded` answering features: an ONNX file's `embedding` output, or a checkpoint's /
    timm folder's model tapped before its classifier (BatchNorm folded where `fold`). ConfigError (exit 2)
    for a model file that has no features to give."""
    if loaded.build_embedding is not None:
        return loaded.build_embedding(device, channels_last)
    if loaded.kind not in TORCH_KINDS:
        raise ConfigError(f"--checkpoint {loaded.path}: {loaded.kind} files give logits only; embeddings come "
                          f"from a checkpoint, a timm folder, or an ONNX file written by export.py --embedding")
    model = PreLogits(loaded.build_model(device, channels_last)).eval()
    return folded(model) if fold else model


@dataclass
class Embedder:
    model_file: ModelFile
    runtime: Runtime
    model: torch.nn.Module
    device_input: DeviceInput
    transform: EvalTransform
    digest: str

    @classmethod
    def open(cls, path, device_setting: Optional[str] = "auto", amp: Optional[str] = None,
             overrides: list[str] = ()) -> "Embedder":
        return cls.from_model_file(load_model_file(path, overrides), device_setting, amp)

    @classmethod
    def from_model_file(cls, loaded: ModelFile, device_setting: Optional[str] = "auto", amp: Optional[str] = None,
                        for_serving: bool = True) -> "Embedder":
        runtime = prediction_runtime(loaded, device_setting, amp)
        channels_last = True if for_serving else loaded.cfg.train.channels_last
        model = embedding_module(loaded, runtime.device, channels_last, fold=for_serving)
        device_input = DeviceInput.from_config(loaded.cfg, runtime.device, runtime.amp_dtype,
                                               channels_last=channels_last)
        return cls(loaded, runtime, model, device_input, loaded.eval_transform(), model_digest(loaded))

    @property
    def name(self) -> str:
        return self.model_file.cfg.model.name

    @torch.inference_mode()
    def vectors(self, images: torch.Tensor, n: Optional[int] = None) -> np.ndarray:
        """L2-normalised float32 vectors [n, D] of the first `n` images of a (padded) uint8 batch."""
        n = len(images) if n is None else n
        with self.device_input.autocast():
            features = self.model(self.device_input.prepare(images))
        features = features[:n].float()
        if not bool(torch.isfinite(features).all()):
            raise ModelOutputError(f"{self.model_file.path}: the model's features are not finite (NaN or "
                                   f"infinity): its weights are damaged or diverged; no vectors written")
        return torch.nn.functional.normalize(features, dim=1).cpu().numpy()

    def run(self, loader, sink: Callable) -> None:
        """infer.py's padded pass over a loader of (images, valid, indices, errors): `sink(vectors,
        valid, indices, errors)` receives each batch's rows in input order, padding dropped."""
        for images, valid, indices, reasons in loader:
            sink(self.vectors(images, len(indices)), valid.numpy(), indices.numpy(), reasons)
