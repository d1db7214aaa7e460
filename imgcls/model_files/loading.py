"""Every kind of model file that eval.py, infer.py and serve.py take, behind one loader: the kind is told
apart by its name (model_files/formats/) and opened by its format, which gives the class names, the
config to run with (the eval preprocessing in `cfg.data`) and a module mapping a normalised float batch to
logits."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from imgcls.core.errors import CheckpointError, ConfigError
from imgcls.core.files import not_a_regular_file
from imgcls.model_files.formats import format_of
from imgcls.model_files.model_file import ModelFile
from imgcls.model_files.stored_metadata import check_class_names


def load_model_file(path: str | Path, overrides: list[str] = (), classes_file: Optional[str] = None) -> ModelFile:
    """Open any model file eval.py and infer.py take (CheckpointError / ConfigError, exit 2, when it is
    not one). `classes_file` (one name per line) names the classes of a model that records none."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    opened = format_of(path).open(path, list(overrides))
    if classes_file is not None:
        opened.classes = read_classes_file(classes_file, len(opened.classes))
    return opened


def read_classes_file(path: str | Path, count: int) -> list[str]:
    """Class names, one per line (blank lines ignored); their number must match the model's outputs."""
    path = Path(path)
    problem = not_a_regular_file(path)
    if problem:
        raise ConfigError(f"--classes {path}: {problem}; it must name a regular file (one class name per line)")
    try:
        names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"--classes {path}: cannot read it ({err})") from err
    if len(names) != count:
        raise ConfigError(f"--classes {path}: {len(names)} name(s), but the model has {count} outputs")
    return check_class_names(names, f"--classes {path}")
