"""Measuring memory: CUDA's allocator counters, or the process's resident set on the CPU."""
from __future__ import annotations

import contextlib
import ctypes
import os
import resource
from dataclasses import dataclass
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


def release_freed_heap() -> None:
    """Hand memory that glibc keeps after `free` back to the system (malloc_trim), so that the RSS measures
    what is live: otherwise a step after a larger one reuses the kept pages and seems to need nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window: CUDA's max-allocated counter, or the process's RSS high-water mark
    (Linux resets it when 5 is written to /proc/self/clear_refs, after the freed heap is released;
    elsewhere the lifetime peak is kept)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return
    release_freed_heap()
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


def current_memory_bytes(device: torch.device) -> int:
    """What is held now: CUDA allocated bytes, or the process's RSS on the CPU (the same kind of number as
    `peak_memory_bytes`, so peak minus this is what a step added)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return current_rss_bytes()


def parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def gradient_bytes(model: torch.nn.Module) -> int:
    """The gradients a backward pass allocates (one per trainable parameter, in its dtype)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


# optimizer state per trainable parameter, in parameter-sizes, before its first step created it
STATE_COPIES = {"SGD": lambda group: 1 if group.get("momentum", 0) else 0, "AdamW": lambda group: 2,
                "Adam": lambda group: 2}


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors (momentum, Adam moments); estimated from its kind while the
    state is still empty (before the first step)."""
    held = sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if isinstance(t, torch.Tensor))
    if held:
        return held
    copies = STATE_COPIES.get(type(optimizer).__name__, lambda group: 0)
    return sum(copies(group) * p.numel() * p.element_size() for group in optimizer.param_groups
               for p in group["params"] if p.requires_grad)


@dataclass
class MemoryBreakdown:
    """What a training step's memory holds: the static part (parameters, optimizer state, and what the
    runtime held before the step: allocator pools, libraries on the CPU), the gradients, and activations
    that grow with the batch (measured: peak minus the static part, at two batch sizes)."""

    parameters: int
    gradients: int
    optimizer_state: int
    other: int                      # held before the step besides parameters and optimizer state
    activations_per_sample: float
    measured: tuple = ()            # the two (batch, peak bytes) it was fitted to

    def total(self, batch: int) -> float:
        return self.static + self.activations_per_sample * batch

    @property
    def static(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.other

    def as_dict(self, batch: Optional[int] = None) -> dict:
        out = {"parameters_mb": mib(self.parameters), "gradients_mb": mib(self.gradients),
               "optimizer_state_mb": mib(self.optimizer_state), "other_mb": mib(self.other),
               "activations_per_sample_mb": round(self.activations_per_sample / 2**20, 3)}
        if batch is not None:
            out.update(batch=batch, activations_mb=mib(int(self.activations_per_sample * batch)),
                       total_mb=mib(int(self.total(batch))))
        return out

    def describe(self, batch: int) -> str:
        acts = self.activations_per_sample * batch
        return (f"parameters {mib(self.parameters):.1f} MiB, gradients {mib(self.gradients):.1f} MiB, optimizer "
                f"state {mib(self.optimizer_state):.1f} MiB, activations {mib(int(acts)):.1f} MiB at batch {batch} "
                f"({self.activations_per_sample / 2**20:.2f} MiB per sample), other {mib(self.other):.1f} MiB")


def breakdown_from_steps(parameters: int, gradients: int, optimizer_state: int, held_before: int,
                         small: tuple[int, int], large: tuple[int, int]) -> MemoryBreakdown:
    """The breakdown from two measured steps, (batch, peak bytes) each, and `held_before` (what was held
    before them, parameters and optimizer state included): activations per sample are the slope of
    peak minus the static part."""
    (b1, p1), (b2, p2) = small, large
    per_sample = max(0.0, (p2 - p1) / (b2 - b1)) if b2 != b1 else 0.0
    other = max(0, held_before - parameters - optimizer_state)
    return MemoryBreakdown(parameters, gradients, optimizer_state, other, per_sample, (small, large))


FRAGMENTED_SHARE = 0.25   # reserved-but-unallocated above this share of the allocated memory: fragmentation


@contextlib.contextmanager
def explain_out_of_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: int, device: torch.device):
    """Add to a CUDA out-of-memory error what fills the memory (parameters, gradients, optimizer state; the
    activations of `batch` the rest) and, when reserved is much larger than allocated, the allocator
    setting against fragmentation. The entry script prints these notes with its advice."""
    try:
        yield
    except torch.OutOfMemoryError as err:
        err.add_note(f"what fills the memory at batch {batch}: parameters {mib(parameter_bytes(model)):.1f} MiB, "
                     f"gradients {mib(gradient_bytes(model)):.1f} MiB, optimizer state "
                     f"{mib(optimizer_state_bytes(optimizer)):.1f} MiB; the activations of the batch take the rest "
                     f"and grow with it")
        if device.type == "cuda":
            allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
            if reserved - allocated > FRAGMENTED_SHARE * allocated:
                err.add_note(f"reserved {mib(reserved):.0f} MiB is much more than allocated {mib(allocated):.0f} "
                             f"MiB (fragmentation): try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
        raise
