"""Process-group set-up for torchrun (env://), and the few collectives the engine needs."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


class DistributedSetupError(Exception):
    """The environment asks for distributed training but the process group cannot start (exit 1)."""


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device_type: str) -> DistInfo:
    """Join the process group torchrun describes in the environment; a no-op for a single process."""
    world = env_world_size()
    if world <= 1:
        return DistInfo()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    try:
        dist.init_process_group(backend=backend, init_method="env://")
    except Exception as err:
        raise DistributedSetupError(
            f"WORLD_SIZE={world} asks for distributed training, but the {backend} process group did not start "
            f"(MASTER_ADDR={os.environ.get('MASTER_ADDR')}, MASTER_PORT={os.environ.get('MASTER_PORT')}, "
            f"RANK={rank}): {err}") from err
    return DistInfo(rank=rank, local_rank=local_rank, world_size=world)


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if `flag` is true on any rank (for stop requests)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def broadcast_buffers(model: torch.nn.Module, src: int = 0) -> None:
    """Copy BatchNorm running statistics (and other buffers) from rank `src` to all ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    for buffer in model.buffers():
        dist.broadcast(buffer, src)
