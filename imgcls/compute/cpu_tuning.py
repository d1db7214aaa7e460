"""The CPU tuning, in one place: how waiting OpenMP threads behave, how many threads the main process runs,
and whether freed host memory is kept. docs/performance.md ("CPU tuning") has what each piece measured.

Two moments, both once per process:

- `tune_process_start`, which `cli.run_main` calls before any command imports torch (OpenMP
  reads its wait settings once, when torch loads it): the cores' load is probed and the wait chosen by it.
  The choice and the load stay in this module (`process_start`); no command passes them on.
- `apply_cpu_policy`, once the config (and a resumed checkpoint's thread count) is known
  (`compute.device.Runtime.apply_cpu_policy`): the thread count (`train.threads`), and with
  `train.reuse_host_memory` glibc's malloc keeps freed memory.

Nothing here imports torch at module level, so the entry scripts can import it before torch loads."""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Callable, Optional

from imgcls.core.host import busy_cores_of_others, usable_cpus

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


@dataclass
class OmpWaitChoice:
    """What `choose_omp_wait` set, and why (for the start-up line)."""

    env: dict                     # the variables it set (empty: none)
    reason: str
    busy_cores: Optional[float] = None  # other processes' load at start (None: not probed, or unknown)


def omp_wait_for(busy_cores: Optional[float]) -> OmpWaitChoice:
    """On idle cores OpenMP's own wait (libgomp spins for milliseconds before it sleeps) keeps the many
    small parallel regions of a step from paying a wake-up each. Beside other busy processes that spin
    takes the cores the threads being waited for need, and every step waits for them: there the threads
    spin for a few microseconds, then sleep (OMP_WAIT_POLICY=PASSIVE, which other OpenMP runtimes read,
    and GOMP_SPINCOUNT). The wait changes no number computed (the thread count does: `choose_threads`)."""
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
    OMP_NUM_THREADS=1 needs neither: one thread has nobody to wait for, and its count is fixed."""
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


def users_wait(env) -> str:
    """The wait the environment sets before any choice of ours ("" when it sets none)."""
    chosen = [f"{k}={env[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in env]
    return "idle threads wait as " + ", ".join(chosen) + " says" if chosen else ""


# What `tune_process_start` chose in this process (None: the process did not start through run_main,
# as in tests and library use).
_process_start: Optional[OmpWaitChoice] = None


def tune_process_start(env=None, probe: Callable[[], Optional[float]] = busy_cores_of_others) -> OmpWaitChoice:
    """The process-start half of the CPU tuning: probe the load and choose OpenMP's wait by it
    (`choose_omp_wait`), and keep both for `apply_cpu_policy`. Call before torch is imported."""
    global _process_start
    _process_start = choose_omp_wait(env, probe)
    return _process_start


def process_start() -> Optional[OmpWaitChoice]:
    """What `tune_process_start` chose, or None where it did not run."""
    return _process_start


def omp_wait_description(env=None) -> str:
    """How waiting OpenMP threads behave in this process, for the start-up line and benchmark.py: what
    `tune_process_start` chose, or (where it did not run) what the environment says."""
    if _process_start is not None:
        return _process_start.reason
    return users_wait(os.environ if env is None else env) or "OpenMP's default wait"


# glibc's mallopt options
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse: no large block is mapped and unmapped, and the heap
    is not trimmed back. By default a CPU training step's activations are mapped afresh each step, and
    the kernel zeroes every page again on its first touch (thousands of page faults per step, most of
    the step's system time). Other processes get the memory back when this one ends; the batch finder
    still measures what is live (it releases the heap explicitly, `compute.memory.release_freed_heap`).
    Large requests glibc cannot serve from the heap still get their own mapping. Returns False where
    the C library is not glibc."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    settings = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))
    return all(mallopt(option, value) == 1 for option, value in settings)


def apply_cpu_policy(threads_setting, reuse_host_memory: bool = True,
                     saved_threads: Optional[int] = None) -> tuple[int, str]:
    """Set torch's intra-op threads by `choose_threads` (with `saved_threads`, the count a checkpoint's run
    computed with, for a resume, eval.py and infer.py) and, with `reuse_host_memory`
    (`train.reuse_host_memory`), keep freed host memory for reuse (`keep_freed_memory`); returns (threads,
    where the count came from, how idle threads wait and what memory does). `idle_cores` takes the load
    measured at process start, or measures it here where none was."""
    import torch

    busy = _process_start.busy_cores if _process_start is not None else None
    if threads_setting == "idle_cores" and busy is None:
        busy = busy_cores_of_others()
    threads, source = choose_threads(threads_setting, usable_cpus(), os.environ, busy, saved_threads)
    torch.set_num_threads(threads)
    memory = "freed memory kept for reuse" if reuse_host_memory and keep_freed_memory() else "malloc's defaults"
    return threads, f"{source}; {omp_wait_description()}; {memory}"
