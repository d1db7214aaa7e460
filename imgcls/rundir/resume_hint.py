"""The command that continues a stopped run, printed so that it works as it stands: `train.py --resume PATH`
takes the rest (the resolved config) from the checkpoint."""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional


def continue_command(last_pt: Path, world_size: int = 1, script: Optional[str] = None) -> str:
    """The entry script as this process was started (torchrun with the same process count under DDP) with
    `--resume last_pt`."""
    script = script or sys.argv[0] or "train.py"
    launcher = f"torchrun --nproc_per_node {world_size}" if world_size > 1 else "python"
    return f"{launcher} {shlex.quote(script)} --resume {shlex.quote(str(last_pt))}"
