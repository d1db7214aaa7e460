"""The runtime every command sets up the same way, from the config: the device, the precision, the process
group (under torchrun), the CPU threads and how idle ones wait, host memory reuse and cudnn autotuning.

`start_runtime` takes the first steps (device, precision, processes); `Runtime.apply_cpu_policy` sets the
threads once the count to keep is known (a resume reads it from its checkpoint, which needs the run
directory first); `build_runtime` does both, for the commands that know it at once.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

import imgcls.runtime.distributed as dist_utils
from imgcls.runtime.cpu_tuning import apply_cpu_policy
from imgcls.runtime.device import enable_cudnn_autotune, resolve_amp, select_device

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    device: torch.device
    amp_dtype: Optional[torch.dtype]          # autocast dtype (None: full precision)
    dist: dist_utils.DistInfo = field(default_factory=dist_utils.DistInfo)
    threads: int = 0                          # intra-op threads of this process (0: not set yet)
    threads_source: str = ""                  # where the count came from, how idle threads wait, memory

    def apply_cpu_policy(self, threads_setting, reuse_host_memory: bool, saved_threads: Optional[int] = None,
                         agree_over_ranks: bool = False) -> None:
        """Set the thread count (`runtime.cpu_tuning.apply_cpu_policy`); with `agree_over_ranks`, every
        rank takes the fewest any rank chose (the checkpoint records one count). A resume whose recorded
        count (`saved_threads`) cannot be kept warns: sums over another count round differently."""
        threads, source = apply_cpu_policy(threads_setting, reuse_host_memory, saved_threads)
        if agree_over_ranks:
            agreed = dist_utils.min_over_ranks(threads, self.device)
            if agreed != threads:
                torch.set_num_threads(agreed)
                threads, source = agreed, f"{source}; the fewest of any rank"
        if saved_threads is not None and threads != saved_threads:
            log.warning("resuming with %d CPU thread(s) where the checkpoint's run used %d (%s): the run goes "
                        "on, but not bitwise equal to an uninterrupted one (train.threads=%d keeps the count)",
                        threads, saved_threads, source.split(";")[0], saved_threads)
        self.threads, self.threads_source = threads, source


def start_runtime(cfg, distributed: bool = False,
                  device_setting: Optional[str] = None, amp_setting: Optional[str] = None,
                  fp32_only: bool = False) -> Runtime:
    """The device (`train.device`, or `device_setting`), the precision (`train.amp`, or `amp_setting`;
    none for a model that runs only in fp32), cudnn autotuning, and with `distributed` the process group
    torchrun describes. Config errors (ConfigError, exit 2) before any work."""
    world = dist_utils.env_world_size() if distributed else 1
    local_rank = dist_utils.env_local_rank() if distributed else 0
    device = select_device(device_setting or cfg.train.device, local_rank, world)
    amp_dtype = None if fp32_only else resolve_amp(amp_setting or cfg.train.amp, device)
    if distributed:
        dist_utils.check_sync_bn(cfg.model.sync_bn, device.type, world)
    dist = dist_utils.init_distributed(device.type) if distributed else dist_utils.DistInfo()
    enable_cudnn_autotune(device)
    return Runtime(device, amp_dtype, dist)


def build_runtime(cfg, saved_threads: Optional[int] = None,
                  distributed: bool = False, training: bool = True, **settings) -> Runtime:
    """`start_runtime`, then the CPU threads: `saved_threads` is the count a checkpoint's run used (eval.py
    and infer.py keep it: their sums then round as validation's did). `train.reuse_host_memory` applies
    only with `training`: predictions gained nothing from it (docs/performance.md, "CPU tuning"), and a server would
    keep what it freed."""
    runtime = start_runtime(cfg, distributed, **settings)
    runtime.apply_cpu_policy(cfg.train.threads, cfg.train.reuse_host_memory and training, saved_threads,
                             agree_over_ranks=distributed)
    return runtime
