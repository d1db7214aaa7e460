"""A torch.export program (`.pt2`): written by torch.export.export and torch.export.save, the metadata as
the archive's imgcls.json; the archive is inspected before torch loads it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from imgcls.core.errors import CheckpointError, ExportError
from imgcls.model_files.formats.base import ModelFormat, shorten_export_error, traced_model
from imgcls.model_files.metadata import PT2_METADATA_FILE
from imgcls.model_files.model_file import FunctionModel, ModelFile
from imgcls.model_files.pt2_archive import check_pt2_archive
from imgcls.model_files.stored_metadata import check_output_count, read_metadata


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
