"""The sections of the run directory: `checkpoint` (when last.pt is written) and `output` (where and what the run
writes besides it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from imgcls.core.settings import setting


@dataclass
class CheckpointConfig:
    every_steps: int = setting(0, "also save last.pt every N optimizer steps (0: only at epoch ends)", lo=0,
                               resume_free=True)


@dataclass
class OutputConfig:
    dir: str = setting("runs/default", "the run directory", resume_free=True)
    log_interval: int = setting(50, "optimizer steps between log lines / TensorBoard points (each epoch's last step "
                                    "always logs)", lo=1, resume_free=True)
    tensorboard: bool = setting(True, "write TensorBoard event files under <dir>/tensorboard", resume_free=True)
    progress_bar: Union[bool, Literal["auto"]] = setting("auto", "auto (a tqdm bar when stderr is a terminal) | true "
                                                                 "| false", resume_free=True)
    overwrite: bool = setting(False, "a new run in a dir holding another run's checkpoints: false exits 2; true "
                                     "deletes that run's files first", resume_free=True)
    curves: bool = setting(True, "write curves.png (loss, LR, validation metrics per epoch, from metrics.csv) at "
                                 "epoch ends (under 2% of the run's time) and the run's end", resume_free=True)
