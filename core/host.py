"""Facts about the machine that need no torch."""
from __future__ import annotations

import ctypes
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional


def usable_cpus() -> int:
    """Cores this process may run on: its affinity mask, capped by a cgroup CPU quota (a container held to
    2 CPUs on a 64-core host sees 64 cores in its mask); the whole machine where neither is known."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> Optional[float]:
    """CPUs' worth of time the cgroup may use (quota / period), or None without a quota: cgroup v2's
    `cpu.max` ("200000 100000", or "max 100000"), else v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us`."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


THREAD_SETTINGS = ("auto", "idle_cores")


def choose_threads(setting, cpus: int, env: dict, busy_cores: Optional[float] = None,
                   saved: Optional[int] = None) -> tuple[int, str]:
    """Intra-op threads for the main process, and where the number came from.

    An explicit `train.threads` wins, then OMP_NUM_THREADS (torchrun sets it to 1 per process), then
    `saved`, the count a checkpoint's run computed with (a resume, eval.py, infer.py: sums over another
    thread count round differently in the last digits; never more than `cpus`). Else `auto`: the usable
    cores, whatever else runs, so two fresh runs with the same seed compute the same numbers. `idle_cores`
    follows the load instead: the usable cores less those other processes kept busy at start
    (`busy_cores`, rounded; at least one). On a 2-core machine beside one busy process, one thread has a
    core to itself, where two share the other core with that process and wait for each other at every
    parallel region (docs/performance.md); the price is that the numbers depend on the load."""
    if setting not in THREAD_SETTINGS:
        return int(setting), "train.threads"
    from_env = env.get("OMP_NUM_THREADS", "").strip()
    if from_env.isdigit() and int(from_env) > 0:
        return int(from_env), "OMP_NUM_THREADS"
    if isinstance(saved, int) and saved > 0:
        capped = f", capped at {cpus} usable core(s)" if saved > cpus else ""
        return min(saved, cpus), f"{setting}: the checkpoint's run used {saved}{capped}"
    if setting == "auto":
        return cpus, f"auto: {cpus} usable core(s)"
    if busy_cores is None or busy_cores < BUSY_CORES:
        load = "load unknown" if busy_cores is None else "idle at start"
        return cpus, f"idle_cores: {cpus} usable core(s), {load}"
    free = max(1, min(cpus, int(cpus - busy_cores + 0.5)))
    return free, f"idle_cores: {cpus} usable core(s), {busy_cores:.1f} kept busy by other processes at start"


# libgomp's spin count (torch's Linux wheels use GNU OpenMP): about 100 spins per microsecond
SHORT_OMP_SPIN = "1000"
# other processes using this much of the usable cores at start-up make the machine busy
BUSY_CORES = 0.5
PROBE_SECONDS = 0.1


@dataclass
class OmpWaitChoice:
    """What `choose_omp_wait` set, and why (for the start-up line)."""

    env: dict                     # the variables it set (empty: none)
    reason: str
    busy_cores: Optional[float] = None  # other processes' load at start (None: not probed, or unknown)


def cpu_jiffies(stat_text: str, cpus: set[int]) -> Optional[tuple[int, int]]:
    """(busy, total) clock ticks summed over `cpus` from the text of /proc/stat (steal counts as busy: a
    stolen core is as unavailable as a busy one); None when none of `cpus` is listed."""
    busy = total = 0
    found = False
    for line in stat_text.splitlines():
        name, *fields = line.split() or [""]
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus) or len(fields) < 8:
            continue
        values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
        total += sum(values)
        busy += sum(values) - values[3] - values[4]
        found = True
    return (busy, total) if found else None


def busy_cores_of_others(window_s: float = PROBE_SECONDS) -> Optional[float]:
    """How many of the usable cores other processes kept busy over a short window (this process's own
    CPU time taken out); None where /proc/stat is not there (not Linux)."""
    cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
    try:
        before, own_before = cpu_jiffies(Path("/proc/stat").read_text(), cpus), os.times()
        time.sleep(window_s)
        after, own_after = cpu_jiffies(Path("/proc/stat").read_text(), cpus), os.times()
    except OSError:
        return None
    if before is None or after is None or after[1] <= before[1]:
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    own = (own_after.user + own_after.system - own_before.user - own_before.system) * ticks
    ticks_per_cpu = (after[1] - before[1]) / len(cpus)
    return max(0.0, (after[0] - before[0] - own) / ticks_per_cpu)


def omp_wait_for(busy_cores: Optional[float]) -> OmpWaitChoice:
    """On idle cores OpenMP's own wait (libgomp spins for milliseconds before it sleeps) keeps the many
    small parallel regions of a step from paying a wake-up each. Beside other busy processes that spin
    takes the cores the threads being waited for need, and every step waits for them: there the threads
    spin for a few microseconds, then sleep (OMP_WAIT_POLICY=PASSIVE, which other OpenMP runtimes read,
    and GOMP_SPINCOUNT). The wait changes no number computed (the thread count does: `choose_threads`).
    docs/performance.md has the measurements."""
    short = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": SHORT_OMP_SPIN}
    if busy_cores is None:
        return OmpWaitChoice(short, "idle threads sleep soon (the cores' load is unknown here)")
    if busy_cores >= BUSY_CORES:
        return OmpWaitChoice(short, f"idle threads sleep soon: other processes kept {busy_cores:.1f} "
                                    f"core(s) busy at start", busy_cores)
    return OmpWaitChoice({}, "idle threads spin a while (OpenMP's default): the cores were idle at start",
                         busy_cores)


def choose_omp_wait(env=None, probe: Callable[[], Optional[float]] = busy_cores_of_others) -> OmpWaitChoice:
    """Probe the cores' load and set how waiting OpenMP threads behave (`omp_wait_for` that load), unless
    the user chose (OMP_WAIT_POLICY or GOMP_SPINCOUNT set: the load is still probed, for `idle_cores` threads).
    OMP_NUM_THREADS=1 needs neither: one thread has nobody to wait for, and its count is fixed.
    OpenMP reads this once, when torch loads it, so this runs before torch is imported."""
    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS", "").strip() == "1":
        return OmpWaitChoice({}, users_wait(env) or "one thread: nothing to wait for")
    busy_cores = probe()
    already_set = users_wait(env)
    if already_set:
        return OmpWaitChoice({}, already_set, busy_cores)
    choice = omp_wait_for(busy_cores)
    env.update(choice.env)
    return choice


def omp_wait_description(choice: Optional[OmpWaitChoice], env=None) -> str:
    """How waiting OpenMP threads behave in this process, for the start-up line: what the entry script
    chose (`choice`, None when the command was not started through `commands.cli.run_main`), or what the
    environment says."""
    if choice is not None:
        return choice.reason
    return users_wait(os.environ if env is None else env) or "OpenMP's default wait"


def users_wait(env) -> str:
    """The wait the environment sets before any choice of ours ("" when it sets none)."""
    chosen = [f"{k}={env[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in env]
    return "idle threads wait as " + ", ".join(chosen) + " says" if chosen else ""


# glibc's mallopt options
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse: no large block is mapped and unmapped, and the heap
    is not trimmed back. By default a CPU training step's activations are mapped afresh each step, and
    the kernel zeroes every page again on its first touch (thousands of page faults per step, most of
    the step's system time). Other processes get the memory back when this one ends; the batch finder
    still measures what is live (it releases the heap explicitly, `engine.runtime.memory.release_freed_heap`).
    Large requests glibc cannot serve from the heap still get their own mapping. Returns False where
    the C library is not glibc."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    settings = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))
    return all(mallopt(option, value) == 1 for option, value in settings)
