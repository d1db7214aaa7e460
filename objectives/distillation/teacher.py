"""The teacher: loaded once from `distill.teacher` by the loaders that eval.py and `model.pretrained` use,
frozen (eval mode, no gradients), with its classes, its preprocessing and its identity (what last.pt
records so that --resume can refuse another teacher), and its predictions kept per validation image
(`TeacherPredictions`).

Sources: one of our checkpoints (a .pt file: best.pt), a timm folder (`local-dir:PATH` or a folder path, as
export.py --format timm or timm's save_for_hf write it), or a timm / `hf-hub:` model name with its pretrained
weights (the hub cache, as `model.pretrained`)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch

from core.config import eval_size
from core.errors import ConfigError
from model_files.loading import load_model_file
from models.factory import LOCAL_DIR_PREFIX, load_pretrained, pretrained_preprocessing
from models.timm_folder import weight_file


@dataclass
class Teacher:
    model: torch.nn.Module      # frozen, eval mode, on the run's device
    classes: Optional[list[str]]  # in output order; None when the source names none
    mean: list[float]
    std: list[float]
    size: int                   # its input size (its recorded eval preprocessing)
    identity: dict              # {"source", "kind", "sha256"}: what --resume compares

    @property
    def num_outputs(self) -> int:
        return int(self.identity["num_outputs"])


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def weights_sha256(model: torch.nn.Module) -> str:
    """A digest of the model's tensors (names, shapes, dtypes and values), for a teacher that is not one file."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def teacher_kind(source: str) -> str:
    if source.startswith(LOCAL_DIR_PREFIX) or Path(source).expanduser().is_dir():
        return "timm folder"
    if Path(source).expanduser().is_file():
        return "checkpoint"
    return "timm model"


def output_count(model: torch.nn.Module, size: int, device: torch.device) -> int:
    with torch.no_grad():
        return int(model(torch.zeros(1, 3, size, size, device=device)).shape[1])


def load_teacher(source: str, device: torch.device) -> Teacher:
    """The frozen teacher of `distill.teacher` on `device`. A source that does not load is a ConfigError /
    CheckpointError / ModelError (exit 2) naming it."""
    kind = teacher_kind(source)
    if kind == "timm model":
        model = load_pretrained(SimpleNamespace(name=source))
        preprocessing = pretrained_preprocessing(source, model)
        size = int(model.pretrained_cfg.get("input_size", (3, 224, 224))[-1]) if hasattr(model, "pretrained_cfg") else 224
        labels = list((getattr(model, "pretrained_cfg", None) or {}).get("label_names") or []) or None
        mean, std, classes = preprocessing["data.mean"], preprocessing["data.std"], labels
        model = model.to(device)
        digest = weights_sha256(model)
    else:
        path = Path(source.removeprefix(LOCAL_DIR_PREFIX)).expanduser()
        if kind == "checkpoint" and path.suffix.lower() in (".onnx", ".pt2"):
            raise ConfigError(f"'distill.teacher' = {source}: an exported {path.suffix} model cannot teach (the "
                              f"teacher runs in torch on the training device); use its best.pt or a timm folder")
        opened = load_model_file(path)
        model = opened.build_model(device, channels_last=False)
        mean, std, size = list(opened.cfg.data.mean), list(opened.cfg.data.std), eval_size(opened.cfg.data)
        classes = list(opened.classes)
        digest = file_sha256(path if kind == "checkpoint" else weight_file(path))
    freeze(model)
    identity = {"source": source, "kind": kind, "sha256": digest, "num_outputs": output_count(model, size, device)}
    return Teacher(model, classes, [float(m) for m in mean], [float(s) for s in std], int(size), identity)


def freeze(model: torch.nn.Module) -> None:
    """Eval mode (BatchNorm uses its running statistics, dropout is off) and no gradients, for good."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)


def class_mismatch(teacher: Teacher, classes: list[str]) -> Optional[str]:
    """Why the teacher cannot teach these classes (None when it can): another head size, no class names, or the
    first class whose name or position differs."""
    if teacher.num_outputs != len(classes):
        return (f"its classifier has {teacher.num_outputs} outputs, the student's {len(classes)} classes "
                f"({', '.join(classes[:5])}{', ...' if len(classes) > 5 else ''})")
    if teacher.classes is None:
        return ("it records no class names, so its outputs cannot be matched to the student's classes (a teacher "
                "trained here records them: its best.pt, or export.py --format timm)")
    for index, (theirs, ours) in enumerate(zip(teacher.classes, classes)):
        if theirs != ours:
            return f"class {index} is '{theirs}' for the teacher and '{ours}' for the student (names and order must match)"
    return None


MAX_BYTES = 256 << 20  # the most the kept predictions may take (an int32 per image single-label: 67M images)


class TeacherPredictions:
    """The teacher's `task.prediction` row per validation image, by the image's index in the split (this
    rank's shard only: the rows of other ranks' images are never read). `ready` once a whole pass is stored.
    A split whose rows would pass MAX_BYTES, or a batch without indices, is not kept: the teacher then runs
    at every validation."""

    def __init__(self, max_bytes: int = MAX_BYTES):
        self.max_bytes = max_bytes
        self.rows: Optional[torch.Tensor] = None
        self.ready = False    # a whole pass stored: validations read the rows instead of running the teacher
        self.given_up = False

    def usable(self) -> bool:
        return self.ready and not self.given_up

    def store(self, indices: Optional[torch.Tensor], predictions: torch.Tensor) -> None:
        if self.given_up:
            return
        if indices is None:
            self.given_up, self.rows = True, None
            return
        if len(indices) == 0:
            return
        needed = int(indices.max()) + 1  # indices come from the loader, on the host: no device sync
        if self.rows is None or needed > len(self.rows):
            row_bytes = predictions.element_size() * max(predictions[0].numel(), 1)
            if needed * row_bytes > self.max_bytes:
                self.given_up, self.rows = True, None
                return
            size = min(max(needed, 2 * len(self.rows) if self.rows is not None else needed),
                       self.max_bytes // row_bytes)
            grown = torch.zeros((size, *predictions.shape[1:]), dtype=predictions.dtype, device=predictions.device)
            if self.rows is not None:
                grown[:len(self.rows)] = self.rows
            self.rows = grown
        self.rows[indices.to(self.rows.device, non_blocking=True)] = predictions

    def lookup(self, indices: torch.Tensor) -> torch.Tensor:
        return self.rows[indices.to(self.rows.device, non_blocking=True)]

    def pass_done(self) -> None:
        """A validation pass ended normally: what it stored covers this rank's whole shard."""
        self.ready = self.ready or self.rows is not None  # rows exist once stored, never after giving up
