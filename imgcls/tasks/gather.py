"""Sums and rows of every process (no-ops in a single process): what makes a metric exact under DDP."""
from __future__ import annotations

import torch
import torch.distributed as dist


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if distributed():
        dist.all_reduce(tensor)
    return tensor


def gather_rows(rows: torch.Tensor) -> torch.Tensor:
    """Every rank's rows, rank 0's first (a single process: `rows`). Ranks may hold different counts: each
    pads to the largest for the all_gather and the padding is cut off again."""
    if not distributed():
        return rows
    world = dist.get_world_size()
    count = torch.tensor([rows.shape[0]], dtype=torch.int64, device=rows.device)
    counts = [torch.zeros_like(count) for _ in range(world)]
    dist.all_gather(counts, count)
    sizes = [int(c) for c in counts]
    padded = torch.zeros((max(sizes), *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([part[:size] for part, size in zip(parts, sizes)])
