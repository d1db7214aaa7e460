"""Where export.py may write: never over an existing export unless asked (`--overwrite`), never over or
among other files, and never into a run directory (its checkpoints, lock and logs are the run's own)."""
from __future__ import annotations

from pathlib import Path

from imgcls.core.errors import ConfigError
from imgcls.model_files.formats.base import ModelFormat

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
