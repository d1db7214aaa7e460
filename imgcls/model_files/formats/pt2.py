"""A `.pt2` archive read before `torch.export.load` opens it: torch's loader fully unpickles (no weights-only
restriction) any weight or constant its JSON config marks `use_pickle`, loads custom and opaque objects by
pickle, falls back to a full unpickle for sample inputs and legacy weight files that a weights-only load
refuses, and runs compiled AOTInductor code. A program export.py writes holds none of these, so
an archive that does is refused, naming the entry, before anything in it is loaded.

A torch.export program (`.pt2`): written by torch.export.export and torch.export.save, the metadata as
the archive's imgcls.json; the archive is inspected before torch loads it."""
from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import Iterator, Optional

import torch

from imgcls.core.errors import CheckpointError, ExportError
from imgcls.model_files.formats.base import ModelFormat, shorten_export_error, traced_model
from imgcls.model_files.metadata import PT2_METADATA_FILE
from imgcls.model_files.model_file import FunctionModel, ModelFile
from imgcls.model_files.stored_metadata import check_output_count, read_metadata

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

def open_pt2(path: Path, overrides: list[str]) -> ModelFile:
    extra = {PT2_METADATA_FILE: ""}
    check_pt2_archive(path)
    try:
        program = torch.export.load(str(path), extra_files=extra)
    except Exception as err:  # a damaged archive or another kind of file: torch raises many types
        reason = " ".join(str(err).split())[:200]
        raise CheckpointError(f"{path}: not a torch.export program ({type(err).__name__}: {reason})") from err
    if not extra[PT2_METADATA_FILE]:
        raise CheckpointError(f"{path}: a torch.export program without {PT2_METADATA_FILE} (classes and "
                              f"preprocessing): not written by export.py")
    try:
        metadata = json.loads(extra[PT2_METADATA_FILE])
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: its {PT2_METADATA_FILE} is not valid JSON ({err})") from err
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: its {PT2_METADATA_FILE} holds {type(metadata).__name__}, not a mapping")
    stored = read_metadata(metadata, path, overrides)
    check_output_count(stored.classes, program_outputs(program, path), str(path))

    def build(device: torch.device, channels_last: bool) -> torch.nn.Module:
        on_device = program
        if device.type != "cpu":
            from torch.export.passes import move_to_device_pass

            on_device = move_to_device_pass(program, device)
        return FunctionModel(on_device.module().__call__, stored.batch)
    return ModelFile("pt2", path, stored.cfg, stored.classes, stored.epoch, build, stored.batch, stored.saved_val_limit,
                     calibration=stored.calibration, thresholds=stored.thresholds)


def program_outputs(program, path: Path) -> int:
    """The width of the program's (first) output, from the shapes torch.export recorded."""
    try:
        output = next(node for node in program.graph.nodes if node.op == "output").args[0][0]
        return int(output.meta["val"].shape[-1])
    except (StopIteration, IndexError, KeyError, AttributeError, TypeError) as err:
        raise CheckpointError(f"{path}: the program records no output shape ({type(err).__name__})") from err


def write_pt2(loaded: ModelFile, path: Path, batch: Optional[int], metadata: dict) -> None:
    """torch.export.export, saved with torch.export.save; the metadata as the archive's imgcls.json."""
    model, example = traced_model(loaded, batch)
    shapes = ({0: torch.export.Dim("batch", min=1)},) if batch is None else None
    try:
        program = torch.export.export(model, (example,), dynamic_shapes=shapes)
    except Exception as err:  # the exporters raise many types; their messages name the failing code
        raise ExportError(f"pt2 export failed: {shorten_export_error(err, model)}") from err
    torch.export.save(program, str(path), extra_files={PT2_METADATA_FILE: json.dumps(metadata)})


FORMAT = ModelFormat("pt2", "a torch.export program", open_pt2, suffix=".pt2", traced=True,
                    write=write_pt2)
