"""How a worker group that torchrun restarted (`--max-restarts`) continues its run by itself: from the run
directory's last.pt, as `--resume auto` would, without anyone typing it, and only from a last.pt this run
(the same torchrun run id) wrote. A first start is left as it is: a leftover last.pt of another run is still
refused by `claim_run_dir`."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from imgcls.core.errors import ConfigError
from imgcls.runtime.launcher import LaunchInfo

log = logging.getLogger(__name__)

# the checkpoint key that records which torchrun run wrote it
RUN_ID_KEY = "elastic_run_id"


@dataclass(frozen=True)
class ResumePlan:
    resume: Optional[str]       # what the run resumes from: --resume as typed, or "auto" after a restart
    must_own: bool = False      # the checkpoint must have been written by this torchrun run


def plan_resume(resume: Optional[str], run_dir: Path, launch: LaunchInfo) -> ResumePlan:
    """`resume` as typed on a first start; after a torchelastic restart the run directory's last.pt (or
    last.prev.pt) when there is one, else what the first start resumed from (nothing: a new run)."""
    if not launch.restarted or resume == "auto":
        if launch.restarted:
            log.info("torchelastic restart %d of run %s: --resume auto continues from %s",
                     launch.restart_count, launch.run_id, run_dir / "last.pt")
        return ResumePlan(resume)
    saved = [run_dir / name for name in ("last.pt", "last.prev.pt") if (run_dir / name).exists()]
    if not saved:
        log.info("torchelastic restart %d of run %s: no last.pt in %s yet, starting %s", launch.restart_count,
                 launch.run_id, run_dir, f"from {resume} again" if resume else "the run afresh")
        return ResumePlan(resume)
    log.warning("torchelastic restart %d of run %s: continuing from %s (a restarted group resumes by itself; "
                "no --resume needed)", launch.restart_count, launch.run_id, saved[0])
    return ResumePlan("auto", must_own=True)


def check_own_checkpoint(ckpt: Optional[dict], run_dir: Path, launch: LaunchInfo) -> None:
    """After a restart, refuse (exit 2) a last.pt that another run wrote: a first start that refused it
    (it holds another run) must not take it up on torchrun's retry."""
    if ckpt is None:
        return
    written_by = ckpt.get(RUN_ID_KEY)
    if written_by != launch.run_id:
        raise ConfigError(f"output.dir {run_dir} holds last.pt of another run (torchrun run id "
                          f"{written_by or 'none recorded'}; this is run {launch.run_id}, restart "
                          f"{launch.restart_count}), which a restarted group does not take up by itself. "
                          f"Continue that run with --resume auto, or start this one in a new output.dir=...")


def run_id_fields(launch: LaunchInfo) -> dict:
    """What last.pt records of the launch: the torchrun run id, when there is one."""
    return {RUN_ID_KEY: launch.run_id} if launch.run_id else {}
