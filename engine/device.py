"""Device and precision choices."""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from engine.config import ConfigError


def select_device(setting: str, local_rank: int = 0) -> torch.device:
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
    elif device.type == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(f"'train.device' = {setting}: under torchrun each process takes the GPU of its local rank; "
                          f"use train.device=auto (or cuda) and choose GPUs with CUDA_VISIBLE_DEVICES")
    return device


@functools.lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> bool:
    """AMX or AVX512-BF16 instructions: bf16 matmuls and convolutions run natively on this CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return any(flag in flags for flag in ("amx_bf16", "avx512_bf16"))


def resolve_amp(setting: str, device: torch.device) -> Optional[torch.dtype]:
    """`auto` picks bf16 where the hardware runs it well, else full precision (None)."""
    if setting == "none":
        return None
    if setting == "bf16":
        return torch.bfloat16
    if setting == "fp16":
        if device.type != "cuda":
            raise ConfigError("'train.amp' = fp16 needs a CUDA device (use bf16 or none on CPU)")
        return torch.float16
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    # Measured (benchmark.py --mode train --synthetic, resnet18, one thread, README "Performance"): on an
    # AVX512-BF16 CPU without AMX, bf16 autocast trains 1.2x faster than fp32 at 32 px and 1.8x at 128 px,
    # so AVX512-BF16 is enough. Without either, bf16 has no native kernels (AVX2 converts around each op),
    # so auto keeps fp32 there (not measured on this machine, which has AVX512-BF16).
    return torch.bfloat16 if cpu_has_fast_bf16() else None


def pin_memory_for(setting: Optional[bool], device: torch.device) -> bool:
    """`data.pin_memory`: null means pinned exactly when the batches go to a CUDA device."""
    return setting if setting is not None else device.type == "cuda"
