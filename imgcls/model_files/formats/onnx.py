"""ONNX (`.onnx`): written by torch.onnx's exporter, run by onnxruntime (the CUDA provider where installed);
the metadata in the model's metadata_props (`imgcls.*`). A file export.py did not write opens too, with the
config's preprocessing and numbered classes.

onnx, onnxscript and onnxruntime are imported only when such a file is written or opened.
"""
from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path
from typing import Callable, Optional

import torch

from imgcls.config import Config
from imgcls.core.errors import CheckpointError, ExportError
from imgcls.evaluation.rejection import REJECT_SCORE_OUTPUT, LogitsAndRejectScore
from imgcls.model_files.formats.base import ModelFormat, shorten_export_error, traced_model
from imgcls.model_files.metadata import numbered_classes, onnx_metadata_props
from imgcls.model_files.model_file import FunctionModel, ModelFile, ScoredFunctionModel
from imgcls.model_files.stored_metadata import check_output_count, eval_config, metadata_from_onnx_props, read_metadata
from imgcls.models.feature_tap import features_and_logits

log = logging.getLogger(__name__)

# the exporter's progress lines (graph passes, "No unused functions to remove") at INFO: kept quiet
EMBEDDING_OUTPUT = "embedding"  # export.py --embedding: the pooled pre-logits features, beside the logits
EXPORTER_LOGGERS = ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript", "onnx_ir")


def onnx_session(path: Path, device: torch.device = torch.device("cpu")):
    """An onnxruntime session on `device` (the CUDA provider where installed, else the CPU); a file the
    runtime refuses (not ONNX, an opset or operator it lacks) is a CheckpointError naming why."""
    import onnxruntime as ort

    providers = ["CPUExecutionProvider"]
    if device.type == "cuda":
        if "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, ("CUDAExecutionProvider", {"device_id": device.index or 0}))
        else:
            log.warning("onnxruntime has no CUDA provider here (pip install onnxruntime-gpu): running on the CPU")
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: the runtime's own warnings are not ours to show
    # idle pool threads sleep instead of spinning, leaving the cores to infer.py's decoding workers (spinning
    # threads made a 2-core machine's int8 inference slower)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(str(path), sess_options=options, providers=providers)
    except Exception as err:  # onnxruntime raises its own pybind types (InvalidProtobuf, Fail, InvalidGraph...)
        raise CheckpointError(f"{path}: onnxruntime {ort.__version__} cannot load this model: "
                              f"{_runtime_refusal(str(err))}") from err


_RUNTIME_SOURCE = re.compile(r"/onnxruntime_src/\S+:\d+ .*?\)\s")  # the C++ file and function signature
_OPSET = re.compile(r"Opset (\d+) is under development.*?till opset (\d+)", re.S)


def _runtime_refusal(message: str) -> str:
    """onnxruntime's reason in one line, an unsupported opset said plainly."""
    opset = _OPSET.search(message)
    if opset:
        return (f"the model is stamped with ONNX opset {opset.group(1)}, and this onnxruntime runs opsets up to "
                f"{opset.group(2)} (export with an older opset, or upgrade onnxruntime)")
    return " ".join(_RUNTIME_SOURCE.sub("", message).split())[:300]


def _onnx_function(session, output: Optional[str] = None, *more: str) -> Callable:
    """images -> the session's first output (the logits), or the output named `output`; with `more` names,
    the tuple of those outputs."""
    input_name = session.get_inputs()[0].name
    wanted = None if output is None else [output, *more]

    def run(images: torch.Tensor):
        array = images.detach().to("cpu", torch.float32).contiguous().numpy()
        results = [torch.from_numpy(r).to(images.device) for r in session.run(wanted, {input_name: array})]
        return tuple(results) if more else results[0]
    return run


QUANTIZED_OPS = {"QuantizeLinear", "DynamicQuantizeLinear", "QLinearConv", "QLinearMatMul", "ConvInteger",
                 "MatMulInteger"}


def is_int8_model(path: Path) -> bool:
    """Whether the graph holds quantized operators (export.py --quantize int8 writes QDQ nodes)."""
    import onnx

    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except Exception:  # noqa: BLE001 - the session has opened it; a graph onnx cannot parse is simply not checked
        return False
    return any(node.op_type in QUANTIZED_OPS for node in graph.node)


_WARNED_INT8: set = set()


def read_cpuinfo() -> Optional[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:  # not Linux: nothing to say
        return None


def warn_if_int8_is_slow_here(path: Path) -> None:
    """Once per process: an int8 model about to run on a CPU without int8 dot-product instructions."""
    from imgcls.compute.device import int8_slow_reason

    if _WARNED_INT8:
        return
    cpuinfo = read_cpuinfo()
    if cpuinfo is None:
        return
    reason = int8_slow_reason(cpuinfo)
    if reason is not None and is_int8_model(path):
        _WARNED_INT8.add(str(path))
        log.warning("%s is an int8 model: %s", path, reason)


def open_onnx(path: Path, overrides: list[str]) -> ModelFile:
    session = onnx_session(path)
    shape = session.get_inputs()[0].shape  # [batch, channels, H, W]; symbolic dims are strings
    if len(shape) != 4:
        raise CheckpointError(f"{path}: the model's input has shape {shape}; an image classifier takes [N, C, H, W]")
    fixed_batch = shape[0] if isinstance(shape[0], int) else None
    metadata = metadata_from_onnx_props(session.get_modelmeta().custom_metadata_map, path)
    stored = read_metadata(metadata, path, overrides) if metadata is not None else None
    if stored is not None:
        cfg, classes, saved_val_limit = stored.cfg, stored.classes, stored.saved_val_limit
        check_output_count(classes, _onnx_class_count(session, fixed_batch or 1, cfg.data.img_size, cfg.data.channels),
                           str(path))
    else:
        cfg, saved_val_limit = eval_config({}, _foreign_onnx_preprocessing(shape, path), overrides, str(path))
        classes = numbered_classes(_onnx_class_count(session, fixed_batch or 1, cfg.data.img_size), path)

    def build(device: torch.device, channels_last: bool) -> torch.nn.Module:
        if device.type == "cpu":
            warn_if_int8_is_slow_here(path)
        run_session = session if device.type == "cpu" else onnx_session(path, device)
        if scored:  # the checkpoint's reject score, computed by the graph beside the logits
            return ScoredFunctionModel(_onnx_function(run_session, "logits", REJECT_SCORE_OUTPUT), fixed_batch,
                                       calibration["method"])
        return FunctionModel(_onnx_function(run_session), fixed_batch)

    def build_embedding(device: torch.device, channels_last: bool) -> torch.nn.Module:
        run_session = session if device.type == "cpu" else onnx_session(path, device)
        return FunctionModel(_onnx_function(run_session, EMBEDDING_OUTPUT), fixed_batch)
    outputs = [o.name for o in session.get_outputs()]
    embeds = EMBEDDING_OUTPUT in outputs
    calibration = (stored.calibration if stored else None) or {}
    scored = calibration.get("score_output") == REJECT_SCORE_OUTPUT and REJECT_SCORE_OUTPUT in outputs
    return ModelFile("onnx", path, cfg, classes, stored.epoch if stored else None, build, fixed_batch,
                     saved_val_limit, calibration=stored.calibration if stored else None,
                     thresholds=stored.thresholds if stored else None,
                     build_embedding=build_embedding if embeds else None,
                     source_digest=(metadata or {}).get("source_digest"))


def _foreign_onnx_preprocessing(shape: list, path: Path) -> dict:
    d = Config().data
    fixed = [s for s in shape[2:] if isinstance(s, int)]
    if len(fixed) == 2 and fixed[0] != fixed[1]:
        raise CheckpointError(f"{path}: the model takes fixed {fixed[0]}x{fixed[1]} (height x width) inputs; "
                              f"images here are square (data.img_size): export it with a square or dynamic "
                              f"input size")
    square = bool(fixed)
    size = fixed[0] if square else d.img_size
    log.warning("%s has no imgcls metadata (not written by export.py): preprocessing img_size %d (%s), "
                "crop_pct %s, %s, mean %s, std %s (the config defaults otherwise; eval.py takes data.* overrides)",
                path, size, "the model's input size" if square else "the default", d.crop_pct, d.interpolation,
                d.mean, d.std)
    return {"img_size": size}


def _onnx_class_count(session, batch: int, img_size: int, channels: int = 3) -> int:
    classes = session.get_outputs()[0].shape[-1]
    if isinstance(classes, int):
        return classes
    probe = torch.zeros(batch, channels, img_size, img_size)
    return int(_onnx_function(session)(probe).shape[-1])


class ExportOutputs(torch.nn.Module):
    """What an export computes in one pass: the logits; with `embedding`, the pooled pre-logits features
    (export.py --embedding); with a reject record, the checkpoint's multi-layer reject score
    (rejection.LogitsAndRejectScore), in that order."""

    def __init__(self, model: torch.nn.Module, embedding: bool, reject_record: Optional[dict]):
        super().__init__()
        self.model = model
        self.embedding = embedding
        self.scorer = LogitsAndRejectScore(model, reject_record) if reject_record else None

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.embedding:
            features, logits = features_and_logits(self.model, images)
            outputs = [logits, features]
        else:
            outputs = [self.model(images)]
        if self.scorer is not None:
            outputs.append(self.scorer.score(images))
        return tuple(outputs)


def write_onnx(loaded: ModelFile, path: Path, batch: Optional[int], metadata: dict) -> None:
    """torch.onnx's recommended (torch.export-based) exporter at its default opset; metadata in metadata_props.
    A checkpoint whose reject option the export carries (metadata's calibration `score_output`) is exported
    with BatchNorm unfolded (the stages are tapped; onnxruntime fuses it into the convolutions itself)."""
    if importlib.util.find_spec("onnxscript") is None:
        raise ExportError("torch.onnx's exporter needs onnxscript: pip install -r requirements.txt")

    embedding = bool(metadata.get("embedding"))
    rejecting = bool((metadata.get("calibration") or {}).get("score_output"))
    names = ["logits"] + [EMBEDDING_OUTPUT] * embedding + [REJECT_SCORE_OUTPUT] * rejecting
    wrap = ((lambda model: ExportOutputs(model, embedding, loaded.calibration if rejecting else None))
            if embedding or rejecting else None)
    model, example = traced_model(loaded, batch, wrap, fold=not rejecting)
    quiet = [logging.getLogger(name) for name in EXPORTER_LOGGERS]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        program = torch.onnx.export(model, (example,), dynamo=True, verbose=False, input_names=["images"],
                                    output_names=names, dynamic_shapes=({0: "batch"},) if batch is None else None)
    except Exception as err:  # the exporters raise many types; their messages name the failing code
        raise ExportError(f"onnx export failed: {shorten_export_error(err, model)}") from err
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    program.model.metadata_props.update(onnx_metadata_props(metadata))
    program.save(str(path))


FORMAT = ModelFormat("onnx", "an ONNX model", open_onnx, suffix=".onnx", traced=True,
                    write=write_onnx, carries_reject=True)
