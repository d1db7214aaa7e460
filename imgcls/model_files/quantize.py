"""Static int8 quantization of an fp32 ONNX export (onnxruntime.quantization: QDQ format, per-channel
weights, activations calibrated on validation images), and the check of the int8 model against the fp32
one: top-1 agreement and both accuracies on up to CHECK_LIMIT validation images.

The calibration and check images are preprocessed exactly as infer.py does (the eval transform, then
`normalize_batch`); BatchNorm is already folded by the fp32 export, and onnxruntime's `quant_pre_process`
(shape inference, graph optimisation) runs before calibration, as its documentation asks.

onnx and onnxruntime are imported only inside these functions (export.py's path).

Post-training int8 quantisation of an fp32 OpenVINO IR by NNCF (`nncf.quantize`: int8 weights and
activations, ranges from the calibration images, fast bias correction), with the calibration images
preprocessed exactly as infer.py does. The check against the fp32 IR is model_files/quantize.py's
`compare_int8`, the same as the int8 ONNX path's.

nncf and openvino are imported only inside these functions (export.py's path)."""
from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

from imgcls.compute.device import DeviceInput
from imgcls.core.errors import ExportError
from imgcls.data.datasets import FileListDataset, build_inference_loader
from imgcls.data.transforms import normalize_batch
from imgcls.evaluation.evaluate import predict
from imgcls.model_files.formats.openvino import ir_metadata, read_ir, save_ir, set_ir_metadata
from imgcls.model_files.loading import load_model_file
from imgcls.model_files.model_file import ModelFile

log = logging.getLogger("export")


CHECK_LIMIT = 1000            # validation images the int8 model is compared on


CALIBRATION_BATCH = 16        # images per calibration batch of a dynamic-batch model


@dataclass
class QuantizeReport:
    path: Path
    fp32_bytes: int
    int8_bytes: int
    calibration_images: int
    num_images: int           # compared images
    agree: int                # int8 top-1 == fp32 top-1
    fp32_correct: int
    int8_correct: int
    images_from: str

    @property
    def agreement(self) -> float:
        return self.agree / self.num_images if self.num_images else 0.0


def spread(items: list, n: int) -> list:
    """Up to `n` of `items`, evenly spaced over the whole list (every class of a class-sorted split)."""
    if n >= len(items):
        return list(items)
    return [items[(i * len(items)) // n] for i in range(n)]


class CalibrationBatches:
    """onnxruntime's CalibrationDataReader protocol (`get_next` -> {input: array} or None) over image files,
    decoded and normalised as infer.py does; unreadable files are left out."""

    def __init__(self, paths: list[str], model_file: ModelFile, input_name: str, batch: int):
        self.paths = paths
        self.model_file = model_file
        self.input_name = input_name
        self.batch = batch
        self.used = 0
        self._batches = self._iterate()

    def _iterate(self) -> Iterator[dict]:
        transform = self.model_file.eval_transform()
        dataset = FileListDataset(self.paths, transform, transform.img_size)
        d = self.model_file.cfg.data
        loader = build_inference_loader(dataset, self.batch, num_workers=0, pin_memory=False)
        for images, valid, _, _ in loader:
            keep = images[:len(valid)][valid]
            if len(keep) == 0:
                continue
            if len(keep) < self.batch:  # a fixed-batch model takes only its batch: repeat the last image
                keep = torch.cat([keep, keep[-1:].expand(self.batch - len(keep), *keep.shape[1:])])
            self.used += int(valid.sum())
            yield {self.input_name: normalize_batch(keep, d.mean, d.std).numpy()}

    def get_next(self) -> Optional[dict]:
        return next(self._batches, None)

    def rewind(self) -> None:
        self.used = 0
        self._batches = self._iterate()


def quantize_int8(fp32_path: Path, output: Path, calibration_paths: list[str]) -> int:
    """Write the static int8 QDQ model of `fp32_path` to `output` (atomically, with the fp32 model's imgcls
    metadata); returns the number of calibration images used. ExportError when none could be read or
    onnxruntime fails."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quant_pre_process, quantize_static

    model_file = load_model_file(fp32_path)
    fp32 = onnx.load(str(fp32_path))
    input_name = fp32.graph.input[0].name
    batch = model_file.fixed_batch or CALIBRATION_BATCH
    reader = CalibrationBatches(calibration_paths, model_file, input_name, batch)
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=".int8-") as work:
        prepared = Path(work) / "prepared.onnx"
        quantized = Path(work) / "int8.onnx"
        try:
            quant_pre_process(str(fp32_path), str(prepared), skip_symbolic_shape=True)
            quantize_static(str(prepared), str(quantized), reader, quant_format=QuantFormat.QDQ, per_channel=True,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            calibrate_method=CalibrationMethod.MinMax)
        except Exception as err:  # onnxruntime raises many types; its message names the node
            raise ExportError(f"int8 quantization failed: {type(err).__name__}: {str(err)[:300]}") from err
        if reader.used == 0:
            raise ExportError(f"int8 quantization: none of the {len(calibration_paths)} calibration images could "
                              f"be read")
        model = onnx.load(str(quantized))
        del model.metadata_props[:]
        for key, value in {p.key: p.value for p in fp32.metadata_props}.items():
            model.metadata_props.add(key=key, value=value)
        staged = Path(work) / "final.onnx"
        onnx.save(model, str(staged))
        os.replace(staged, output)
    return reader.used


def model_bytes(path: Path) -> int:
    """A model file's size, or the sum of a model folder's files."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def compare_int8(fp32_path: Path, int8_path: Path, paths: list[str], labels: list[int], source: str,
                 fp32_bytes: int, calibration_images: int) -> QuantizeReport:
    """Run both models (any format) over `paths` as infer.py does and count top-1 agreement and correct
    labels."""
    tops = []
    valid = None
    for path in (fp32_path, int8_path):
        model_file = load_model_file(path)
        transform = model_file.eval_transform()
        loader = build_inference_loader(FileListDataset(paths, transform, transform.img_size),
                                        model_file.fixed_batch or 32, num_workers=0, pin_memory=False)
        model = model_file.build_model(torch.device("cpu"), channels_last=False)
        device_input = DeviceInput.from_config(model_file.cfg, torch.device("cpu"), None, channels_last=False)
        preds = predict(model, loader, device_input, 1)
        tops.append(torch.from_numpy(preds.top_indices[:, 0]))
        valid = preds.valid
    if valid is None or not bool(valid.any()):
        raise ExportError(f"int8 check: none of the {len(paths)} images from {source} could be read")
    target = torch.tensor(labels)[valid]
    fp32_top, int8_top = tops[0][valid], tops[1][valid]
    return QuantizeReport(int8_path, fp32_bytes, model_bytes(int8_path), calibration_images, int(valid.sum()),
                          int((fp32_top == int8_top).sum()), int((fp32_top == target).sum()),
                          int((int8_top == target).sum()), source)


def check_agreement(report: QuantizeReport, min_agreement: float) -> None:
    """ExportError (exit 1) when int8 and fp32 agree on less than `min_agreement` of the compared images."""
    if report.agreement < min_agreement:
        raise ExportError(f"the int8 model at {report.path} agrees with the fp32 model on {report.agreement:.4f} of "
                          f"{report.num_images} images, below --min-agreement {min_agreement:g} (more "
                          f"--calibration-images may help); the file is kept for inspection")

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
