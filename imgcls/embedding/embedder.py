"""`Embedder`: a model file opened for vectors. The same runtime (device, precision, the recorded threads),
eval preprocessing and padded fixed-shape batches as infer.py's Predictor; the model gives the pooled
pre-logits features (models/feature_tap.py) instead of the logits, L2-normalised here.

How good the pooled pre-logits features are on labelled data, without the classifier head: cosine kNN
with the training split as the memory bank (a weighted vote, as DINO's evaluation: each of the k
neighbours votes exp(cosine / KNN_TEMPERATURE) for its class) and a linear probe (scikit-learn's
LogisticRegression fitted on the frozen training features). Both in percent, as eval.py's top1."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from imgcls.compute.device import DeviceInput, Runtime
from imgcls.core.errors import ConfigError, ModelOutputError
from imgcls.data.transforms import EvalTransform
from imgcls.model_files.loading import load_model_file
from imgcls.model_files.model_file import ModelFile, model_digest
from imgcls.model_files.predictor import folded, prediction_runtime
from imgcls.models.feature_tap import features_and_logits

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

log = logging.getLogger(__name__)


KNN_TEMPERATURE = 0.07


QUERY_ROWS = 1024       # queries searched at a time


PROBE_MAX_ITER = 1000


def split_features(embedder: Embedder, loader) -> tuple[np.ndarray, np.ndarray]:
    """(L2-normalised features [N, D], labels [N]) of an evaluation loader's readable images, in its order."""
    features, labels = [], []
    for images, targets, valid, _ in loader:
        keep = valid.numpy().astype(bool)
        features.append(embedder.vectors(images, len(valid))[keep])
        labels.append(targets.numpy()[keep])
    if not features:
        return np.zeros((0, 0), np.float32), np.zeros(0, np.int64)
    return np.concatenate(features), np.concatenate(labels)


def knn_top1(bank: np.ndarray, bank_labels: np.ndarray, queries: np.ndarray, labels: np.ndarray, k: int,
             num_classes: int) -> float:
    """Top-1 (%) of the weighted vote of each query's k most similar memory-bank vectors (exact search)."""
    import faiss

    index = faiss.IndexFlatIP(bank.shape[1])
    index.add(np.ascontiguousarray(bank, dtype=np.float32))
    k = min(k, len(bank))
    correct = 0
    for start in range(0, len(queries), QUERY_ROWS):
        chunk = np.ascontiguousarray(queries[start:start + QUERY_ROWS], dtype=np.float32)
        scores, rows = index.search(chunk, k)
        votes = np.zeros((len(chunk), num_classes))
        np.add.at(votes, (np.arange(len(chunk))[:, None], bank_labels[rows]), np.exp(scores / KNN_TEMPERATURE))
        correct += int((votes.argmax(1) == labels[start:start + QUERY_ROWS]).sum())
    return 100.0 * correct / max(1, len(queries))


def linear_probe_top1(train: np.ndarray, train_labels: np.ndarray, queries: np.ndarray, labels: np.ndarray) -> float:
    """Top-1 (%) of a logistic regression (L2-regularised, lbfgs) fitted on the frozen training features."""
    from sklearn.linear_model import LogisticRegression

    probe = LogisticRegression(max_iter=PROBE_MAX_ITER)
    probe.fit(train, train_labels)
    return 100.0 * float((probe.predict(queries) == labels).mean()) if len(queries) else 0.0
