"""Each command's outputs and inputs, named for core.files.check_outputs_apart: no command writes over a
file it reads or into a folder it reads from (exit 2 before any work, naming both roles)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from imgcls.core.errors import ConfigError
from imgcls.core.files import check_outputs_apart


def _dirs(*paths: Optional[str]) -> list[str]:
    return [p for p in paths if p and os.path.isdir(p)]


def _files(*paths: Optional[str]) -> list[str]:
    return [p for p in paths if p and os.path.isfile(p)]


def check_infer_outputs(inputs: list[str], paths: list[str], checkpoint: str, classes_file: Optional[str],
                        output: Optional[str], explain_dir: Optional[str], save_images: Optional[str] = None,
                        pseudo_labels: Optional[str] = None) -> None:
    """infer.py: --output, --pseudo-labels, --explain DIR and --save-images DIR apart from the input images, lists
    and folders, the model file (or export folder) and the classes file, and the two folders apart (their files
    share names)."""
    if explain_dir and save_images and os.path.realpath(explain_dir) == os.path.realpath(save_images):
        raise ConfigError(f"--save-images {save_images}: is also the --explain folder, whose overlays take the same "
                          f"names; name another folder")
    check_outputs_apart({"--output": output, "--pseudo-labels": pseudo_labels},
                        {"input image": paths, "input list": _files(*inputs), "checkpoint": _files(checkpoint),
                         "classes file": _files(classes_file)},
                        {"input folder": _dirs(*inputs), "checkpoint folder": _dirs(checkpoint)},
                        {"--explain": explain_dir, "--save-images": save_images})


def eval_output_files(outputs: dict) -> dict:
    """eval.py's outputs by flag, with the files it derives from --json's name (`<name>_confusion.png`,
    `<name>_pr.png`, `<name>_errors.csv`, `<name>_errors.html`) beside --json; without --json, the
    precision-recall curves beside the reliability diagram (`<name>_pr.png` of --reliability's name)."""
    files = {}
    for flag, path in outputs.items():
        files[flag] = path
        if flag == "--reliability" and path and not outputs.get("--json"):
            files["--reliability's precision-recall curves"] = str(pr_png_path(path))
        if flag == "--json" and path:

            errors_csv, errors_html = errors_paths(path)
            files.update({"--json's confusion matrix": str(confusion_png_path(path)),
                          "--json's precision-recall curves": str(pr_png_path(path)),
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


def check_embed_outputs(inputs: list[str], paths: list[str], checkpoint: str, output: str) -> None:
    """embed.py: the output folder holds no input image, input list or model file and overlaps no input
    folder (`embed.py lst/paths.csv --output lst` would replace the list it reads)."""
    check_outputs_apart({}, {"input image": paths, "input list": _files(*inputs), "checkpoint": _files(checkpoint)},
                        {"input folder": _dirs(*inputs), "checkpoint folder": _dirs(checkpoint)}, {"--output": output})


def check_search_outputs(queries: list[str], paths: list[str], index_dir: str, checkpoint: Optional[str],
                         output: Optional[str]) -> None:
    """search.py: --output is no query image, query list or model file and lies outside the index folder
    (its paths.csv and index.json are what the next search reads) and the query folders."""
    check_outputs_apart({"--output": output}, {"query image": paths, "query list": _files(*queries),
                                               "checkpoint": _files(checkpoint)},
                        {"index folder": [index_dir], "query folder": _dirs(*queries),
                         "checkpoint folder": _dirs(checkpoint)})


def check_tune_outputs(cfg, config: Optional[str], space: str, study: str) -> None:
    """tune.py --search: --study DIR (study.db, best.yaml, trials.csv, plots, trials/) holds none of the files
    the study reads (the config file, the space, the data lists) and lies outside the class-folder tree the
    trials train on (`--config N1/best.yaml --study N1` would replace the config with best.yaml)."""
    from imgcls.config import resolve_config_path
    from imgcls.data.settings import check_outside_data

    d = cfg.data
    config_file = str(resolve_config_path(config)) if config else None
    check_outputs_apart({}, {"--config file": _files(config_file), "--search space": _files(space),
                             "data list": _files(d.train_csv, d.val_csv), "classes file": _files(d.classes)},
                        None, {"--study": study})
    check_outside_data(cfg, "--study", study)


def errors_paths(json_path: str | Path) -> tuple[Path, Path]:
    json_path = Path(json_path)
    return json_path.with_name(f"{json_path.stem}_errors.csv"), json_path.with_name(f"{json_path.stem}_errors.html")


def confusion_png_path(json_path: str | Path) -> Path:
    json_path = Path(json_path)
    return json_path.with_name(f"{json_path.stem}_confusion.png")


def pr_png_path(json_path: str | Path) -> Path:
    json_path = Path(json_path)
    return json_path.with_name(f"{json_path.stem}_pr.png")
