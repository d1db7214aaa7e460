"""`ModelFormat`: one kind of model file, what it is called, how it is told apart, how it is opened for
eval.py / infer.py / serve.py, and (for export formats) how export.py writes one. Each kind is one module
of this package, registered in `model_files/formats/__init__.py`.

A checkpoint written by train.py (`best.pt`, `last.pt`): what every file not named otherwise is taken for.
Read by model_files/checkpoint_files.py; export.py reads it and never writes one."""
from __future__ import annotations

import inspect
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from imgcls.model_files.checkpoint_files import build_eval_model, read_checkpoint
from imgcls.model_files.model_file import ModelFile
from imgcls.models.factory import fold_batchnorm


@dataclass(frozen=True)
class ModelFormat:
    name: str                          # --format NAME, ModelFile.kind
    description: str                   # "an ONNX model": how messages name such a file
    open: Callable                     # (path, overrides) -> ModelFile
    suffix: Optional[str] = None       # the file suffix that names the kind (None: told apart otherwise)
    folder: bool = False               # a folder, not a file
    traced: bool = False               # a traced graph (for a fixed or a dynamic batch), not weights
    folder_files: tuple = ()           # what a folder export holds: the only files --overwrite replaces there
    write: Optional[Callable] = None   # (loaded, output, batch, metadata) -> None; None: export.py does not write it
    recognises: Optional[Callable] = None  # (path) -> bool, where a name or folder alone does not tell the kind
    carries_reject: bool = False       # computes the checkpoint's multi-layer reject score (a `reject_score` output)
    staged: bool = False               # written under a hidden name and renamed only once checked (export.py)

    def names(self, path: Path) -> bool:
        """Whether `path` is a file of this kind by its name (a folder for folder formats)."""
        if self.recognises is not None:
            return self.recognises(path)
        return path.is_dir() if self.folder else self.suffix is not None and path.suffix.lower() == self.suffix


def traced_model(loaded: ModelFile, batch: Optional[int], wrap: Optional[Callable] = None,
                 fold: bool = True) -> tuple[torch.nn.Module, torch.Tensor]:
    """The checkpoint's eval model (inside `wrap(model)` where given) with BatchNorm folded (`fold`: a model
    whose stages are tapped by hooks keeps them, the runtime fuses BatchNorm itself), and an example batch to
    trace it with (a dynamic batch is traced at 2: 1 would specialise)."""
    import logging

    model = build_eval_model(loaded, torch.device("cpu"), channels_last=False)
    if wrap is not None:
        model = wrap(model).eval()
    if not fold:
        return model, torch.zeros(batch or 2, loaded.cfg.data.channels, loaded.cfg.data.img_size,
                                  loaded.cfg.data.img_size)
    folded, count = fold_batchnorm(model)
    logging.getLogger(__name__).info("folded %d BatchNorm layers into the preceding convolutions", count)
    size = loaded.cfg.data.img_size
    return folded, torch.zeros(batch or 2, loaded.cfg.data.channels, size, size)


@contextmanager
def native_messages() -> Iterator[Callable[[], str]]:
    """What native code writes to stderr inside the block, kept from the terminal and given as one line by the
    yielded function: the edge runtimes log their reasons for refusing a file there (and CPU probing noise on
    every load), not in their exceptions. Both routes are caught: file descriptor 2 (C's stderr) and Python's
    sys.stderr (pybind11 forwards std::cerr to it)."""
    import ctypes
    import io
    import os
    import sys
    import tempfile
    from contextlib import redirect_stderr

    sys.stderr.flush()
    forwarded = io.StringIO()
    with tempfile.TemporaryFile() as captured, redirect_stderr(forwarded):
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            yield lambda: _native_reason(captured, forwarded.getvalue())
        finally:
            ctypes.CDLL(None).fflush(None)  # what C's stdio still holds goes to the captured file
            os.dup2(saved, 2)
            os.close(saved)


_NATIVE_SOURCE = re.compile(r"^\[[\w.]+:\d+\]\s*")  # ExecuTorch's `[program.cpp:114] ` prefix


def _native_reason(captured, forwarded: str) -> str:
    captured.flush()
    captured.seek(0)
    text = captured.read().decode(errors="replace") + "\n" + forwarded
    lines = [_NATIVE_SOURCE.sub("", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line and "cpuinfo" not in line.lower() and "midr" not in line.lower()
             and not line.startswith(("Reading file", "INFO:", "CPU info"))]
    return " ".join(lines)[-300:]


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

FORMAT = ModelFormat("checkpoint", "a checkpoint", read_checkpoint)
