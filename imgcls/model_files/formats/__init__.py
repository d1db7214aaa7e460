"""The kinds of model file, registered in one place. A new kind is one module with a `FORMAT`
(model_files/formats/base.py says what it holds) and one entry in FORMATS; eval.py, infer.py and
serve.py open it, and export.py writes it when it has a `write`."""
from __future__ import annotations

from pathlib import Path

import imgcls.model_files.formats.base as checkpoint  # the checkpoint format lives beside the base
import imgcls.model_files.formats.executorch as executorch
import imgcls.model_files.formats.litert as litert
import imgcls.model_files.formats.onnx as onnx
import imgcls.model_files.formats.openvino as openvino
import imgcls.model_files.formats.pt2 as pt2
import imgcls.model_files.formats.timm_folder as timm_folder
from imgcls.model_files.formats.base import ModelFormat

# a folder holding model.xml is an OpenVINO IR before it is taken for a timm folder (any other folder)
FORMATS: dict[str, ModelFormat] = {m.FORMAT.name: m.FORMAT
                                   for m in (checkpoint, onnx, pt2, openvino, executorch, litert, timm_folder)}
DEFAULT = FORMATS["checkpoint"]  # a file no other kind names


def format_of(path: str | Path) -> ModelFormat:
    """The kind of model file at `path`, by its name (a folder, a suffix), else a checkpoint."""
    path = Path(path)
    return next((f for f in FORMATS.values() if f is not DEFAULT and f.names(path)), DEFAULT)


def export_formats() -> list[str]:
    """The kinds export.py writes (--format)."""
    return [name for name, f in FORMATS.items() if f.write is not None]
