"""Loading torch files as plain data only: `torch.load(weights_only=True)` with no fallback.

A pickle that would run code is refused with a message naming what it asked for; a damaged file gets
one line without torch's advice to retry the unsafe way. Used for checkpoints and local weight files.
"""
from __future__ import annotations

import os
import pickle
import re
import warnings
from pathlib import Path

import torch

from imgcls.core.errors import CheckpointError
from imgcls.core.files import not_a_regular_file


def load_checkpoint(path: str | os.PathLike, map_location="cpu") -> dict:
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a folder, not a checkpoint file (pass {path / 'last.pt'} "
                              f"or {path / 'best.pt'}; to continue a run, --resume auto with output.dir={path})")
    problem = not_a_regular_file(path)
    if problem == "no such file":
        raise CheckpointError(f"checkpoint {path} does not exist")
    if problem:
        raise CheckpointError(f"checkpoint {path}: {problem}; a checkpoint is a regular file")
    try:
        with warnings.catch_warnings():  # a plain pickle makes torch ask for a bug report; the error says enough
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            obj = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # torch.load raises many types for damaged files (KeyError, EOFError, ...)
        blocked = _blocked_global(err)
        if blocked:
            raise CheckpointError(
                f"checkpoint {path} was refused: it asks to load {blocked}, which is neither a tensor nor plain "
                f"data, and unpickling it could run code. Nothing from it was run. Only load files from a "
                f"source you trust; checkpoints written by train.py never need this") from err
        raise CheckpointError(f"checkpoint {path} is damaged or truncated, or not a checkpoint "
                              f"({type(err).__name__}: {_first_informative_line(err)})") from err
    if not isinstance(obj, dict):
        raise CheckpointError(f"checkpoint {path} does not hold a dict")
    return obj


_GLOBAL_PATTERN = re.compile(r"GLOBAL ([\w.]+)")


def _blocked_global(err: Exception):
    """The `module.name` a weights-only load refused to import, if that is why it failed."""
    if not isinstance(err, pickle.UnpicklingError):
        return None
    match = _GLOBAL_PATTERN.search(str(err))
    return match.group(1) if match else None


def _first_informative_line(err: Exception) -> str:
    """torch's weights-only message opens with advice to retry the unsafe way: never show that."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln.startswith(("Weights only load failed", "Please file an issue",
                                                        "Check the documentation"))]
    return (useful or lines or ["no details"])[0][:200]
