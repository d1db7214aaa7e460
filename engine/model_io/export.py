"""Shipping a trained checkpoint: an ONNX model (torch.onnx's exporter), a torch.export program (.pt2)
or a timm model folder (config.json + model.safetensors, loadable by `timm.create_model("local-dir:...",
pretrained=True)` and uploadable to the Hugging Face hub as it is). Each carries the class names and
the eval preprocessing, and is read back and checked against the checkpoint's PyTorch model on a few
images before export.py reports success.

onnx, onnxscript and onnxruntime are imported only here and by engine/model_io/model_files.py's ONNX path.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from core.errors import ConfigError, ExportError, ImageDecodeError
from core.file_modes import follow_umask
from data.listing.folder import list_images
from data.transforms import normalize_batch
from engine.model_io.model_file import ModelFile
from engine.model_io.checkpoint_files import build_eval_model, preprocessing_record
from engine.model_io.model_files import PT2_METADATA_FILE, TIMM_METADATA_KEY, export_metadata, load_model_file, onnx_metadata_props
from models.factory import TORCHVISION_PREFIX, fold_batchnorm

log = logging.getLogger(__name__)

FORMATS = ("onnx", "pt2", "timm")
SUFFIXES = {"onnx": ".onnx", "pt2": ".pt2"}
MAX_PROB_DIFF = 1e-4   # fp32: an exported graph agrees with PyTorch to float rounding, far below this
CHECK_IMAGES = 8
# the exporter's progress lines (graph passes, "No unused functions to remove") at INFO: kept quiet
EXPORTER_LOGGERS = ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript", "onnx_ir")
# pretrained_cfg entries that describe timm's published weights, not the ones we trained
PROVENANCE_KEYS = ("tag", "hf_hub_id", "hf_hub_filename", "url", "file", "source", "license", "origin",
                   "origin_url", "paper_ids", "paper_name", "notes", "state_dict")


@dataclass
class ExportReport:
    path: Path
    format: str
    batch: Optional[int]          # None: any batch size
    max_prob_diff: float          # max |p_export - p_checkpoint| over the check images and classes
    top1_agree: int
    num_images: int
    images_from: str


def check_output_path(fmt: str, output: str | Path) -> Path:
    """ConfigError (exit 2) for an output path the format cannot be written to or read back from."""
    output = Path(output)
    if fmt in SUFFIXES and output.suffix.lower() != SUFFIXES[fmt]:
        raise ConfigError(f"--output {output}: a {fmt} export must end in {SUFFIXES[fmt]} (eval.py and infer.py "
                          f"tell the kinds apart by it)")
    if fmt in SUFFIXES and output.is_dir():
        raise ConfigError(f"--output {output} is a folder; name the {SUFFIXES[fmt]} file to write")
    if fmt == "timm" and output.exists() and not output.is_dir():
        raise ConfigError(f"--output {output} is a file; a timm export is a folder (config.json + model.safetensors)")
    return output


def export_checkpoint(loaded: ModelFile, fmt: str, output: Path, batch: Optional[int]) -> ExportReport:
    """Write `loaded` as `fmt` to `output` (batch None: any batch size), read it back and compare it with
    the checkpoint's model. ExportError (exit 1) when the exporter fails or the outputs disagree."""
    output.parent.mkdir(parents=True, exist_ok=True)
    metadata = export_metadata(loaded, batch)
    if fmt == "timm":
        write_timm_folder(loaded, output, metadata)
    else:
        model = build_eval_model(loaded, torch.device("cpu"), channels_last=False)
        folded, count = fold_batchnorm(model)
        log.info("folded %d BatchNorm layers into the preceding convolutions", count)
        size = loaded.cfg.data.img_size
        example = torch.zeros(batch or 2, 3, size, size)  # a dynamic batch is traced at 2: 1 would specialise
        try:
            if fmt == "onnx":
                write_onnx(folded, example, output, batch is None, metadata)
            else:
                write_pt2(folded, example, output, batch is None, metadata)
        except Exception as err:  # the exporters raise many types; their messages name the failing code
            raise ExportError(f"{fmt} export failed: {shorten_export_error(err, model)}") from err
    follow_umask(output)
    return check_export(loaded, fmt, output, batch)


def write_onnx(model: torch.nn.Module, example: torch.Tensor, path: Path, dynamic: bool, metadata: dict) -> None:
    """torch.onnx's recommended (torch.export-based) exporter at its default opset; metadata in metadata_props."""
    if importlib.util.find_spec("onnxscript") is None:
        raise ExportError("torch.onnx's exporter needs onnxscript: pip install -r requirements.txt")

    quiet = [logging.getLogger(name) for name in EXPORTER_LOGGERS]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        program = torch.onnx.export(model, (example,), dynamo=True, verbose=False, input_names=["images"],
                                    output_names=["logits"], dynamic_shapes=({0: "batch"},) if dynamic else None)
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    program.model.metadata_props.update(onnx_metadata_props(metadata))
    program.save(str(path))


def write_pt2(model: torch.nn.Module, example: torch.Tensor, path: Path, dynamic: bool, metadata: dict) -> None:
    """torch.export.export, saved with torch.export.save; the metadata as the archive's imgcls.json."""
    shapes = ({0: torch.export.Dim("batch", min=1)},) if dynamic else None
    program = torch.export.export(model, (example,), dynamic_shapes=shapes)
    torch.export.save(program, str(path), extra_files={PT2_METADATA_FILE: json.dumps(metadata)})


def write_timm_folder(loaded: ModelFile, folder: Path, metadata: dict) -> None:
    """timm's own `save_for_hf`: model.safetensors and config.json with `architecture`, `num_classes`,
    `label_names` and `pretrained_cfg` (our input_size, interpolation, mean, std, crop_pct); our
    training config sits beside them under `imgcls`, which timm ignores."""
    name = loaded.cfg.model.name
    if name.startswith(TORCHVISION_PREFIX):
        raise ConfigError(f"--format timm: '{name}' is a torchvision model, which timm cannot build from a "
                          f"folder; export it as --format onnx or pt2")
    if loaded.cfg.model.norm != "batch":
        raise ConfigError(f"--format timm: this model was trained with model.norm={loaded.cfg.model.norm}, a layer "
                          f"swap timm's '{name}' does not make; export it as --format onnx or pt2")
    from timm.models import save_for_hf

    model = build_eval_model(loaded, torch.device("cpu"), channels_last=False)
    model.pretrained_cfg = {k: v for k, v in model.pretrained_cfg.items() if k not in PROVENANCE_KEYS}
    p = preprocessing_record(loaded.cfg)
    data_config = {"input_size": (3, p["img_size"], p["img_size"]), "interpolation": p["interpolation"],
                   "mean": tuple(p["mean"]), "std": tuple(p["std"]), "crop_pct": p["crop_pct"], "crop_mode": "center"}
    ours = {key: metadata[key] for key in ("format_version", "config", "epoch", "calibration", "thresholds")}
    try:
        save_for_hf(model, str(folder), model_config={"label_names": list(loaded.classes), TIMM_METADATA_KEY: ours},
                    safe_serialization=True, data_config=data_config)
    except Exception as err:  # safetensors raises its own SafetensorError for a full disk; OSError for the JSON
        reason = " ".join(str(err).split())[:300]
        raise ExportError(f"timm export to {folder} failed ({type(err).__name__}: {reason}); a full disk or a "
                          f"folder that cannot be written: free space or choose another --output") from err


# ---------------------------------------------------------------- the check after export


def check_images(loaded: ModelFile) -> tuple[torch.Tensor, str]:
    """Up to CHECK_IMAGES uint8 images: spread over the checkpoint's validation split where it is still
    on disk, else seeded random pixels at the model's input size."""
    d = loaded.cfg.data
    split = Path(d.root).expanduser() / d.val_split if d.root else None
    paths = list_images(split) if split is not None and split.is_dir() else []
    transform = loaded.eval_transform()
    images = []
    for path in paths[::max(1, len(paths) // CHECK_IMAGES)]:
        try:
            images.append(transform(path))
        except ImageDecodeError:
            continue
        if len(images) == CHECK_IMAGES:
            break
    if images:
        return torch.stack(images), f"{split}"
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (CHECK_IMAGES, 3, d.img_size, d.img_size), generator=generator, dtype=torch.uint8)
    return pixels, "generated random images"


def check_export(loaded: ModelFile, fmt: str, output: Path, batch: Optional[int]) -> ExportReport:
    """Read the export back the way eval.py and infer.py do and compare its probabilities with the
    checkpoint's unfolded PyTorch model in fp32; a dynamic-batch export is also run one image at a time."""
    images, source = check_images(loaded)
    x = normalize_batch(images, loaded.cfg.data.mean, loaded.cfg.data.std)
    reference = build_eval_model(loaded, torch.device("cpu"), channels_last=False)
    exported = load_model_file(output).build_model(torch.device("cpu"), channels_last=False)
    # the probabilities infer.py reports: one sigmoid per class for a multi-label model
    probs = torch.sigmoid if loaded.cfg.data.task == "multilabel" else (lambda logits: logits.softmax(1))
    with torch.inference_mode():
        want = probs(reference(x).float())
        got = probs(exported(x).float())
        diff = (got - want).abs().max().item()
        if batch is None:
            singles = probs(torch.cat([exported(x[i:i + 1]) for i in range(len(x))]).float())
            diff = max(diff, (singles - want).abs().max().item())
    agree = int((got.argmax(1) == want.argmax(1)).sum())
    report = ExportReport(output, fmt, batch, diff, agree, len(x), source)
    if not diff <= MAX_PROB_DIFF:  # also catches NaN
        raise ExportError(f"the {fmt} export at {output} disagrees with the checkpoint: max |probability "
                          f"difference| {diff:.3g} > {MAX_PROB_DIFF:g} on {len(x)} images from {source} "
                          f"(top-1 agrees on {agree}); the file is kept for inspection")
    return report


# ---------------------------------------------------------------- exporter errors, shortened

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)(?:\n[ \t]+(\S[^\n]*))?')


def shorten_export_error(err: Exception, model: torch.nn.Module) -> str:
    """The exporter's own reason in one line, with the source line and the layer it names: the exporters'
    messages run to pages of graph dumps and advice."""
    text = _ANSI.sub("", str(err))
    if "## Exception summary" in text:  # torch.onnx wraps torch.export's error in its own report
        text = text.split("## Exception summary", 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reason = re.sub(r"^<class '[\w.]+'>:\s*", "", lines[0]) if lines else type(err).__name__
    marker = text.find("The following call raised this error")
    frame = _FRAME.search(text, marker if marker >= 0 else 0) or _FRAME.search(text)
    if frame is None:
        return reason[:300]
    file, line, function, code = frame.groups()
    layer = layer_defined_at(model, file, int(line))
    where = f"in layer {layer}, " if layer else ""
    code = f": {code.strip()[:80]}" if code else ""
    return f"{reason[:200]} ({where}{Path(file).name}:{line} in {function}{code})"


def layer_defined_at(model: torch.nn.Module, file: str, line: int) -> Optional[str]:
    """'name' (Class) of the first submodule whose class's forward holds file:line."""
    for name, module in model.named_modules():
        forward = type(module).forward
        try:
            if Path(inspect.getsourcefile(forward)).resolve() != Path(file).resolve():
                continue
            source, start = inspect.getsourcelines(forward)
        except (OSError, TypeError):
            continue
        if start <= line < start + len(source):
            return f"'{name or '(the model)'}' ({type(module).__name__})"
    return None
