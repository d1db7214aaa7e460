"""LiteRT (`.tflite`): the BatchNorm-folded model converted by `litert_torch.convert` (fp32, a fixed batch:
litert-torch 0.10 cannot convert a symbolic batch through timm's flatten), run by `ai_edge_litert`'s
Interpreter (its XNNPACK CPU delegate). The metadata rides in the model's own metadata table, as the entry
`imgcls` (a buffer holding the JSON), beside the converter's `min_runtime_version`.

Writing needs litert-torch (the [litert] extra, which pulls JAX); opening needs only the runtime, ai-edge-litert.
Both are imported only when such a file is written or opened."""
from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from imgcls.core.errors import CheckpointError, ConfigError
from imgcls.model_files.formats.base import ModelFormat, native_messages, shorten_export_error, traced_model
from imgcls.model_files.model_file import FunctionModel, ModelFile
from imgcls.model_files.stored_metadata import check_output_count, read_metadata

log = logging.getLogger(__name__)

METADATA_NAME = "imgcls"
FILE_IDENTIFIER = b"TFL3"  # bytes 4-8 of every TFLite flatbuffer


def with_metadata(model_bytes: bytes, metadata: dict) -> bytes:
    """The flatbuffer again, with `metadata` (JSON) as the metadata entry `imgcls` (schema: Model.metadata,
    each a name and a buffer index)."""
    import flatbuffers
    from ai_edge_litert import schema_py_generated as schema

    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs(model_bytes, 0))
    buffer = schema.BufferT()
    buffer.data = np.frombuffer(json.dumps(metadata).encode(), dtype=np.uint8)
    model.buffers.append(buffer)
    entry = schema.MetadataT()
    entry.name, entry.buffer = METADATA_NAME, len(model.buffers) - 1
    model.metadata = [m for m in (model.metadata or []) if m.name != METADATA_NAME.encode()] + [entry]
    builder = flatbuffers.Builder(len(model_bytes) + 4096)
    builder.Finish(model.Pack(builder), file_identifier=FILE_IDENTIFIER)
    return bytes(builder.Output())


def write_litert(loaded: ModelFile, path: Path, batch: Optional[int], metadata: dict) -> None:
    """litert_torch.convert of the folded model at a fixed batch, the metadata added to the flatbuffer."""
    if batch is None:
        raise ConfigError("--dynamic-batch: litert-torch converts a fixed batch only (a symbolic batch fails in "
                          "its lowering of the flatten before the classifier); use --batch-size N: infer.py and "
                          "eval.py run padded batches of N")
    model, example = traced_model(loaded, batch)
    # its progress lines go to stdout (rich), its import's and the converter's to file descriptor 2 (absl, the
    # MLIR passes): export.py prints its own
    with contextlib.redirect_stdout(io.StringIO()), native_messages() as said:
        import litert_torch

        try:
            converted = litert_torch.convert(model, (example,)).model_content()
        except Exception as err:  # torch.export, JAX and the MLIR converter raise many types
            raise ConfigError(f"--format litert: litert-torch cannot convert this model: "
                              f"{shorten_export_error(err, model)} {said()}".strip()) from err
    path.write_bytes(with_metadata(converted, metadata))


def read_tflite_metadata(data: bytes, path: Path) -> dict:
    from ai_edge_litert import schema_py_generated as schema

    model = schema.Model.GetRootAs(data, 0)
    for i in range(model.MetadataLength()):
        entry = model.Metadata(i)
        if entry.Name() != METADATA_NAME.encode():
            continue
        if not 0 <= entry.Buffer() < model.BuffersLength():
            break
        try:
            metadata = json.loads(model.Buffers(entry.Buffer()).DataAsNumpy().tobytes().decode())
        except (ValueError, AttributeError) as err:  # not bytes of JSON (an empty buffer reads as the int 0)
            raise CheckpointError(f"{path}: its {METADATA_NAME} metadata is not JSON ({type(err).__name__})") from err
        if not isinstance(metadata, dict):
            raise CheckpointError(f"{path}: its {METADATA_NAME} metadata holds {type(metadata).__name__}, not a "
                                  f"mapping")
        return metadata
    raise CheckpointError(f"{path}: a LiteRT model without {METADATA_NAME} metadata (classes and preprocessing): "
                          f"not written by export.py")


def interpreter(data: bytes, path: Path, threads: Optional[int] = None):
    """An allocated Interpreter over the model bytes; one the runtime refuses is a CheckpointError naming why."""
    from ai_edge_litert.interpreter import Interpreter

    if data[4:8] != FILE_IDENTIFIER:
        raise CheckpointError(f"{path}: not a LiteRT (TFLite) model (no {FILE_IDENTIFIER.decode()} identifier)")
    with native_messages() as said:
        try:
            loaded = Interpreter(model_content=data, num_threads=threads)
            loaded.allocate_tensors()
        except (ValueError, RuntimeError) as err:  # the runtime's verifier and allocator
            reason = f"{err} {said()}".strip()
            raise CheckpointError(f"{path}: the LiteRT runtime cannot load this model ({reason})") from err
    return loaded


def _tflite_function(runner) -> Callable:
    """images -> logits through the interpreter (its fixed batch: FunctionModel pads)."""
    source, target = runner.get_input_details()[0]["index"], runner.get_output_details()[0]["index"]

    def run(images: torch.Tensor) -> torch.Tensor:
        runner.set_tensor(source, images.detach().to("cpu", torch.float32).contiguous().numpy())
        runner.invoke()
        return torch.from_numpy(runner.get_tensor(target).copy()).to(images.device)
    return run


def open_litert(path: Path, overrides: list[str]) -> ModelFile:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read it ({err})") from err
    probe = interpreter(data, path)
    stored = read_metadata(read_tflite_metadata(data, path), path, overrides)
    inputs, outputs = probe.get_input_details(), probe.get_output_details()
    shape = [int(s) for s in inputs[0]["shape"]] if len(inputs) == 1 else []
    if len(shape) != 4 or not outputs:
        raise CheckpointError(f"{path}: the model takes {len(inputs)} input(s) of shape {shape}; an image "
                              f"classifier takes one [N, C, H, W]")
    check_output_count(stored.classes, int(outputs[0]["shape"][-1]), str(path))
    fixed_batch = shape[0]

    def build(device: torch.device, channels_last: bool) -> torch.nn.Module:
        if device.type != "cpu":
            log.warning("%s: a LiteRT model runs on the CPU here (XNNPACK), not on %s", path, device)
        # the Predictor has applied the thread policy (train.threads, the checkpoint's count) to torch by now
        return FunctionModel(_tflite_function(interpreter(data, path, torch.get_num_threads())), fixed_batch)
    return ModelFile("litert", path, stored.cfg, stored.classes, stored.epoch, build, fixed_batch,
                     stored.saved_val_limit, calibration=stored.calibration, thresholds=stored.thresholds)


FORMAT = ModelFormat("litert", "a LiteRT model", open_litert, suffix=".tflite", traced=True, write=write_litert,
                     staged=True)
