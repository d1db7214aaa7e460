"""Facts about the machine that need no torch."""
from __future__ import annotations

import os


def usable_cpus() -> int:
    """Cores this process may run on (its affinity mask; the whole machine where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
