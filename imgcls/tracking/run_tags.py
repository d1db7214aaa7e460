"""What a tracked run records about itself: the config as parameters, and tags naming the code, the data,
the processes and the command line."""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional

from imgcls.core.config import flatten

CODE_DIR = Path(__file__).resolve().parent.parent
# set by tune.py --search for its trials: the study's run, which each trial's run is nested under
PARENT_RUN_ENV = "IMGCLS_TRACKING_PARENT_RUN_ID"


def config_params(config: dict) -> dict:
    """The resolved config as parameters: dotted keys, as config.yaml nests them."""
    return {key: json.dumps(value) if isinstance(value, (list, dict)) else str(value)
            for key, value in flatten(config).items()}


def git_commit(code_dir: Path = CODE_DIR) -> Optional[str]:
    """The checkout's commit (with `-dirty` when tracked files changed); None when the code is not a git
    checkout or git is missing."""
    if not (code_dir / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(code_dir), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(code_dir), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "")


def fingerprint_digest(fingerprint: Optional[dict]) -> Optional[str]:
    """A short digest of the splits' fingerprint (data.listing.fingerprint): equal digests, equal files."""
    if not fingerprint:
        return None
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def job_tags(world_size: int, device: str, fingerprint: Optional[dict] = None,
             argv: Optional[list[str]] = None) -> dict:
    import timm
    import torch

    argv = sys.argv if argv is None else argv
    tags = {"imgcls.command": shlex.join(argv), "mlflow.source.name": Path(argv[0]).name if argv else "",
            "imgcls.world_size": world_size, "imgcls.device": device, "imgcls.torch_version": torch.__version__,
            "imgcls.timm_version": timm.__version__}
    commit = git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
    digest = fingerprint_digest(fingerprint)
    if digest:
        tags["imgcls.data_fingerprint"] = digest
    if os.environ.get(PARENT_RUN_ENV):
        tags["mlflow.parentRunId"] = os.environ[PARENT_RUN_ENV]
    return tags


def resumed_job_tags(tags: dict, step: int) -> dict:
    """A resumed job's tags: its command line as `imgcls.resume_command`, so that the run's `imgcls.command`
    (and source name) stay the command that started it; `imgcls.resumed_at_step`."""
    tags = dict(tags)
    tags["imgcls.resume_command"] = tags.pop("imgcls.command")
    tags.pop("mlflow.source.name", None)
    tags["imgcls.resumed_at_step"] = step
    return tags


def flat_numbers(values: dict, prefix: str = "") -> dict:
    """The finite numbers in `values` (nested dicts flattened with '/'), under `prefix`."""
    import math

    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(flat_numbers(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[f"{prefix}{key}"] = float(value)
    return out
