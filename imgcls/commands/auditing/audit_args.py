"""audit.py's usage checks, torch-free: a mistake exits 2 before torch is imported or any work starts."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from imgcls.core.errors import ConfigError


def check_arguments(cfg, checkpoint: Optional[str], clean_csv: Optional[str]) -> None:
    """Usage mistakes, before any work (exit 2)."""
    a, d = cfg.audit, cfg.data
    if clean_csv and d.format == "webdataset":
        raise ConfigError("--write-clean-csv: shard samples are not files a CSV list can name; write the shards "
                          "out as files first, or audit without --write-clean-csv")
    if a.drop_label_issues and not clean_csv:
        raise ConfigError("--drop-label-issues (audit.drop_label_issues) only shapes --write-clean-csv FILE; "
                          "pass both")
    if a.drop_label_issues and a.folds == 0 and not checkpoint:
        raise ConfigError("--drop-label-issues needs a label-issue search: --folds K (K >= 2) or --checkpoint CKPT")
    if checkpoint and not Path(checkpoint).exists():
        raise ConfigError(f"--checkpoint {checkpoint}: no such file or folder")
    if clean_csv:
        lists = {os.path.realpath(p) for p in (d.train_csv, d.val_csv) if p}
        if os.path.realpath(clean_csv) in lists:
            raise ConfigError(f"--write-clean-csv {clean_csv} is one of the data's own lists; the audit never "
                              f"changes the data: name a new file")


def check_checkpoint_task(model_task, data_task, checkpoint: str) -> None:
    """--checkpoint's model must be of the data's task (tasks.Task): a multi-label (sigmoid) model's scores are
    no class distribution for the single-label label-error search (it named 18 'label errors' from one)."""
    if model_task.name != data_task.name:
        raise ConfigError(f"--checkpoint {checkpoint}: a {model_task.title} model, but the data is "
                          f"{data_task.title} (data.task); pass a model trained on this task, or --folds K")
