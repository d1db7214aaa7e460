"""`ModelFile`: a model file opened for evaluation, prediction or export, whatever its kind (a checkpoint
written by train.py, ONNX, a torch.export program, a timm folder), and `FunctionModel`, which makes a
batch -> logits function (an onnxruntime session, an exported program) a module.

Which model made a set of vectors: the sha256 of the checkpoint file, which an export written with
export.py --embedding records (`source_digest`), so an index built from a checkpoint is searched with its
export, and a retrained or another model is told apart (search.py exits 2)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from imgcls.config import Config
from imgcls.core.settings import check_calibration_record
from imgcls.data.build import eval_transform
from imgcls.data.transforms import EvalTransform
from imgcls.tasks import task_of
from imgcls.tasks.base import Task


@dataclass
class ModelFile:
    """A model file opened for evaluation or prediction."""

    kind: str                       # its format's name (model_files/formats/): checkpoint | onnx | pt2 | openvino |
                                    # executorch | litert | timm
    path: Path
    cfg: Config
    classes: list[str]
    epoch: Optional[int]
    build: Callable                 # (device, channels_last) -> eval-mode module: normalised batch -> logits
    fixed_batch: Optional[int] = None   # the batch an exported model was traced for (None: any)
    saved_val_limit: Optional[int] = None
    threads: Optional[int] = None       # CPU threads the training run validated with (checkpoints record it)
    data_source: Optional[dict] = None  # the training run's data record (split file lists, ...; checkpoints)
    state_dict: Optional[dict] = None   # a checkpoint's weights (bare state_dict; export.py reads them)
    calibration: Optional[dict] = None  # temperature and reject record (evaluation.trust); exports: numbers only
    thresholds: Optional[list] = None   # a multi-label model's per-class thresholds tuned in training
    build_embedding: Optional[Callable] = None  # (device, channels_last) -> module: batch -> pre-logits features
                                                # (an ONNX file exported with --embedding; None: from `build`)
    source_digest: Optional[str] = None  # the sha256 of the checkpoint an export was written from (--embedding)
    old_classes: Optional[list] = None   # a class-incremental checkpoint's base classes (the first outputs)

    def __post_init__(self):
        check_calibration_record(self.calibration, self.path)

    @property
    def task(self) -> Task:
        return task_of(self.cfg)

    @property
    def fp32_only(self) -> bool:
        """onnxruntime / OpenVINO / ExecuTorch / LiteRT run the exported graph in their own runtime; autocast does
        not reach it."""
        return self.kind in ("onnx", "openvino", "executorch", "litert")

    def eval_transform(self) -> EvalTransform:
        return eval_transform(self.cfg.data)

    def build_model(self, device: torch.device, channels_last: bool) -> torch.nn.Module:
        return self.build(device, channels_last)


class FunctionModel(torch.nn.Module):
    """A batch -> logits function (an onnxruntime session, an exported program) as a module in eval mode.
    With a fixed batch, every call is cut into batches of exactly that size, the last one padded with
    zeros whose outputs are dropped."""

    def __init__(self, function: Callable, fixed_batch: Optional[int] = None):
        super().__init__()
        self.function = function  # a plain callable, not a submodule: exported programs refuse .eval()
        self.fixed_batch = fixed_batch
        self.eval()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.fixed_batch is None:
            return self.function(images)
        outputs = []
        for chunk in images.split(self.fixed_batch):
            n = len(chunk)
            if n < self.fixed_batch:
                chunk = torch.cat([chunk, chunk.new_zeros((self.fixed_batch - n, *chunk.shape[1:]))])
            outputs.append(self.function(chunk)[:n])
        return torch.cat(outputs)

class ScoredFunctionModel(FunctionModel):
    """A batch -> (logits, reject score) function (an export that carries the checkpoint's `reject_method`
    score) as a logits module; the scores of its last call wait for `take_reject_score`."""

    def __init__(self, function: Callable, fixed_batch: Optional[int], reject_method: str):
        super().__init__(function, fixed_batch)
        self.reject_method = reject_method
        self._scores: list[torch.Tensor] = []

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        self._scores = []
        step = self.fixed_batch or len(images)
        outputs = []
        for chunk in images.split(max(1, step)):
            n = len(chunk)
            if self.fixed_batch is not None and n < self.fixed_batch:
                chunk = torch.cat([chunk, chunk.new_zeros((self.fixed_batch - n, *chunk.shape[1:]))])
            logits, scores = self.function(chunk)
            outputs.append(logits[:n])
            self._scores.append(scores[:n])
        return torch.cat(outputs)

    def take_reject_score(self) -> torch.Tensor:
        scores, self._scores = self._scores, []
        return torch.cat(scores)


CHUNK_BYTES = 1 << 20


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def model_digest(loaded: ModelFile) -> str:
    """The recorded source checkpoint's digest for an --embedding export; else the file's own (a timm
    folder: its files' digests, in name order)."""
    if loaded.source_digest:
        return loaded.source_digest
    if loaded.path.is_dir():
        digest = hashlib.sha256()
        for item in sorted(p for p in loaded.path.iterdir() if p.is_file()):
            digest.update(f"{item.name}:{file_sha256(item)}\n".encode())
        return digest.hexdigest()
    return file_sha256(loaded.path)
