"""ExecuTorch (`.pte`): the BatchNorm-folded model from torch.export, lowered to the XNNPACK delegate by
`to_edge_transform_and_lower` (fp32; `--quantize int8`: PT2E with XNNPACK's quantizer, calibrated on
validation images); run by `executorch.runtime`. The metadata rides inside the program as a constant method,
`imgcls_metadata`, returning the JSON as a uint8 tensor: what an app reads with `module.execute("imgcls_metadata")`.

ExecuTorch plans each method's memory for its largest input: a dynamic-batch program takes 1 to a bound per
call (at most DYNAMIC_MAX_BATCH, the planner may set it lower), read from the program; larger batches run in
chunks. executorch is imported only when such a file is written or opened."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable, Optional

import torch

from imgcls.core.errors import CheckpointError, ConfigError, ExportError
from imgcls.model_files.formats.base import ModelFormat, native_messages, shorten_export_error, traced_model
from imgcls.model_files.model_file import FunctionModel, ModelFile
from imgcls.model_files.stored_metadata import check_output_count, read_metadata

log = logging.getLogger(__name__)

METADATA_METHOD = "imgcls_metadata"
DYNAMIC_MAX_BATCH = 32   # the largest batch a dynamic-batch program plans memory for
# the exporters' and torchao's import-time chatter (an Enum registration warning per process)
QUIET_LOGGERS = ("torch.utils._pytree", "torch._export", "executorch")


def _quiet() -> None:
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def export_dynamic_shapes(batch: Optional[int]):
    return ({0: torch.export.Dim("batch", min=1, max=DYNAMIC_MAX_BATCH)},) if batch is None else None


def lower_to_pte(program, metadata: dict, what: str, model: torch.nn.Module) -> bytes:
    """The XNNPACK-lowered ExecuTorch program of a torch.export program, with `metadata` as a constant method."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    blob = torch.frombuffer(bytearray(json.dumps(metadata).encode()), dtype=torch.uint8)
    try:
        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()],
                                           constant_methods={METADATA_METHOD: blob})
        return edge.to_executorch().buffer
    except Exception as err:  # exir raises many types; the message names the operator
        raise ConfigError(f"--format executorch: ExecuTorch cannot lower this model{what}: "
                          f"{shorten_export_error(err, model)}") from err


def write_executorch(loaded: ModelFile, path: Path, batch: Optional[int], metadata: dict) -> None:
    """torch.export of the folded model (a dynamic batch bounded by DYNAMIC_MAX_BATCH), lowered to XNNPACK."""
    _quiet()
    model, example = traced_model(loaded, batch)
    try:
        program = torch.export.export(model, (example,), dynamic_shapes=export_dynamic_shapes(batch))
    except Exception as err:  # the exporters raise many types; their messages name the failing code
        raise ConfigError(f"--format executorch: torch.export cannot trace this model, which ExecuTorch lowers "
                          f"from: {shorten_export_error(err, model)}") from err
    path.write_bytes(lower_to_pte(program, metadata, "", model))


def write_executorch_int8(loaded: ModelFile, path: Path, batch: Optional[int], metadata: dict,
                          calibration: Callable) -> None:
    """PT2E static int8 (XNNPACK's symmetric quantizer, per-channel weights) of the folded model, its
    observers fed by `calibration()` (normalised batches), then lowered as fp32 is."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (XNNPACKQuantizer,
                                                                         get_symmetric_quantization_config)
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    _quiet()
    model, example = traced_model(loaded, batch)
    shapes = export_dynamic_shapes(batch)
    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
    try:
        prepared = prepare_pt2e(torch.export.export(model, (example,), dynamic_shapes=shapes).module(), quantizer)
        batches = 0
        with torch.no_grad():
            for images in calibration():
                prepared(images)
                batches += 1
        if batches == 0:
            raise ExportError("int8 quantization: none of the calibration images could be read")
        program = torch.export.export(convert_pt2e(prepared), (example,), dynamic_shapes=shapes)
    except ExportError:
        raise
    except Exception as err:  # torch.export and torchao raise many types; the message names the layer
        raise ExportError(f"int8 quantization (PT2E, XNNPACK quantizer) failed: "
                          f"{shorten_export_error(err, model)}") from err
    path.write_bytes(lower_to_pte(program, metadata, " in int8", model))


def runtime():
    """ExecuTorch's compiled runtime (the module `executorch.runtime` wraps). Imported directly: the wrapper's
    `portable_lib` first imports the whole exir compiler for one warning class, 8 s and more of every process
    that opens a .pte here; the compiled module alone loads in 0.03 s."""
    from executorch.extension.pybindings import _C

    return _C


def load_program(path: Path):
    """The program, its method names and its forward method; a file the runtime refuses is a CheckpointError
    with the runtime's reason."""
    compiled = runtime()
    with native_messages() as said:
        try:
            program = compiled._load_program(str(path), enable_etdump=False, debug_buffer_size=0, data_path=None,
                                             program_verification=compiled.Verification.InternalConsistency)
            names = {program.get_method_name(i) for i in range(program.num_methods())}
            forward = program.load_method("forward") if "forward" in names else None
        except Exception as err:  # the runtime raises RuntimeError with an error code; its log names why
            reason = said() or str(err)
            raise CheckpointError(f"{path}: not an ExecuTorch program the runtime loads ({reason})") from err
    if forward is None:
        raise CheckpointError(f"{path}: the ExecuTorch program has no 'forward' method (methods: "
                              f"{', '.join(sorted(names))})")
    return program, names, forward


def read_pte_metadata(program, names: set, path: Path) -> dict:
    if METADATA_METHOD not in names:
        raise CheckpointError(f"{path}: an ExecuTorch program without the {METADATA_METHOD} method (classes and "
                              f"preprocessing): not written by export.py")
    try:
        blob = program.load_method(METADATA_METHOD).call([])[0]
        metadata = json.loads(bytes(blob.to(torch.uint8).numpy()).decode())
    except (RuntimeError, ValueError, AttributeError, IndexError) as err:  # not bytes of JSON
        raise CheckpointError(f"{path}: its {METADATA_METHOD} is not JSON ({type(err).__name__})") from err
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: its {METADATA_METHOD} holds {type(metadata).__name__}, not a mapping")
    return metadata


def _pte_function(forward, capacity: int) -> Callable:
    """images -> logits through the program, in calls of at most `capacity` images (its planned memory)."""
    compiled = runtime()
    threads = torch.get_num_threads()  # the Predictor has applied the thread policy by now
    if compiled._threadpool_get_thread_count() != threads:
        compiled._unsafe_reset_threadpool(threads)

    def run(images: torch.Tensor) -> torch.Tensor:
        cpu = images.detach().to("cpu", torch.float32).contiguous()
        outputs = [forward.call([chunk.contiguous()])[0].clone() for chunk in cpu.split(capacity)]
        return torch.cat(outputs).to(images.device)
    return run


def open_executorch(path: Path, overrides: list[str]) -> ModelFile:
    program, names, forward = load_program(path)
    stored = read_metadata(read_pte_metadata(program, names, path), path, overrides)
    meta = program.method_meta("forward")
    sizes = meta.input_tensor_meta(0).sizes() if meta.num_inputs() == 1 else ()
    if len(sizes) != 4 or meta.num_outputs() < 1:
        raise CheckpointError(f"{path}: the program takes {meta.num_inputs()} input(s) of shape {list(sizes)}; an "
                              f"image classifier takes one [N, C, H, W]")
    check_output_count(stored.classes, meta.output_tensor_meta(0).sizes()[-1], str(path))
    capacity = sizes[0]

    def build(device: torch.device, channels_last: bool) -> torch.nn.Module:
        if device.type != "cpu":
            log.warning("%s: an ExecuTorch program runs on the CPU here (XNNPACK), not on %s", path, device)
        return FunctionModel(_pte_function(forward, capacity), stored.batch)
    return ModelFile("executorch", path, stored.cfg, stored.classes, stored.epoch, build, stored.batch,
                     stored.saved_val_limit, calibration=stored.calibration, thresholds=stored.thresholds)


FORMAT = ModelFormat("executorch", "an ExecuTorch program", open_executorch, suffix=".pte", traced=True,
                     write=write_executorch, staged=True)
