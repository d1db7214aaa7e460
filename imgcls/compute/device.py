"""Device and precision choices, and `DeviceInput`: how a uint8 batch becomes the model's input.

One `DeviceInput` (device, mean, std, channels_last, AMP dtype) serves training, evaluation and
prediction: `prepare()` moves and normalises a batch, `autocast()` opens the precision context.

The runtime every command sets up the same way, from the config: the device, the precision, the process
group (under torchrun), the CPU threads and how idle ones wait, host memory reuse and cudnn autotuning.

`start_runtime` takes the first steps (device, precision, processes); `Runtime.apply_cpu_policy` sets the
threads once the count to keep is known (a resume reads it from its checkpoint, which needs the run
directory first); `build_runtime` does both, for the commands that know it at once."""
from __future__ import annotations

import contextlib
import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch

import imgcls.compute.distributed as dist_utils
from imgcls.compute.cpu_tuning import apply_cpu_policy
from imgcls.core.errors import ConfigError
from imgcls.data.transforms import normalize_batch

log = logging.getLogger(__name__)


PRECISION_NAMES = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def precision_name(amp_dtype: Optional[torch.dtype]) -> str:
    """`fp32`, `bf16` or `fp16`: what a log line or a benchmark reports."""
    return PRECISION_NAMES[amp_dtype]


def amp_setting(amp_dtype: Optional[torch.dtype]) -> str:
    """The `train.amp` value that selects this precision (`none` for full precision)."""
    return "none" if amp_dtype is None else PRECISION_NAMES[amp_dtype]


def select_device(setting: str, local_rank: int = 0, world_size: int = 1) -> torch.device:
    if setting == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(setting)
    except RuntimeError as err:
        raise ConfigError(f"'train.device' = {setting}: not a device ({err}); use auto, cpu, cuda or cuda:N") from err
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"'train.device' = {setting}, but CUDA is not available here; use train.device=cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    elif device.type == "cuda" and world_size > 1:
        raise ConfigError(f"'train.device' = {setting}: under torchrun each process takes the GPU of its local rank; "
                          f"use train.device=auto (or cuda) and choose GPUs with CUDA_VISIBLE_DEVICES")
    return device


def bf16_is_fast(cpuinfo: str, env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether /proc/cpuinfo's text names AMX tiles for bf16 (`amx_bf16`), where bf16 matmuls and convolutions
    run in the tiles, and oneDNN may use them (`onednn_isa_cap`). AVX512-BF16 alone does not make them faster:
    resnet18 training steps there ran at 0.71-0.80x of fp32's (docs/performance.md), so `train.amp: auto`
    keeps fp32 on such a CPU."""
    cap = onednn_isa_cap(os.environ if env is None else env)
    return "amx_bf16" in cpuinfo and (cap is None or "AMX" in cap)


# oneDNN's ISA names (ONEDNN_MAX_CPU_ISA) below the first with bf16 instructions (avx512_core_bf16): a process
# capped to one of them emulates bf16 whatever the CPU has
ONEDNN_ISAS_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI")


def onednn_isa_cap(env: Mapping[str, str]) -> Optional[str]:
    """The instruction set oneDNN is capped to by the environment (ONEDNN_MAX_CPU_ISA, or its older name
    DNNL_MAX_CPU_ISA), upper-case; None when it is not capped."""
    cap = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return cap if cap and cap != "ALL" else None


# Instructions that compute in bf16 (x86: AVX512-BF16, AMX; Arm: the BF16 extension). Without any of them
# PyTorch emulates bf16 by converting around every op: resnet18 trained at 2 img/s on an AVX2-only EPYC
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_flags(cpuinfo: str) -> Optional[set[str]]:
    """The feature flags of /proc/cpuinfo's first `flags` (x86) or `Features` (Arm) line; None when it has none."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return set(value.split())
    return None


def bf16_emulated(cpuinfo: str, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why bf16 is emulated on the CPU that /proc/cpuinfo's text describes (its flags name neither AVX512-BF16
    nor AMX nor Arm's BF16, or the environment caps oneDNN below them), or None where it runs natively or the
    flags are unknown."""
    cap = onednn_isa_cap(os.environ if env is None else env)
    if cap in ONEDNN_ISAS_WITHOUT_BF16:
        return (f"ONEDNN_MAX_CPU_ISA={cap} caps oneDNN below AVX512-BF16, so PyTorch emulates bf16, converting "
                "around every operation: several times slower than fp32")
    flags = cpu_flags(cpuinfo)
    if flags is None or flags.intersection(NATIVE_BF16_FLAGS):
        return None
    return ("this CPU has neither AVX512-BF16 nor AMX (no avx512_bf16 / amx_bf16 in /proc/cpuinfo's flags), so "
            "PyTorch emulates bf16, converting around every operation: several times slower than fp32")


def read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


@functools.lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> bool:
    """`bf16_is_fast` for this machine (False where /proc/cpuinfo cannot be read)."""
    return bf16_is_fast(read_cpuinfo())


@functools.lru_cache(maxsize=1)
def cpu_bf16_emulated() -> Optional[str]:
    """`bf16_emulated` for this machine."""
    return bf16_emulated(read_cpuinfo())


_BF16_WARNINGS = {"said": set(), "pending": []}


def warn_emulated_bf16(reason: str) -> None:
    """Said once per process, whichever command chose bf16. Before the process's logging is set up (train.py
    chooses the precision before its run directory and train.log exist) it waits for `say_pending_warnings`,
    so it reaches train.log as a WARNING rather than Python's bare last-resort line."""
    if reason in _BF16_WARNINGS["said"]:
        return
    if not logging.getLogger().handlers:
        if reason not in _BF16_WARNINGS["pending"]:
            _BF16_WARNINGS["pending"].append(reason)
        return
    _BF16_WARNINGS["said"].add(reason)
    log.warning("bf16 (train.amp or --amp) on a CPU that emulates it: %s. train.amp=auto (or --amp none) "
                "runs fp32 here", reason)


def say_pending_warnings() -> None:
    """Log the warnings given before logging was set up (call once it is)."""
    pending, _BF16_WARNINGS["pending"] = _BF16_WARNINGS["pending"], []
    for reason in pending:
        warn_emulated_bf16(reason)


def inference_amp(setting: str, device: torch.device) -> str:
    """The precision an inference command uses for a checkpoint trained at `setting` (its train.amp), on
    `device` of the machine it runs on: fp16 off CUDA becomes `auto`, bf16 on a CPU that emulates it fp32
    (`none`); what --amp names is used as named instead."""
    if setting == "fp16" and device.type != "cuda":
        return "auto"
    if setting == "bf16" and device.type == "cpu" and cpu_bf16_emulated():
        log.info("precision: fp32, not the checkpoint's bf16 (%s; --amp bf16 keeps it)", cpu_bf16_emulated())
        return "none"
    return setting


INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "i8mm")  # x86 VNNI / AMX, Arm dot product


def int8_slow_reason(cpuinfo: str) -> Optional[str]:
    """Why an int8 ONNX model may run no faster than fp32 on this CPU (None where it has int8 dot-product
    instructions: /proc/cpuinfo's flags name VNNI or AMX int8, or Arm's dot product). Without them
    onnxruntime's u8s8 kernels widen to 16 bits on plain AVX2 and gain little or nothing."""
    flags = set(cpuinfo.split())
    if flags & set(INT8_DOT_FLAGS):
        return None
    return ("this CPU has no int8 dot-product instructions (none of " + ", ".join(INT8_DOT_FLAGS) + " in "
            "/proc/cpuinfo), so onnxruntime's int8 kernels may be no faster than the fp32 export here; int8 still "
            "makes the file ~4x smaller. Compare both on this machine (docs/export.md, 'int8 measured')")


def resolve_amp(setting: str, device: torch.device) -> Optional[torch.dtype]:
    """`auto` picks bf16 where the hardware runs it well, else full precision (None)."""
    if setting == "none":
        return None
    if setting == "bf16":
        if device.type == "cpu" and cpu_bf16_emulated():
            warn_emulated_bf16(cpu_bf16_emulated())
        return torch.bfloat16
    if setting == "fp16":
        if device.type != "cuda":
            raise ConfigError("'train.amp' = fp16 needs a CUDA device (use bf16 or none on CPU)")
        return torch.float16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # Without AMX, bf16 steps on the CPU are slower than fp32's (AVX2 converts around each op; AVX512-BF16
    # measured 0.75-0.8x), so auto keeps fp32 there; the measurements are in docs/performance.md.
    return torch.bfloat16 if cpu_has_fast_bf16() else None


def pin_memory_for(setting: Optional[bool], device: torch.device) -> bool:
    """`data.pin_memory`: null means pinned exactly when the batches go to a CUDA device."""
    return setting if setting is not None else device.type == "cuda"


def memory_format(channels_last: bool) -> torch.memory_format:
    return torch.channels_last if channels_last else torch.contiguous_format


def autocast(device: torch.device, amp_dtype: Optional[torch.dtype]):
    """The autocast context for `amp_dtype`, or a no-op for full precision."""
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=amp_dtype)


def enable_cudnn_autotune(device: torch.device) -> None:
    """cudnn picks the fastest convolution algorithms for the (fixed) input shapes; the same choice in
    training, evaluation and inference, so eval.py reproduces validation's numbers."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True


def is_out_of_memory(err: BaseException) -> bool:
    """CUDA's OutOfMemoryError, the CPU allocator's "can't allocate memory" RuntimeError, a MemoryError."""
    text = str(err).lower()
    return (isinstance(err, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in text
            or "can't allocate memory" in text)


@dataclass
class DeviceInput:
    """How loader batches (uint8, CHW) reach the model: on `device`, normalised, in `channels_last`, under
    autocast to `amp_dtype` (None: fp32)."""

    device: torch.device
    mean: tuple
    std: tuple
    channels_last: bool
    amp_dtype: Optional[torch.dtype]

    @classmethod
    def from_config(cls, cfg, device: torch.device, amp_dtype: Optional[torch.dtype],
                    channels_last: Optional[bool] = None) -> "DeviceInput":
        cl = cfg.train.channels_last if channels_last is None else channels_last
        if isinstance(cfg.data.mean, str) or isinstance(cfg.data.std, str):
            raise ConfigError(f"data.mean = {cfg.data.mean!r}, data.std = {cfg.data.std!r}: auto is measured by "
                              f"train.py on the training split; this command needs the numbers (a checkpoint "
                              f"carries them)")
        return cls(device, tuple(cfg.data.mean), tuple(cfg.data.std), cl, amp_dtype)

    def prepare(self, images: torch.Tensor) -> torch.Tensor:
        images = images.to(self.device, non_blocking=True)
        return normalize_batch(images, self.mean, self.std, channels_last=self.channels_last)

    def labels(self, targets: torch.Tensor) -> torch.Tensor:
        return targets.to(self.device, non_blocking=True)

    def autocast(self):
        return autocast(self.device, self.amp_dtype)


@dataclass
class Runtime:
    device: torch.device
    amp_dtype: Optional[torch.dtype]          # autocast dtype (None: full precision)
    dist: dist_utils.DistInfo = field(default_factory=dist_utils.DistInfo)
    threads: int = 0                          # intra-op threads of this process (0: not set yet)
    threads_source: str = ""                  # where the count came from, how idle threads wait, memory

    def apply_cpu_policy(self, threads_setting, reuse_host_memory: bool, saved_threads: Optional[int] = None,
                         agree_over_ranks: bool = False) -> None:
        """Set the thread count (`compute.cpu_tuning.apply_cpu_policy`); with `agree_over_ranks`, every
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
