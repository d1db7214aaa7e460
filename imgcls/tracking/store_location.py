"""Where a local tracking store writes (a folder store, a SQLite file), kept apart from what the job reads:
MLflow writes `.trash` and experiment folders into a folder store, which among class folders breaks the next
run. The outputs-apart rule (core.outputs.check_outputs_apart), with the store as the output."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional
from urllib.parse import unquote, urlsplit

from imgcls.core.errors import ConfigError, redact_uri
from imgcls.core.files import check_outputs_apart
from imgcls.tracking.settings import TrackingConfig, tracking_client_installed


def local_store(uri: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(folder, file) a tracking URI writes on this machine: a folder store's folder, a SQLite store's file;
    (None, None) for a server or a remote database."""
    if not uri:
        return None, None
    if is_folder_uri(uri):
        if uri.lower().startswith("file:"):
            return unquote(urlsplit(uri).path) or None, None
        return uri, None
    if uri.lower().startswith("sqlite:///"):
        return None, unquote(uri[len("sqlite:///"):].split("?", 1)[0]) or None
    return None, None


def _existing(*paths: Optional[str]) -> list[str]:
    return [p for p in paths if p and os.path.exists(p)]


def _parent_dirs(*files: Optional[str]) -> list[str]:
    return [str(Path(f).expanduser().resolve().parent) for f in files if f and os.path.isfile(f)]


def _shard_dirs(patterns) -> list[str]:
    """The folders of the shard patterns (`dir/train-{000..009}.tar`, lists of them)."""
    if isinstance(patterns, str):
        patterns = [patterns]
    dirs = []
    for pattern in patterns or ():
        folder = os.path.dirname(re.split(r"[{*?\[]", str(pattern), maxsplit=1)[0])
        if folder and os.path.isdir(folder):
            dirs.append(folder)
    return dirs


def job_inputs(cfg, finetune: Optional[str] = None, checkpoint: Optional[str] = None) -> tuple[dict, dict]:
    """(role -> files, role -> folders) a training, tuning or evaluation job reads."""
    d = cfg.data
    teacher = cfg.distill.teacher
    if teacher and teacher.startswith("local-dir:"):
        teacher = teacher[len("local-dir:"):]
    files = {"data list": _existing(d.train_csv, d.val_csv), "classes file": _existing(d.classes),
             "teacher": [t for t in _existing(teacher) if os.path.isfile(t)],
             "model.weights file": _existing(cfg.model.weights), "--finetune checkpoint": _existing(finetune),
             "checkpoint": [c for c in _existing(checkpoint) if os.path.isfile(c)]}
    dirs = {"data root": [r for r in _existing(d.root and os.path.expanduser(d.root)) if os.path.isdir(r)],
            "data list's folder": _parent_dirs(d.train_csv, d.val_csv),
            "shards' folder": _shard_dirs(d.train_shards) + _shard_dirs(d.val_shards),
            "teacher folder": [t for t in _existing(teacher) if os.path.isdir(t)],
            "checkpoint folder": [c for c in _existing(checkpoint) if os.path.isdir(c)]}
    return files, dirs


def check_store_apart(cfg, finetune: Optional[str] = None, checkpoint: Optional[str] = None) -> None:
    """ConfigError (exit 2, before any work) when the local store that tracking would write (tracking.uri, else
    MLFLOW_TRACKING_URI) is or lies inside an input of the job, or a folder store holds one."""
    if cfg.tracking.backend != "none":
        check_store_apart_from(cfg.tracking, *job_inputs(cfg, finetune, checkpoint))


def check_store_apart_from(tracking, files: dict, dirs: dict) -> None:
    """check_store_apart for given inputs: role -> files, role -> folders (those that do not exist are left out)."""
    uri, key = ((tracking.uri, "'tracking.uri'") if tracking.uri else
                (os.environ.get("MLFLOW_TRACKING_URI"), "MLFLOW_TRACKING_URI"))
    folder, file = local_store(uri)
    if folder is None and file is None:
        return
    files = {role: [f for f in paths if f and os.path.isfile(f)] for role, paths in files.items()}
    dirs = {role: [d for d in paths if d and os.path.isdir(d)] for role, paths in dirs.items()}
    if folder is not None:
        check_outputs_apart({}, files, dirs, {f"{key} (a folder store)": folder})
    else:
        check_outputs_apart({f"{key} (a SQLite store)": file}, files, dirs)


def check_tracking_client(t: TrackingConfig) -> None:
    """A job that logs (train.py, tune.py, eval.py asked to) needs the client installed, and one that opens
    the store named: MLflow 3 refuses a folder store unless MLFLOW_ALLOW_FILE_STORE=true (else every record
    would go to the backlog). eval.py and infer.py of a tracked run's checkpoint need neither."""
    if t.backend != "mlflow":
        return
    if not tracking_client_installed():
        raise ConfigError("'tracking.backend' = mlflow needs the MLflow client: pip install \"imgcls[track]\" "
                          "(mlflow-skinny: a tracking server) or pip install mlflow (also the local SQLite store "
                          "and mlflow ui)")
    uri, key = (t.uri, "'tracking.uri'") if t.uri else (os.environ.get("MLFLOW_TRACKING_URI"), "MLFLOW_TRACKING_URI")
    if uri and is_folder_uri(uri) and not folder_store_allowed():
        raise ConfigError(f"{key} = {redact_uri(uri)!r} is a folder store, which the installed MLflow no longer "
                          f"opens (its file store is in maintenance mode); use a database, e.g. "
                          f"tracking.uri=sqlite:///mlflow.db (mlflow migrate-filestore converts an old folder), or "
                          f"set MLFLOW_ALLOW_FILE_STORE=true to keep the folder")


def is_folder_uri(uri: str) -> bool:
    """A tracking URI naming a folder store: a plain path, or file:."""
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):", uri)
    return match is None or re.match(r"^[A-Za-z]:[\\/]", uri) is not None or match.group(1).lower() == "file"


def folder_store_allowed() -> bool:
    """Whether the installed MLflow opens a folder store (MLflow 3 only with MLFLOW_ALLOW_FILE_STORE=true)."""
    try:
        from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
    except ImportError:  # an MLflow from before the file store's maintenance mode
        return True
    return bool(MLFLOW_ALLOW_FILE_STORE.get())
