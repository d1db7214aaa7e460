"""Measuring memory: CUDA's allocator counters, or the process's resident set on the CPU."""
from __future__ import annotations

import contextlib
import os
import resource
from typing import Optional

import torch


def _read_status_kb(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window: CUDA's max-allocated counter, or the process's RSS high-water mark
    (Linux resets it when 5 is written to /proc/self/clear_refs; elsewhere the lifetime peak is kept)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA max allocated since the last reset, or the process's peak RSS on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    hwm = _read_status_kb("VmHWM")
    if hwm is not None:
        return hwm * 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def available_memory_bytes() -> int:
    kb = None
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    kb = int(line.split()[1])
    if kb is None:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return kb * 1024


def current_rss_bytes() -> int:
    kb = _read_status_kb("VmRSS")
    return (kb or 0) * 1024


def mib(nbytes: int) -> float:
    return round(nbytes / 2**20, 1)
