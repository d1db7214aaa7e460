"""serve.py for ONNX exports without torch or torchvision (the slim serving image: onnxruntime, Pillow,
NumPy, FastAPI/uvicorn): onnxruntime's session and the HTTP glue only. The metadata checks
(model_files.stored_metadata), the eval preprocessing (data.eval_preprocessing) and the rows (the tasks'
tasks/rows.py: calibrated `prob`, the energy reject option, multi-label tags) are the ones the torch path
uses; served by the same HTTP app (serving.app) and server (serving.server.GracefulServer).

An ONNX model written by export.py, opened without torch: onnxruntime's session (set up as
model_files.formats.onnx.onnx_session sets it up) and the imgcls metadata export.py stores in the
model's metadata_props, read back and checked by model_files.stored_metadata, the same checks every path
that opens a model file makes.

The model behind serve.py without torch: an ONNX export run by onnxruntime on the CPU, with the methods
serving.app calls on serving.model.ServedModel (`decode`, `classify`, `warm_up`, `health`, `max_batch`). The
preprocessing is data.eval_preprocessing's description of the export's record, run in PIL and NumPy; the
rows and the reject option are the task's own (tasks/rows.py), which the torch path makes its rows with.

serve.py without torch: the ONNX-only model (serving.slim) behind the same app and server
(warm-up before the port opens, SIGTERM drains and exits 0)."""
from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import uvicorn
from PIL import Image

from imgcls.config import Config
from imgcls.core.errors import CheckpointError, ConfigError, ImageDecodeError
from imgcls.data.eval_preprocessing import EvalPreprocessing
from imgcls.data.images import open_image, oriented_size
from imgcls.model_files.stored_metadata import check_output_count, metadata_from_onnx_props, read_metadata
from imgcls.serving import BadImage, batch_shapes, classify_decode_error, padded_size
from imgcls.serving.app import ServeSettings, create_app
from imgcls.serving.server import GRACEFUL_SHUTDOWN_S, GracefulServer, open_index
from imgcls.tasks import task_of
from imgcls.tasks.base import Predictions, Task
from imgcls.tasks.rows import applied_thresholds, energy_score, reject_rows

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
REJECT_SCORE_OUTPUT = "reject_score"  # as evaluation/rejection.py names it: the checkpoint's reject score


@dataclass
class OnnxExport:
    path: Path
    session: object
    cfg: Config                                  # the training config with the checked eval preprocessing
    classes: list[str]
    epoch: Optional[int]
    fixed_batch: Optional[int]
    temperature: Optional[float]                 # the calibration stored with the model (`prob`)
    reject_threshold: Optional[float]            # the stored threshold of `reject_method` (--reject)
    tag_thresholds: Optional[list[float]]        # a multi-label model's per-class thresholds
    source_digest: Optional[str] = None          # export.py --embedding: the checkpoint's sha256
    reject_method: str = REJECT_METHOD           # the graph's own reject score (`reject_score`) or energy
    checkpoint_method: Optional[str] = None      # the checkpoint's score where the export has only energy

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
        scored = (calibration.get("score_output") == REJECT_SCORE_OUTPUT
                  and REJECT_SCORE_OUTPUT in [o.name for o in session.get_outputs()])
        method = calibration["method"] if scored else REJECT_METHOD
        return cls(path, session, stored.cfg, stored.classes, stored.epoch, fixed_batch,
                   calibration.get("temperature"), (calibration.get("thresholds") or {}).get(method),
                   stored.thresholds, metadata.get("source_digest"), method, calibration.get("checkpoint_method"))

    @property
    def task(self) -> Task:
        """The training's task (data.task), from the export's config."""
        return task_of(self.cfg)

    @property
    def model_name(self) -> str:
        return self.cfg.model.name

    def logits(self, batch: np.ndarray) -> np.ndarray:
        return self.session.run(None, {self.session.get_inputs()[0].name: batch})[0]

    def logits_and_scores(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The logits and the reject scores of `reject_method` (the graph's output, or energy)."""
        if self.reject_method == REJECT_METHOD:
            logits = self.logits(batch)
            return logits, energy_score(logits)
        logits, scores = self.session.run(["logits", REJECT_SCORE_OUTPUT], {self.session.get_inputs()[0].name: batch})
        return logits, scores

    @property
    def embeds(self) -> bool:
        """Whether export.py --embedding wrote the file (an output named `embedding`)."""
        return EMBEDDING_OUTPUT in [o.name for o in self.session.get_outputs()]

    def embeddings(self, batch: np.ndarray) -> np.ndarray:
        """The `embedding` output, L2-normalised (as embed.py's vectors)."""
        vectors = self.session.run([EMBEDDING_OUTPUT], {self.session.get_inputs()[0].name: batch})[0]
        return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)

log = logging.getLogger("serve")


SOURCE_NAME = "<image bytes>"   # how the torch path names a request's image in its messages


@dataclass
class OnnxServedModel:
    export: OnnxExport
    preprocess: EvalPreprocessing
    topk: int
    max_batch: int
    shapes: list[int]
    reject_threshold: Optional[float] = None   # --reject / --reject-below: the export's reject score threshold

    @classmethod
    def load(cls, checkpoint: str, topk: int, max_batch: int, reject: bool = False,
             reject_below: Optional[float] = None) -> "OnnxServedModel":
        """Open the export (CheckpointError / ConfigError, exit 2) with the checks serve.py's torch path makes."""
        export = OnnxExport.open(checkpoint)
        rejecting = reject or reject_below is not None
        if rejecting:
            export.task.check_supported("--reject")
        if reject and reject_below is None and export.checkpoint_method:
            raise ConfigError(f"--reject: {export.path} computes no {export.checkpoint_method} score, which its "
                              f"checkpoint rejects by, only the {REJECT_METHOD} score of its logits; export it again "
                              f"with this version of export.py, or reject by {REJECT_METHOD} explicitly with "
                              f"--reject-below X")
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
        task's rows of the calibrated probabilities, the reject option where it is on (the export's own
        score: the checkpoint's, or energy)."""
        n = len(images)
        batch = np.stack(images)
        pad = padded_size(n, self.shapes) - n
        if pad:
            batch = np.concatenate([batch, np.zeros((pad, *batch.shape[1:]), dtype=batch.dtype)])
        rejecting = self.reject_threshold is not None
        inputs = self.preprocess.normalise(batch)
        logits, scores = self.export.logits_and_scores(inputs) if rejecting else (self.export.logits(inputs), None)
        logits = logits[:n]
        task, cfg = self.export.task, self.export.cfg
        preds = Predictions(task.outputs(logits, self.topk, self.export.temperature), np.ones(n, dtype=bool))
        thresholds = applied_thresholds(self.export.tag_thresholds, None, len(self.classes))
        rows = task.rows(names, preds, self.classes, thresholds, cfg.data.label_delimiter)
        if rejecting:
            reject_rows(rows, scores[:n], self.reject_threshold)
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

log = logging.getLogger("serve")


CPU_DEVICES = ("auto", "cpu")


def serve_onnx(checkpoint: str, host: str, port: int, settings: ServeSettings, topk: int, device: str,
               reject: bool = False, reject_below: Optional[float] = None, index_dir: Optional[str] = None) -> int:
    if device not in CPU_DEVICES:
        raise ConfigError(f"--device {device}: the ONNX-only server runs onnxruntime on the CPU (auto or cpu)")
    index = open_index(index_dir)
    served = OnnxServedModel.load(checkpoint, topk, settings.max_batch, reject, reject_below)
    if index is not None:
        if not served.embeds:
            raise ConfigError(f"--index {index_dir}: {checkpoint} has no 'embedding' output; export it with "
                              f"export.py --embedding")
        from imgcls.embedding.index import check_index_model

        check_index_model(index, Path(index_dir), checkpoint, served.digest)
    settings.max_batch = served.max_batch
    served.warm_up()
    if index is not None:
        from imgcls.embedding.index import check_index_dim

        blank = np.zeros((3, served.preprocess.img_size, served.preprocess.img_size), np.uint8)
        check_index_dim(index, Path(index_dir), checkpoint, served.embed([blank]).shape[1])
    log.info("%s (%s, %d classes) on the CPU with onnxruntime (no torch), batches of up to %d (shapes %s), "
             "waiting up to %g ms for a batch, %d decode threads%s", served.export.path, served.export.model_name,
             len(served.classes), served.max_batch, served.shapes, settings.max_wait_ms, settings.decode_workers,
             ", API key required" if settings.api_key else "")
    config = uvicorn.Config(create_app(served, settings, index), host=host, port=port, access_log=False,
                            log_level="warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="on")
    GracefulServer(config).run()
    return 0
