"""Where export.py may write: never over an existing export unless asked (`--overwrite`), never over or
among other files, and never into a run directory (its checkpoints, lock and logs are the run's own).

Shipping a trained checkpoint in one of the export formats (model_files/formats/: ONNX, a
torch.export program, an OpenVINO IR, an ExecuTorch program, a LiteRT model, a timm model folder). Each carries the class names and the eval
preprocessing, and is read back and checked against the checkpoint's PyTorch model on a few images before
export.py reports success."""
from __future__ import annotations

import logging
import os
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

from imgcls.core.errors import ConfigError, ExportError, ImageDecodeError
from imgcls.core.files import follow_umask
from imgcls.data.listing import list_images
from imgcls.data.transforms import normalize_batch
from imgcls.evaluation.rejection import LAYERS_METHOD, carries_layers_score
from imgcls.model_files.checkpoint_files import build_eval_model
from imgcls.model_files.formats import FORMATS
from imgcls.model_files.formats.base import ModelFormat
from imgcls.model_files.loading import load_model_file
from imgcls.model_files.metadata import export_metadata
from imgcls.model_files.model_file import ModelFile

# files a run directory holds (train.py writes them); one of them marks a folder as a run's
RUN_DIR_MARKERS = (".lock", "last.pt", "best.pt", "summary.json", "metrics.csv")


def run_dir_marker(folder: Path) -> str | None:
    return next((name for name in RUN_DIR_MARKERS if (folder / name).exists()), None)


def check_export_target(kind: ModelFormat, output: Path, overwrite: bool) -> None:
    """ConfigError (exit 2, before any work) for an export that would land in a run directory, replace an
    existing file without `overwrite`, or (timm) mix with other files in a folder."""
    resolved = output.resolve()  # `run/sub/..` and links name the folder they lead to
    folder = resolved if kind.folder else resolved.parent
    marker = run_dir_marker(folder) if folder.is_dir() else None
    if marker:
        raise ConfigError(f"--output {output}: {folder} is a run directory (it holds {marker}); an export never "
                          f"goes among a run's files: name a path outside it")
    if not kind.folder:
        if output.exists() and not overwrite:
            raise ConfigError(f"--output {output} exists; pass --overwrite to replace it, or name a new file")
        return
    present = sorted(p.name for p in resolved.iterdir()) if resolved.is_dir() else []
    others = [name for name in present if name not in kind.folder_files]
    if others:
        raise ConfigError(f"--output {output}: the folder holds other files ({', '.join(others[:5])}); a "
                          f"{kind.name} export goes into a new or empty folder")
    if present and not overwrite:
        raise ConfigError(f"--output {output} holds a {kind.name} export ({', '.join(present)}); pass --overwrite "
                          f"to replace it, or name a new folder")

log = logging.getLogger(__name__)


MAX_PROB_DIFF = 1e-4   # fp32: an exported graph agrees with PyTorch to float rounding, far below this


MIN_EMBEDDING_COSINE = 0.999  # --embedding: each exported vector against the checkpoint's


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
    min_embedding_cosine: Optional[float] = None  # --embedding: the least cosine, export vs checkpoint vectors
    reject_method: Optional[str] = None   # the checkpoint's reject score, where the export computes it


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


def export_checkpoint(loaded: ModelFile, fmt: str, output: Path, batch: Optional[int],
                      embedding: bool = False, reject_score: bool = True) -> ExportReport:
    """Write `loaded` as `fmt` to `output` (batch None: any batch size), read it back and compare it with
    the checkpoint's model. ExportError (exit 1) when the exporter fails or the outputs disagree.
    `embedding`: the file also outputs the pooled pre-logits features (`embedding`) and records the
    checkpoint's digest, which embed.py's index records. `reject_score`: a format that can carries the
    checkpoint's multi-layer reject score (`carries_reject`). A folder is written and checked in a hidden folder
    beside `output` and moved there whole."""
    if FORMATS[fmt].folder:
        return export_folder(loaded, fmt, output, batch)
    if FORMATS[fmt].staged:
        return export_staged(loaded, fmt, output, batch)
    output.parent.mkdir(parents=True, exist_ok=True)
    carried = reject_score and carries_reject(loaded, fmt)
    metadata = export_metadata(loaded, batch, carried)
    if embedding:
        from imgcls.model_files.model_file import file_sha256

        metadata.update(embedding=True, source_digest=file_sha256(loaded.path))
    FORMATS[fmt].write(loaded, output, batch, metadata)
    follow_umask(output)
    report = check_export(loaded, fmt, output, batch)
    if embedding:
        report.min_embedding_cosine = check_embedding_export(loaded, output)
    if carried:
        check_reject_export(loaded, output)
        report.reject_method = LAYERS_METHOD
    return report


MAX_REJECT_SCORE_DIFF = 1e-3  # relative, at least absolute: the graph scores in float32, the checkpoint in float64


def check_reject_export(loaded: ModelFile, output: Path) -> None:
    """The export's `reject_score` against the checkpoint's scorer (its stages tapped, float64) on the check
    images and on generated far-off ones; ExportError (exit 1) when they differ by more than
    MAX_REJECT_SCORE_DIFF."""
    from imgcls.evaluation.rejection import LayerTap, rejector_from_record

    images, source = check_images(loaded)
    x = normalize_batch(images, loaded.cfg.data.mean, loaded.cfg.data.std)
    x = torch.cat([x, torch.rand(x.shape, generator=torch.Generator().manual_seed(0)) * 4 - 2])  # far-off too
    reference = build_eval_model(loaded, torch.device("cpu"), channels_last=False)
    rejector = rejector_from_record(loaded.calibration)
    tap = LayerTap(reference, rejector.layer_names)
    exported = load_model_file(output).build_model(torch.device("cpu"), channels_last=False)
    try:
        with torch.inference_mode():
            want = rejector.scores(reference(x).float(), None, tap.take()).double()
            exported(x)
            got = exported.take_reject_score().double()
    finally:
        tap.close()
    worst = float(((got - want).abs() / want.abs().clamp(min=1.0)).max())
    if not worst <= MAX_REJECT_SCORE_DIFF:
        raise ExportError(f"the reject score of the export at {output} disagrees with the checkpoint's: relative "
                          f"difference {worst:.3g} > {MAX_REJECT_SCORE_DIFF:g} on {len(x)} images ({source} and "
                          f"generated ones); the file is kept for inspection")


def check_embedding_export(loaded: ModelFile, output: Path) -> float:
    """The least cosine between the export's `embedding` vectors and the checkpoint's pre-logits features
    on the check images; ExportError (exit 1) below MIN_EMBEDDING_COSINE."""
    from imgcls.models.feature_tap import features_and_logits

    images, source = check_images(loaded)
    x = normalize_batch(images, loaded.cfg.data.mean, loaded.cfg.data.std)
    reference = build_eval_model(loaded, torch.device("cpu"), channels_last=False)
    exported = load_model_file(output)
    if exported.build_embedding is None:
        raise ExportError(f"the export at {output} has no 'embedding' output; the file is kept for inspection")
    with torch.inference_mode():
        want = features_and_logits(reference, x)[0].float()
        got = exported.build_embedding(torch.device("cpu"), False)(x).float()
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=1).min().item()
    if not cosine >= MIN_EMBEDDING_COSINE:
        raise ExportError(f"the 'embedding' output of {output} disagrees with the checkpoint's features: least "
                          f"cosine {cosine:.6f} < {MIN_EMBEDDING_COSINE} on {len(x)} images from {source}; the "
                          f"file is kept for inspection")
    return cosine


@contextmanager
def staging_folder(output: Path) -> Iterator[Path]:
    """A hidden folder beside `output` (`.NAME-...`) to write and check an export in; it goes with what is
    left in it when the block ends, on an error, or on SIGTERM (export.py unwinds): never a half-written
    export at `output`."""
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output.parent, prefix=f".{output.name}-") as work:
        yield Path(work)


def publish_folder(staged: Path, output: Path, work: Path) -> None:
    """Move the export folder `staged` to `output`, whose empty folder or (--overwrite, allowed before any
    work) earlier export is moved aside into `work` first; both renames stay on one file system."""
    follow_umask(staged)
    if output.exists():
        os.rename(output, work / "previous")
    os.rename(staged, output)


def carries_reject(loaded: ModelFile, fmt: str) -> bool:
    """Whether the `fmt` export of `loaded` computes the checkpoint's multi-layer reject score: the format can
    and the checkpoint rejects by it (other exports reject by energy and record the checkpoint's method, so
    --reject refuses them)."""
    if not FORMATS[fmt].carries_reject or (loaded.calibration or {}).get("method") != LAYERS_METHOD:
        return False
    return carries_layers_score(loaded.calibration, build_eval_model(loaded, torch.device("cpu"),
                                                                     channels_last=False))


def export_folder(loaded: ModelFile, fmt: str, output: Path, batch: Optional[int]) -> ExportReport:
    """`export_checkpoint` for a folder format, staged: an export that fails its check is still moved to
    `output` for inspection, as the error says."""
    with staging_folder(output) as work:
        staged = work / "export"
        FORMATS[fmt].write(loaded, staged, batch, export_metadata(loaded, batch))
        try:
            report = check_export(loaded, fmt, staged, batch)
        except ExportError as err:
            publish_folder(staged, output, work)
            raise ExportError(str(err).replace(str(staged), str(output))) from err
        publish_folder(staged, output, work)
    report.path = output
    return report


@contextmanager
def staged_file(output: Path) -> Iterator[Path]:
    """A hidden file beside `output` (`.STEM-....SUFFIX`, the suffix that names its kind) to write and check an
    export in; removed when the block ends unless it was renamed to `output` (also on an error or SIGTERM)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=output.parent, prefix=f".{output.stem}-", suffix=output.suffix)
    os.close(handle)
    staged = Path(name)
    try:
        yield staged
    finally:
        staged.unlink(missing_ok=True)


UNPUBLISHED = "nothing was written at {output}"


def unpublished(err: ExportError, staged: Path, output: Path) -> ExportError:
    """The check's error for a staged export, which is removed: the output named, no file kept."""
    text = str(err).replace("the file is kept for inspection", UNPUBLISHED.format(output=output))
    return ExportError(text.replace(str(staged), str(output)))


def export_staged(loaded: ModelFile, fmt: str, output: Path, batch: Optional[int]) -> ExportReport:
    """`export_checkpoint` for a format written under a hidden name and renamed to `output` only once its
    check passed: a failed check or a refusal leaves nothing that looks finished."""
    with staged_file(output) as staged:
        FORMATS[fmt].write(loaded, staged, batch, export_metadata(loaded, batch))
        follow_umask(staged)
        try:
            report = check_export(loaded, fmt, staged, batch)
        except ExportError as err:
            raise unpublished(err, staged, output) from err
        os.replace(staged, output)
    report.path = output
    return report


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
    pixels = torch.randint(0, 256, (CHECK_IMAGES, d.channels, d.img_size, d.img_size), generator=generator,
                           dtype=torch.uint8)
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
