"""An ONNX model written by export.py, opened without torch: onnxruntime's session (set up as
model_files.formats.onnx.onnx_session sets it up) and the imgcls metadata export.py stores in the
model's metadata_props (`imgcls.classes`, `imgcls.preprocessing`, `imgcls.config`, `imgcls.calibration`,
`imgcls.thresholds`, ...), read back as model_files.metadata reads it."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from core.errors import CheckpointError
from core.temperature import check_calibration_record
from tasks import TASKS
from tasks.base import Task
from serving.onnx_only.preprocess import PREPROCESSING_KEYS

METADATA_PREFIX = "imgcls."   # model_files.metadata.ONNX_METADATA_PREFIX
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


def read_metadata(props: dict[str, str], path: Path) -> dict:
    ours = {k[len(METADATA_PREFIX):]: v for k, v in props.items() if k.startswith(METADATA_PREFIX)}
    if "classes" not in ours:
        raise CheckpointError(f"{path}: no imgcls metadata (not written by export.py); without torch only "
                              f"export.py's ONNX files are served (serve other models with the full image)")
    try:
        return {key: json.loads(value) for key, value in ours.items()}
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: its imgcls metadata is not valid JSON ({err})") from err


def export_task(name, path: Path) -> Task:
    if name not in TASKS:
        raise CheckpointError(f"{path}: its config names data.task {name!r}, not one of {', '.join(TASKS)}")
    return TASKS[name]


EMBEDDING_OUTPUT = "embedding"  # as model_files/formats/onnx.py names it (torch is not imported here)


@dataclass
class OnnxExport:
    path: Path
    session: object
    classes: list[str]
    preprocessing: dict
    model_name: str
    epoch: Optional[int]
    fixed_batch: Optional[int]
    task: Task                                   # the training's task (data.task), from the export's config
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
        metadata = read_metadata(session.get_modelmeta().custom_metadata_map, path)
        classes = metadata.get("classes")
        if not isinstance(classes, list) or not classes or not all(isinstance(c, str) for c in classes) \
                or len(set(classes)) != len(classes):
            raise CheckpointError(f"{path}: 'classes' must be a non-empty list of distinct class names")
        preprocessing = metadata.get("preprocessing") or {}
        missing = [key for key in PREPROCESSING_KEYS if key not in preprocessing]
        if missing:
            raise CheckpointError(f"{path}: its preprocessing record lacks {', '.join(missing)}")
        config = metadata.get("config") or {}
        data = config.get("data") or {}
        calibration = metadata.get("calibration") or {}
        check_calibration_record(calibration, path)
        thresholds = metadata.get("thresholds")
        if thresholds is not None and (not isinstance(thresholds, list) or len(thresholds) != len(classes)):
            raise CheckpointError(f"{path}: 'thresholds' must be {len(classes)} numbers in [0, 1], one per class")
        stored_reject = (calibration.get("thresholds") or {}).get(REJECT_METHOD)
        return cls(path, session, list(classes), preprocessing, (config.get("model") or {}).get("name", "?"),
                   metadata.get("epoch"), shape[0] if isinstance(shape[0], int) else None,
                   export_task(data.get("task", "multiclass"), path),
                   calibration.get("temperature"), stored_reject,
                   [float(t) for t in thresholds] if thresholds is not None else None, metadata.get("source_digest"))

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
