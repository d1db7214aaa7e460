"""Each command's outputs and inputs, named for core.files.check_outputs_apart: no command writes over a
file it reads or into a folder it reads from (exit 2 before any work, naming both roles)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from imgcls.core.files import check_outputs_apart


def _dirs(*paths: Optional[str]) -> list[str]:
    return [p for p in paths if p and os.path.isdir(p)]


def _files(*paths: Optional[str]) -> list[str]:
    return [p for p in paths if p and os.path.isfile(p)]


def check_infer_outputs(inputs: list[str], paths: list[str], checkpoint: str, classes_file: Optional[str],
                        output: Optional[str], explain_dir: Optional[str], pseudo_labels: Optional[str] = None) -> None:
    """infer.py: --output, --pseudo-labels and --explain DIR apart from the input images, lists and folders, the
    model file (or export folder) and the classes file."""
    check_outputs_apart({"--output": output, "--pseudo-labels": pseudo_labels},
                        {"input image": paths, "input list": _files(*inputs), "checkpoint": _files(checkpoint),
                         "classes file": _files(classes_file)},
                        {"input folder": _dirs(*inputs), "checkpoint folder": _dirs(checkpoint)},
                        {"--explain": explain_dir})


def eval_output_files(outputs: dict) -> dict:
    """eval.py's outputs by flag, with the files it derives from --json's name (`<name>_confusion.png`,
    `<name>_errors.csv`, `<name>_errors.html`) beside --json."""
    files = {}
    for flag, path in outputs.items():
        files[flag] = path
        if flag == "--json" and path:

            errors_csv, errors_html = errors_paths(path)
            files.update({"--json's confusion matrix": str(confusion_png_path(path)),
                          "--json's misclassified list": str(errors_csv), "--json's misclassified page": str(errors_html)})
    return files


def check_eval_outputs(outputs: dict, checkpoint: str, classes_file: Optional[str], data: Optional[str],
                       data_root: Optional[str], images: list[str]) -> None:
    """eval.py: --json (and the files named after it), --predictions and --reliability apart from each other
    and from the evaluated images, the data root or list, the model file and the classes file."""
    check_outputs_apart(eval_output_files(outputs), {"evaluated image": images, "data list": _files(data), "checkpoint": _files(checkpoint),
                                  "classes file": _files(classes_file)},
                        {"data root": _dirs(data_root, data), "checkpoint folder": _dirs(checkpoint)})


def check_audit_outputs(cfg, checkpoint: Optional[str], outputs: dict) -> None:
    """audit.py: --json, --html and --write-clean-csv apart from the data root, the lists, the classes file,
    the shards and the checkpoint (the audit never writes under the data root)."""
    d = cfg.data
    shards = [s for s in (d.train_shards, d.val_shards) if isinstance(s, str)]
    check_outputs_apart(outputs, {"data list": _files(d.train_csv, d.val_csv), "classes file": _files(d.classes),
                                  "shard list": _files(*shards), "checkpoint": _files(checkpoint)},
                        {"data root": _dirs(d.root), "checkpoint folder": _dirs(checkpoint)})


def check_export_outputs(checkpoint: str, output: str, folder_output: bool) -> None:
    """export.py: the export never replaces the checkpoint it reads, nor lands inside its folder; a folder
    export (timm) never holds it."""
    check_outputs_apart({"--output": output}, {"checkpoint": _files(checkpoint)},
                        {"checkpoint folder": _dirs(checkpoint)}, {"--output": output} if folder_output else None)


def errors_paths(json_path: str | Path) -> tuple[Path, Path]:
    json_path = Path(json_path)
    return json_path.with_name(f"{json_path.stem}_errors.csv"), json_path.with_name(f"{json_path.stem}_errors.html")


def confusion_png_path(json_path: str | Path) -> Path:
    json_path = Path(json_path)
    return json_path.with_name(f"{json_path.stem}_confusion.png")
