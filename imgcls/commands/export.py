"""export.py's work: read a train.py checkpoint, export it, check the export and report; with
`--quantize int8`, also quantize the ONNX export (onnxruntime) or the OpenVINO IR (NNCF) and compare it with
the fp32 one."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

from imgcls.commands.output_roles import check_export_outputs
from imgcls.core.errors import CheckpointError, ConfigError, DataTreeError
from imgcls.model_files.checkpoint_files import read_checkpoint
from imgcls.model_files.export import check_export_target, check_output_path, export_checkpoint
from imgcls.model_files.formats import DEFAULT, FORMATS, format_of
from imgcls.model_files.model_file import ModelFile


def run_export(checkpoint: str, fmt: str, output: str, batch: Optional[int], quantize: Optional[str] = None,
               calibration_images: int = 256, min_agreement: float = 0.97, overwrite: bool = False,
               embedding: bool = False) -> int:
    """Export `checkpoint` as `fmt` to `output` (batch None: any batch size; an existing output only with
    `overwrite`, never in a run directory); returns the exit status."""
    kind = format_of(checkpoint)
    if kind is not DEFAULT and Path(checkpoint).exists():
        raise CheckpointError(f"--checkpoint {checkpoint} is {kind.description}; export.py takes a checkpoint "
                              f"written by train.py (best.pt or last.pt)")
    path = check_output_path(fmt, output)
    check_export_target(FORMATS[fmt], path, overwrite)  # a run directory is named as such first
    check_export_outputs(checkpoint, output, FORMATS[fmt].folder)
    if not FORMATS[fmt].traced:
        batch = None  # weights: any batch
    loaded = read_checkpoint(checkpoint)
    if quantize == "int8":
        loaded.task.check_supported("--quantize int8")
        if fmt == "openvino":
            return run_openvino_int8_export(loaded, path, batch, calibration_images, min_agreement)
        if fmt == "executorch":
            return run_executorch_int8_export(loaded, path, batch, calibration_images, min_agreement)
        return run_int8_export(loaded, path, batch, calibration_images, min_agreement)
    report = export_checkpoint(loaded, fmt, path, batch, embedding)
    batch_text = "any batch" if report.batch is None else f"batch {report.batch}"
    print(f"wrote {report.path} ({fmt}, {batch_text}, {len(loaded.classes)} classes, "
          f"input {loaded.cfg.data.img_size}px, {loaded.cfg.data.channels} channel(s)) from {loaded.path} "
          f"(epoch {loaded.epoch})")
    print(f"check: max |probability difference| {report.max_prob_diff:.2e} vs the checkpoint's PyTorch model "
          f"(limit 1e-04), top-1 agrees on {report.top1_agree}/{report.num_images} images from "
          f"{report.images_from}")
    if report.reject_method:
        print(f"reject option: {report.reject_method} score, as the checkpoint's")
    if report.min_embedding_cosine is not None:
        print(f"check: output 'embedding' vs the checkpoint's pre-logits features: least cosine "
              f"{report.min_embedding_cosine:.6f} (limit 0.999)")
    return 0


def validation_files(loaded: ModelFile) -> tuple[list[str], list[int], str]:
    """The checkpoint's recorded validation split as (paths, labels, description), as eval.py finds it.
    ConfigError (exit 2) when it is not on disk as image files."""
    from imgcls.data.sources import eval_source

    try:
        source = eval_source(loaded.cfg.data, loaded.classes, loaded.data_source)
    except (DataTreeError, OSError) as err:
        raise ConfigError(f"--quantize int8 calibrates on the checkpoint's validation images, which are not "
                          f"readable here: {err}") from err
    paths = source.index.image_paths
    if not paths:
        raise ConfigError(f"--quantize int8 calibrates on the checkpoint's validation images: {source.described} "
                          f"holds no image files (WebDataset shards are not read for calibration)")
    return list(paths), list(source.index.labels), source.described


def run_int8_export(loaded: ModelFile, path: Path, batch: Optional[int], calibration_images: int,
                    min_agreement: float) -> int:
    """fp32 ONNX export (checked as always) to a temporary file, static int8 quantization to `path`, then the
    comparison: exit 1 (ExportError) when top-1 agreement is below `min_agreement`."""
    from imgcls.model_files.quantize import CHECK_LIMIT, check_agreement, compare_int8, quantize_int8, spread

    paths, labels, described = validation_files(loaded)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fp32-") as work:
        fp32_path = Path(work) / "fp32.onnx"
        # int8 stages move the reject score off the thresholds fit in fp32: the int8 file rejects by energy and
        # refuses --reject (recording the checkpoint's method)
        fp32 = export_checkpoint(loaded, "onnx", fp32_path, batch, reject_score=False)
        used = quantize_int8(fp32_path, path, spread(paths, calibration_images))
        checked = spread(list(zip(paths, labels)), CHECK_LIMIT)
        report = compare_int8(fp32_path, path, [p for p, _ in checked], [y for _, y in checked], described,
                              fp32_path.stat().st_size, used)
    print_int8_report(loaded, report, fp32, batch, "onnx int8, QDQ, per-channel weights", described)
    check_agreement(report, min_agreement)
    return 0


def run_openvino_int8_export(loaded: ModelFile, path: Path, batch: Optional[int], calibration_images: int,
                             min_agreement: float) -> int:
    """fp32 IR export (checked as always) and NNCF's int8 IR, both in a hidden folder beside `path`; the int8
    IR is moved to `path` once compared with the fp32 one (and kept there for inspection when the agreement
    is below `min_agreement`: exit 1)."""
    from imgcls.model_files.export import publish_folder, staging_folder
    from imgcls.model_files.quantize import CHECK_LIMIT, check_agreement, compare_int8, model_bytes, quantize_ir, spread

    paths, labels, described = validation_files(loaded)
    with staging_folder(path) as work:
        fp32_path, int8_path = work / "fp32", work / "int8"
        fp32 = export_checkpoint(loaded, "openvino", fp32_path, batch)
        used = quantize_ir(fp32_path, int8_path, spread(paths, calibration_images))
        checked = spread(list(zip(paths, labels)), CHECK_LIMIT)
        report = compare_int8(fp32_path, int8_path, [p for p, _ in checked], [y for _, y in checked], described,
                              model_bytes(fp32_path), used)
        publish_folder(int8_path, path, work)
    report.path = path
    print_int8_report(loaded, report, fp32, batch, "openvino int8, NNCF post-training quantization", described)
    check_agreement(report, min_agreement)
    return 0


def run_executorch_int8_export(loaded: ModelFile, path: Path, batch: Optional[int], calibration_images: int,
                               min_agreement: float) -> int:
    """fp32 .pte export (checked as always) in a hidden folder, PT2E int8 of the checkpoint's folded model to a
    hidden file beside `path`, compared with the fp32 program; renamed to `path` only when the agreement holds
    (below `min_agreement`: exit 1, nothing written)."""
    import torch

    from imgcls.core.errors import ExportError
    from imgcls.core.files import follow_umask
    from imgcls.model_files.export import staged_file, unpublished
    from imgcls.model_files.formats.executorch import write_executorch_int8
    from imgcls.model_files.metadata import export_metadata
    from imgcls.model_files.quantize import (CALIBRATION_BATCH, CHECK_LIMIT, CalibrationBatches, check_agreement,
                                             compare_int8, spread)

    paths, labels, described = validation_files(loaded)
    reader = CalibrationBatches(spread(paths, calibration_images), loaded, "images", batch or CALIBRATION_BATCH)

    def calibration():
        reader.rewind()
        return (torch.from_numpy(item["images"]) for item in iter(reader.get_next, None))

    with staged_file(path) as int8_path, tempfile.TemporaryDirectory(dir=path.parent, prefix=".fp32-") as work:
        fp32_path = Path(work) / "fp32.pte"
        fp32 = export_checkpoint(loaded, "executorch", fp32_path, batch)
        write_executorch_int8(loaded, int8_path, batch, export_metadata(loaded, batch), calibration)
        if reader.used == 0:
            raise ExportError(f"int8 quantization: none of the {calibration_images} calibration images could be read")
        follow_umask(int8_path)
        checked = spread(list(zip(paths, labels)), CHECK_LIMIT)
        report = compare_int8(fp32_path, int8_path, [p for p, _ in checked], [y for _, y in checked], described,
                              fp32_path.stat().st_size, reader.used)
        report.path = path
        try:
            check_agreement(report, min_agreement)
        except ExportError as err:
            raise unpublished(err, int8_path, path) from err
        os.replace(int8_path, path)
    print_int8_report(loaded, report, fp32, batch, "executorch int8, PT2E with XNNPACK's quantizer, XNNPACK", described)
    return 0


def print_int8_report(loaded: ModelFile, report, fp32, batch: Optional[int], what: str, described: str) -> None:
    """export.py's lines for an int8 export: what was written, the sizes, and the agreement with fp32."""
    batch_text = "any batch" if batch is None else f"batch {batch}"
    n = report.num_images
    print(f"wrote {report.path} ({what}, {batch_text}, {len(loaded.classes)} classes, input "
          f"{loaded.cfg.data.img_size}px, {loaded.cfg.data.channels} channel(s)) from {loaded.path} (epoch "
          f"{loaded.epoch}); calibrated on "
          f"{report.calibration_images} images")
    print(f"size: {report.int8_bytes / 1e6:.2f} MB int8 vs {report.fp32_bytes / 1e6:.2f} MB fp32 "
          f"({report.int8_bytes / report.fp32_bytes:.2f}x)")
    print(f"check: fp32 export vs checkpoint max |probability difference| {fp32.max_prob_diff:.2e}; int8 top-1 "
          f"agreement with fp32 {100 * report.agreement:.2f}% ({report.agree}/{n}), top-1 accuracy fp32 "
          f"{100 * report.fp32_correct / n:.2f}% int8 {100 * report.int8_correct / n:.2f}% on {n} images from "
          f"{described}")
