"""Post-training int8 quantisation of an fp32 OpenVINO IR by NNCF (`nncf.quantize`: int8 weights and
activations, ranges from the calibration images, fast bias correction), with the calibration images
preprocessed exactly as infer.py does. The check against the fp32 IR is model_files/quantize.py's
`compare_int8`, the same as the int8 ONNX path's.

nncf and openvino are imported only inside these functions (export.py's path).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Iterator

from imgcls.core.errors import ExportError
from imgcls.model_files.formats.openvino import ir_metadata, read_ir, save_ir, set_ir_metadata
from imgcls.model_files.loading import load_model_file
from imgcls.model_files.model_file import ModelFile
from imgcls.model_files.quantize import CalibrationBatches

INPUT = "images"  # the key CalibrationBatches files each batch under


class CalibrationItems:
    """nncf.Dataset's source: one normalised batch per item (one image for a dynamic-batch IR, as NNCF
    advises; the traced batch for a fixed one), decoded again on each of NNCF's passes; unreadable files are
    left out."""

    def __init__(self, paths: list[str], model_file: ModelFile, batch: int):
        self.paths = paths
        self.model_file = model_file
        self.batch_size = batch  # NNCF reads it: statistics over a batch's images for batches over 1
        self.used = 0

    def __len__(self) -> int:
        return -(-len(self.paths) // self.batch_size)

    def __iter__(self) -> Iterator:
        reader = CalibrationBatches(self.paths, self.model_file, INPUT, self.batch_size)
        for item in iter(reader.get_next, None):
            self.used = max(self.used, reader.used)  # NNCF stops reading at subset_size: counted as it goes
            yield item[INPUT]


def quantize_ir(fp32: Path, output: Path, calibration_paths: list[str]) -> int:
    """Write NNCF's int8 IR of the IR folder `fp32` to the folder `output`, with the fp32 IR's imgcls
    metadata; returns the number of calibration images used. ExportError when none could be read or NNCF
    fails."""
    import nncf

    logging.getLogger("nncf").setLevel(logging.WARNING)  # its per-step INFO lines; the progress bars stay
    model_file = load_model_file(fp32)
    model = read_ir(fp32)
    metadata = ir_metadata(model, fp32)
    items = CalibrationItems(calibration_paths, model_file, model_file.fixed_batch or 1)
    try:
        quantized = nncf.quantize(model, nncf.Dataset(items), subset_size=len(items))
    except Exception as err:  # NNCF and OpenVINO raise many types; the message names the node
        raise ExportError(f"int8 quantization (NNCF) failed: {type(err).__name__}: {str(err)[:300]}") from err
    if items.used == 0:
        raise ExportError(f"int8 quantization: none of the {len(calibration_paths)} calibration images could "
                          f"be read")
    set_ir_metadata(quantized, metadata)
    save_ir(quantized, output)
    return items.used
