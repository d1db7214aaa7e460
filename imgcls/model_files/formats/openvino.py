"""An OpenVINO IR folder (`model.xml` + `model.bin`): converted from the checkpoint's torch.export program by
`openvino.convert_model`, the metadata in the IR's rt_info under `imgcls` (so `model.xml` alone carries it),
run by OpenVINO's CPU plugin. eval.py, infer.py and serve.py take the folder or its `.xml`.

openvino is imported only when such a folder is written or opened.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Callable, Optional

import torch

from imgcls.core.errors import CheckpointError, ConfigError, ExportError
from imgcls.model_files.formats.base import ModelFormat, shorten_export_error, traced_model
from imgcls.model_files.metadata import OPENVINO_RT_INFO_KEY
from imgcls.model_files.model_file import FunctionModel, ModelFile, file_sha256
from imgcls.model_files.stored_metadata import check_output_count, read_metadata

log = logging.getLogger(__name__)

IR_FILES = ("model.xml", "model.bin")
# rt_info key (under imgcls) holding the sha256 of model.bin: the weights travel beside model.xml, where the
# other formats keep their metadata in the file that holds the weights
WEIGHTS_DIGEST = "weights_sha256"
# infer.py, eval.py and serve.py run one padded batch at a time: LATENCY keeps one stream with every thread
# on it, where THROUGHPUT splits the threads over streams that only parallel requests would fill
PERFORMANCE_HINT = "LATENCY"
# the CPU plugin's default runs fp32 IR in bf16 on CPUs with AMX / AVX512-BF16; the export's check and
# infer.py's rows are those of the fp32 graph
INFERENCE_PRECISION = "f32"
# the operators a conversion error names (TorchScript's aten::x, torch.export's aten.x.default)
_OPERATORS = re.compile(r"\baten(?:::|\.)[A-Za-z_0-9]+(?:\.[A-Za-z_0-9]+)?")
# OpenVINO's shape check: "While validating node 'opset14::AvgPool avg_pool2d_2/aten.avg_pool2d.default/AvgPool ..."
_VALIDATING = re.compile(r"While validating node '\S+ ([\w.]+)/(aten\.[\w.]+)/")


def is_openvino(path: Path) -> bool:
    """An IR's .xml, or a folder holding model.xml."""
    return path.suffix.lower() == ".xml" if not path.is_dir() else (path / IR_FILES[0]).is_file()


def ir_xml(path: Path) -> Path:
    return path / IR_FILES[0] if path.is_dir() else path


def compiled_ir(model, threads: int):
    """`model` compiled for the CPU with `threads` inference threads, in fp32, for one request at a time."""
    import openvino as ov

    config = {"INFERENCE_NUM_THREADS": max(1, threads), "PERFORMANCE_HINT": PERFORMANCE_HINT,
              "INFERENCE_PRECISION_HINT": INFERENCE_PRECISION}
    return ov.Core().compile_model(model, "CPU", config)


def _ir_function(compiled) -> Callable:
    def run(images: torch.Tensor) -> torch.Tensor:
        array = images.detach().to("cpu", torch.float32).contiguous().numpy()
        return torch.from_numpy(compiled(array)[0]).to(images.device)  # outputs are copies (share_outputs off)
    run.compiled = compiled  # its settings, for whoever asks which threads and hints it runs with
    return run


def read_ir(path: Path):
    """The IR at `path` (a folder or its .xml), read by OpenVINO; CheckpointError when it cannot be."""
    import openvino as ov

    xml = ir_xml(path)
    if not xml.is_file() or not xml.with_suffix(".bin").is_file():
        raise CheckpointError(f"{path}: an OpenVINO IR needs {xml.name} and {xml.with_suffix('.bin').name} side "
                              f"by side (export.py --format openvino writes both)")
    try:
        return ov.Core().read_model(str(xml))
    except Exception as err:  # OpenVINO raises its own RuntimeError subclasses
        reason = " ".join(str(err).split())[:300]
        raise CheckpointError(f"{path}: OpenVINO {ov.get_version()} cannot read this IR: {reason}") from err


def ir_metadata(model, path: Path) -> dict:
    """The imgcls metadata of an IR export.py wrote (rt_info `imgcls`, one JSON string per key)."""
    if not model.has_rt_info([OPENVINO_RT_INFO_KEY, "classes"]):
        raise CheckpointError(f"{path}: an OpenVINO IR without imgcls metadata (rt_info '{OPENVINO_RT_INFO_KEY}': "
                              f"classes and preprocessing): not written by export.py")
    entries = model.get_rt_info([OPENVINO_RT_INFO_KEY]).astype(dict)
    try:
        return {key: json.loads(value.astype(str)) for key, value in entries.items()}
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: its imgcls metadata is not valid JSON ({err})") from err


def check_weights(metadata: dict, path: Path) -> None:
    """model.bin is the file the IR was exported with (its sha256, recorded in model.xml): another IR's
    weights copied over it, or a grown file, would run with this IR's classes and calibration
    (CheckpointError, exit 2). An IR written before the digest was recorded is opened with a warning."""
    weights = ir_xml(path).with_suffix(".bin")
    recorded = metadata.get(WEIGHTS_DIGEST)
    if recorded is None:
        log.warning("%s: the IR records no digest of %s (exported before imgcls recorded one); its weights are "
                    "not checked: export it again", path, weights.name)
        return
    found = file_sha256(weights)
    if found != recorded:
        raise CheckpointError(f"{path}: {weights.name} (sha256 {found[:16]}) is not the weights this IR was exported "
                              f"with (sha256 {str(recorded)[:16]}): it was replaced or altered; export the model "
                              f"again from its checkpoint")


def check_input_shape(model, cfg, path: Path) -> None:
    """One [N, C, H, W] input whose fixed channels and size are those of the metadata's preprocessing
    (data.channels, the eval size): else the first batch would fail inside OpenVINO (CheckpointError)."""
    shape = model.inputs[0].get_partial_shape()
    if len(model.inputs) != 1 or shape.rank.is_dynamic or shape.rank.get_length() != 4:
        raise CheckpointError(f"{path}: the IR takes {len(model.inputs)} input(s) of shape {shape}; an image "
                              f"classifier takes one [N, C, H, W]")
    wanted = {1: ("channel(s)", cfg.data.channels), 2: ("px high", cfg.data.img_size),
              3: ("px wide", cfg.data.img_size)}
    for axis, (what, value) in wanted.items():
        if shape[axis].is_static and shape[axis].get_length() != value:
            raise CheckpointError(f"{path}: the IR takes inputs of shape {shape}, its metadata images of {value} "
                                  f"{what} (data.channels {cfg.data.channels}, size {cfg.data.img_size}): the IR or "
                                  f"its metadata was altered; export the model again from its checkpoint")


def open_openvino(path: Path, overrides: list[str]) -> ModelFile:
    model = read_ir(path)
    metadata = ir_metadata(model, path)
    check_weights(metadata, path)
    stored = read_metadata(metadata, path, overrides)
    cfg, classes, saved_val_limit = stored.cfg, stored.classes, stored.saved_val_limit
    check_input_shape(model, cfg, path)
    shape = model.inputs[0].get_partial_shape()
    outputs = model.outputs[0].get_partial_shape()
    if outputs[-1].is_static:
        check_output_count(classes, outputs[-1].get_length(), str(path))
    fixed_batch = shape[0].get_length() if shape[0].is_static else None

    def build(device: torch.device, channels_last: bool) -> torch.nn.Module:
        if device.type != "cpu":
            log.warning("%s: an OpenVINO IR runs on the CPU here (OpenVINO's CPU plugin), not on %s", path, device)
        # the Predictor has applied the thread policy (train.threads, the checkpoint's count) to torch by now
        return FunctionModel(_ir_function(compiled_ir(model, torch.get_num_threads())), fixed_batch)
    return ModelFile("openvino", path, cfg, classes, stored.epoch, build, fixed_batch, saved_val_limit,
                     calibration=stored.calibration, thresholds=stored.thresholds)


def set_ir_metadata(model, metadata: dict) -> None:
    for key, value in metadata.items():
        model.set_rt_info(json.dumps(value), [OPENVINO_RT_INFO_KEY, key])


def save_ir(model, folder: Path) -> None:
    """model.xml and model.bin into `folder` (fp32 weights: the check compares them with the checkpoint)."""
    import openvino as ov

    folder.mkdir(parents=True, exist_ok=True)
    try:
        ov.save_model(model, str(folder / IR_FILES[0]), compress_to_fp16=False)
        digest = file_sha256(folder / IR_FILES[1])  # then recorded in model.xml, whose save rewrites the same bin
        model.set_rt_info(json.dumps(digest), [OPENVINO_RT_INFO_KEY, WEIGHTS_DIGEST])
        ov.save_model(model, str(folder / IR_FILES[0]), compress_to_fp16=False)
    except Exception as err:  # a full disk or an unwritable folder: OpenVINO's RuntimeError
        reason = " ".join(str(err).split())[:300]
        raise ExportError(f"openvino export to {folder} failed ({type(err).__name__}: {reason})") from err
    if file_sha256(folder / IR_FILES[1]) != digest:
        raise ExportError(f"openvino export to {folder} failed: OpenVINO wrote other weights on a second save")


def write_openvino(loaded: ModelFile, folder: Path, batch: Optional[int], metadata: dict) -> None:
    """torch.export's program of the folded model, converted by openvino.convert_model, the input shape set
    to [batch (or any), 3, S, S]; the metadata in rt_info. A layer the exporters cannot carry is a
    ConfigError (exit 2) naming it."""
    import openvino as ov

    model, example = traced_model(loaded, batch)
    shapes = ({0: torch.export.Dim("batch", min=1)},) if batch is None else None
    try:
        program = torch.export.export(model, (example,), dynamic_shapes=shapes)
    except Exception as err:  # the exporters raise many types; their messages name the failing code
        raise ConfigError(f"--format openvino: torch.export cannot trace this model, which OpenVINO converts "
                          f"from: {shorten_export_error(err, model)}") from err
    size = loaded.cfg.data.img_size
    try:
        converted = ov.convert_model(program)
        # the input size fixed, every layer's shape is checked: OpenVINO's pooling refuses a window larger than
        # its input (ResNet-D's 2x2 average pool on a 1x1 map, at 16 px), which PyTorch's ceil_mode allows
        converted.reshape({converted.inputs[0]: ov.PartialShape([batch or -1, loaded.cfg.data.channels, size, size])})
    except Exception as err:  # OpConversionFailure, GeneralFailure, RuntimeError: the message names the operators
        version = ov.get_version().split("-")[0]
        raise ConfigError(f"--format openvino: OpenVINO {version} cannot carry this model at {size} px: "
                          f"{_conversion_refusal(str(err), program)}") from err
    set_ir_metadata(converted, metadata)
    save_ir(converted, folder)


def _conversion_refusal(message: str, program) -> str:
    """The operators a conversion error names, with the layers that call them, else its last line; a shape
    OpenVINO refuses names the one node it was validating and why."""
    refused = _VALIDATING.search(message)
    if refused:
        node, operator = refused.groups()
        layers = _layers_calling(program, [operator], node)
        where = f" in layer {layers[0]}" if layers else ""
        reason = message[refused.end():].split("\n", 1)[-1].strip().split("\n", 1)[0][:200]
        return f"operator {operator}{where} refused: {reason} (export it as --format onnx or pt2)"
    summary = message.split("Summary:", 1)[-1]  # the failed operators' list, past the nodes' input details
    operators = sorted(set(_OPERATORS.findall(summary)))
    if not operators:
        lines = [line.strip() for line in message.splitlines() if line.strip()]
        return f"{lines[-1][:240] if lines else 'no reason given'} (export it as --format onnx or pt2)"
    layers = _layers_calling(program, operators)
    where = f" in layer(s) {', '.join(layers[:5])}" if layers else ""
    return f"unsupported operator(s) {', '.join(operators[:8])}{where} (export it as --format onnx or pt2)"


def _layers_calling(program, operators: list[str], node_name: Optional[str] = None) -> list[str]:
    """'name' (Class) of the innermost module around each call of `operators` (or the one node named
    `node_name`) in the torch.export graph."""
    layers = []
    for node in program.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        if node.op != "call_function" or str(node.target) not in operators or not stack:
            continue
        if node_name is not None and node.name != node_name:
            continue
        name, kind = list(stack.values())[-1]
        kind = getattr(kind, "__name__", str(kind)).rsplit(".", 1)[-1]
        label = f"'{name}' ({kind})"
        if label not in layers:
            layers.append(label)
    return layers


FORMAT = ModelFormat("openvino", "an OpenVINO IR", open_openvino, folder=True, traced=True, folder_files=IR_FILES,
                     write=write_openvino, recognises=is_openvino)
