"""A `.pt2` archive read before `torch.export.load` opens it: torch's loader fully unpickles (no weights-only
restriction) any weight or constant its JSON config marks `use_pickle`, loads custom and opaque objects by
pickle, falls back to a full unpickle for sample inputs and legacy weight files that a weights-only load
refuses, and runs compiled AOTInductor code. A program export.py writes holds none of these, so
an archive that does is refused, naming the entry, before anything in it is loaded.
"""
from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import Iterator, Optional

import torch

from imgcls.core.errors import CheckpointError

# entry-name prefixes torch's loader unpickles freely (torch.export.pt2_archive.constants), and its compiled code
PICKLED_PREFIXES = ("custom_obj_", "opaque_obj_")
COMPILED_DIR = "data/aotinductor/"


def _flagged(value, where: str) -> Iterator[str]:
    """What in a parsed JSON config asks torch to unpickle: `use_pickle` set, or a custom/opaque object path."""
    if isinstance(value, dict):
        if value.get("use_pickle"):
            yield f"{where} marks '{value.get('path_name', '?')}' use_pickle"
        path_name = value.get("path_name")
        if isinstance(path_name, str) and path_name.startswith(PICKLED_PREFIXES):
            yield f"{where} names a pickled object '{path_name}'"
        for item in value.values():
            yield from _flagged(item, where)
    elif isinstance(value, list):
        for item in value:
            yield from _flagged(item, where)


def _entry_problem(archive: zipfile.ZipFile, name: str) -> Optional[str]:
    inner = name.split("/", 1)[1] if "/" in name else name  # entries sit under the archive's root folder
    if inner.startswith(COMPILED_DIR):
        return f"{name} is compiled AOTInductor code"
    if Path(inner).name.startswith(PICKLED_PREFIXES):
        return f"{name} is a pickled object"
    if inner.endswith(".json"):
        try:
            parsed = json.loads(archive.read(name))
        except (ValueError, UnicodeDecodeError):
            return f"{name} is not valid JSON"
        return next(_flagged(parsed, name), None)
    if inner.endswith(".pt"):  # sample inputs, legacy weights: torch retries these with a full unpickle
        try:
            torch.load(io.BytesIO(archive.read(name)), weights_only=True)
        except Exception as err:  # noqa: BLE001 - any refusal of a plain load means torch would unpickle freely
            return f"{name} is not plain tensors ({type(err).__name__})"
    return None


def check_pt2_archive(path: Path) -> None:
    """CheckpointError (exit 2) for a `.pt2` that torch.export.load would unpickle from, or that is no zip."""
    try:
        with zipfile.ZipFile(path) as archive:
            problems = [p for p in (_entry_problem(archive, name) for name in archive.namelist()) if p]
    except (zipfile.BadZipFile, OSError) as err:
        raise CheckpointError(f"{path}: not a torch.export program (not a .pt2 zip archive: {err})") from err
    if problems:
        raise CheckpointError(f"{path}: refused before loading, nothing in it was run: {'; '.join(problems[:3])}. "
                              f"torch.export.load would unpickle it, which can run code; export.py never writes "
                              f"such entries (export the checkpoint again with export.py --format pt2)")
