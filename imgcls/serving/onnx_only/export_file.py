"""An ONNX model written by export.py, opened without torch: onnxruntime's session (set up as
model_files.formats.onnx.onnx_session sets it up) and the imgcls metadata export.py stores in the
model's metadata_props, read back and checked by model_files.stored_metadata, the same checks every path
that opens a model file makes."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from imgcls.core.config import Config
from imgcls.core.errors import CheckpointError
from imgcls.model_files.stored_metadata import check_output_count, metadata_from_onnx_props, read_metadata
from imgcls.tasks import task_of
from imgcls.tasks.base import Task

REJECT_METHOD = "energy"      # an export's reject score: its output is the logits only


def onnx_session(path: Path):
    """onnxruntime's CPU session, with the torch path's options (idle threads sleep, errors-only log)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    except Exception as err:  # onnxruntime raises its own pybind types
        reason = " ".join(str(err).split())[:300]
        raise CheckpointError(f"{path}: onnxruntime {ort.__version__} cannot load this model: {reason}") from err


def output_count(session, batch: int, img_size: int) -> int:
    """The model's outputs per image: from the graph, else from one pass over a zero batch."""
    count = session.get_outputs()[0].shape[-1]
    if isinstance(count, int):
        return count
    zeros = np.zeros((batch, 3, img_size, img_size), dtype=np.float32)
    return int(session.run(None, {session.get_inputs()[0].name: zeros})[0].shape[-1])


EMBEDDING_OUTPUT = "embedding"  # as model_files/formats/onnx.py names it (torch is not imported here)


@dataclass
class OnnxExport:
    path: Path
    session: object
    cfg: Config                                  # the training config with the checked eval preprocessing
    classes: list[str]
    epoch: Optional[int]
    fixed_batch: Optional[int]
    temperature: Optional[float]                 # the calibration stored with the model (`prob`)
    reject_threshold: Optional[float]            # the stored energy threshold (--reject)
    tag_thresholds: Optional[list[float]]        # a multi-label model's per-class thresholds
    source_digest: Optional[str] = None          # export.py --embedding: the checkpoint's sha256

    @classmethod
    def open(cls, path: str | Path) -> "OnnxExport":
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"checkpoint {path} does not exist or is not a file")
        if path.suffix.lower() != ".onnx":
            raise CheckpointError(f"{path}: not an ONNX file; without torch only ONNX exports (FILE.onnx, "
                                  f"export.py --format onnx) are served")
        session = onnx_session(path)
        shape = session.get_inputs()[0].shape
        if len(shape) != 4:
            raise CheckpointError(f"{path}: the model's input has shape {shape}; an image classifier takes "
                                  f"[N, 3, H, W]")
        if isinstance(shape[1], int) and shape[1] != 3:
            raise CheckpointError(f"{path}: the model takes {shape[1]} input channel(s) (data.channels); the slim "
                                  f"ONNX-only server reads 8-bit RGB only: serve it with serve.py, which reads "
                                  f"N-band TIFF and .npy uploads")
        metadata = metadata_from_onnx_props(session.get_modelmeta().custom_metadata_map, path)
        if metadata is None:
            raise CheckpointError(f"{path}: no imgcls metadata (not written by export.py); without torch only "
                                  f"export.py's ONNX files are served (serve other models with the full image)")
        stored = read_metadata(metadata, path)
        fixed_batch = shape[0] if isinstance(shape[0], int) else None
        check_output_count(stored.classes, output_count(session, fixed_batch or 1, stored.cfg.data.img_size),
                           str(path))
        calibration = stored.calibration or {}
        return cls(path, session, stored.cfg, stored.classes, stored.epoch, fixed_batch,
                   calibration.get("temperature"), (calibration.get("thresholds") or {}).get(REJECT_METHOD),
                   stored.thresholds, metadata.get("source_digest"))

    @property
    def task(self) -> Task:
        """The training's task (data.task), from the export's config."""
        return task_of(self.cfg)

    @property
    def model_name(self) -> str:
        return self.cfg.model.name

    def logits(self, batch: np.ndarray) -> np.ndarray:
        return self.session.run(None, {self.session.get_inputs()[0].name: batch})[0]

    @property
    def embeds(self) -> bool:
        """Whether export.py --embedding wrote the file (an output named `embedding`)."""
        return EMBEDDING_OUTPUT in [o.name for o in self.session.get_outputs()]

    def embeddings(self, batch: np.ndarray) -> np.ndarray:
        """The `embedding` output, L2-normalised (as embed.py's vectors)."""
        vectors = self.session.run([EMBEDDING_OUTPUT], {self.session.get_inputs()[0].name: batch})[0]
        return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
