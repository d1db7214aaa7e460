"""What the launcher tells a process about its place in a multi-node job: torchelastic's restart count and
run id (torchrun), and the host it runs on. The only readers of these variables."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping, Optional

from imgcls.core.errors import ConfigError


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


@dataclass(frozen=True)
class ProcessPlace:
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0


def whole_number(env: Mapping[str, str], name: str, default: int, lowest: int) -> int:
    raw = env.get(name)
    if raw is None:
        return default
    text = raw.strip()
    if not text.lstrip("-").isdigit() or int(text) < lowest:
        raise ConfigError(f"{name}={raw!r}: the launcher environment needs a whole number >= {lowest} (torchrun "
                          f"sets it; unset {name} for one process)")
    return int(text)


def process_place(env: Mapping[str, str] = os.environ) -> ProcessPlace:
    """WORLD_SIZE, RANK and LOCAL_RANK as a launcher set them (one process when WORLD_SIZE is unset); a value
    that is no whole number, or out of range, is a ConfigError (exit 2) naming the variable."""
    world = whole_number(env, "WORLD_SIZE", 1, 1)
    rank = whole_number(env, "RANK", 0, 0)
    local_rank = whole_number(env, "LOCAL_RANK", 0, 0)
    if rank >= world:
        raise ConfigError(f"RANK={rank} with WORLD_SIZE={world}: ranks run from 0 to {world - 1}")
    if world > 1 and not env.get("TORCHELASTIC_RUN_ID"):
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not (env.get(name) or "").strip():
                raise ConfigError(f"WORLD_SIZE={world} without {name}: name the address of rank 0's process "
                                  f"(MASTER_ADDR, MASTER_PORT), or start the run with torchrun")
    return ProcessPlace(world, rank, local_rank)


def host_name() -> str:
    return socket.gethostname()
