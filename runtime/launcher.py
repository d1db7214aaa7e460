"""What the launcher tells a process about its place in a multi-node job: torchelastic's restart count and
run id (torchrun), and the host it runs on. The only readers of these variables."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping, Optional


@dataclass(frozen=True)
class LaunchInfo:
    restart_count: int = 0          # TORCHELASTIC_RESTART_COUNT: how often torchrun restarted the worker group
    run_id: Optional[str] = None    # TORCHELASTIC_RUN_ID: torchrun's --rdzv-id (a fresh uuid with --standalone)

    @property
    def restarted(self) -> bool:
        return self.restart_count > 0


def launch_info(env: Mapping[str, str] = os.environ) -> LaunchInfo:
    """The launcher's record from `env`; outside torchrun a first start without a run id."""
    count = env.get("TORCHELASTIC_RESTART_COUNT", "").strip()
    return LaunchInfo(restart_count=int(count) if count.isdigit() else 0,
                      run_id=env.get("TORCHELASTIC_RUN_ID") or None)


def host_name() -> str:
    return socket.gethostname()
