"""Facts about the machine that need no torch."""
from __future__ import annotations

import os


def usable_cpus() -> int:
    """Cores this process may run on (its affinity mask; the whole machine where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def choose_threads(setting, cpus: int, env: dict) -> tuple[int, str]:
    """Intra-op threads for the main process, and where the number came from.

    An explicit `train.threads` wins, then OMP_NUM_THREADS (torchrun sets it to 1 per process); `auto` is
    every usable core. What keeps that cheap when the loader workers or other jobs want the cores is the
    passive OpenMP wait (`prefer_passive_omp_wait`): with it, threads beside busy workers cost about what
    one thread does, and on an idle machine they compute in parallel (docs/performance.md has the numbers)."""
    if setting != "auto":
        return int(setting), "train.threads"
    from_env = env.get("OMP_NUM_THREADS", "").strip()
    if from_env.isdigit() and int(from_env) > 0:
        return int(from_env), "OMP_NUM_THREADS"
    return cpus, f"auto: {cpus} usable core(s)"


def prefer_passive_omp_wait(env=None) -> None:
    """OpenMP threads that wait for work sleep instead of spinning (OMP_WAIT_POLICY=PASSIVE), unless the
    user chose a policy. Spinning threads take the cores the loader workers and other jobs need, and on a
    busy machine every step then waits for them. OpenMP reads this once, when torch loads it, so this runs
    before torch is imported; docs/performance.md has the measurements."""
    env = os.environ if env is None else env
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
