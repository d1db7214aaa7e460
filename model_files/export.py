"""Shipping a trained checkpoint in one of the export formats (model_files/formats/: ONNX, a
torch.export program, a timm model folder). Each carries the class names and the eval preprocessing, and is
read back and checked against the checkpoint's PyTorch model on a few images before export.py reports
success."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from core.errors import ConfigError, ExportError, ImageDecodeError
from core.file_modes import follow_umask
from data.listing.folder import list_images
from data.transforms import normalize_batch
from model_files.model_file import ModelFile
from model_files.checkpoint_files import build_eval_model
from model_files.formats import FORMATS
from model_files.loading import load_model_file
from model_files.metadata import export_metadata

log = logging.getLogger(__name__)

MAX_PROB_DIFF = 1e-4   # fp32: an exported graph agrees with PyTorch to float rounding, far below this
CHECK_IMAGES = 8


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
    kind = FORMATS[fmt]
    if kind.suffix is not None and output.suffix.lower() != kind.suffix:
        raise ConfigError(f"--output {output}: a {fmt} export must end in {kind.suffix} (eval.py and infer.py "
                          f"tell the kinds apart by it)")
    if not kind.folder and output.is_dir():
        raise ConfigError(f"--output {output} is a folder; name the {kind.suffix} file to write")
    if kind.folder and output.exists() and not output.is_dir():
        raise ConfigError(f"--output {output} is a file; {kind.description} is a folder")
    return output


def export_checkpoint(loaded: ModelFile, fmt: str, output: Path, batch: Optional[int]) -> ExportReport:
    """Write `loaded` as `fmt` to `output` (batch None: any batch size), read it back and compare it with
    the checkpoint's model. ExportError (exit 1) when the exporter fails or the outputs disagree."""
    output.parent.mkdir(parents=True, exist_ok=True)
    FORMATS[fmt].write(loaded, output, batch, export_metadata(loaded, batch))
    follow_umask(output)
    return check_export(loaded, fmt, output, batch)


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

    def probs(logits: torch.Tensor) -> torch.Tensor:  # the probabilities infer.py reports
        return torch.from_numpy(loaded.task.probabilities(logits.numpy()))

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
