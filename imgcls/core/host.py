"""Facts about the machine that need no torch: usable cores, their load, this process's age. The policy built on
them (threads, OpenMP's wait, malloc) is compute/cpu_tuning.py."""
from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Optional


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


PROBE_SECONDS = 0.1


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


_IMPORTED_AT = time.monotonic()


def process_age_s() -> float:
    """Seconds since this process started (interpreter start-up and imports included): from /proc on Linux,
    else since this module was imported (the entry scripts import it first)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started_ticks = int(fields[19])  # field 22, starttime, in clock ticks after boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_AT
