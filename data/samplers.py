"""Samplers whose order is a pure function of (seed, epoch), so a run can resume at any batch.

`TrainSampler` yields `(sample index, augmentation seed)` pairs for one rank's share of an epoch. The
augmentation seed is derived from (seed, epoch, rank, position), never from worker state, so the same
sample at the same position gets the same crop whatever the worker count or a resume.
"""
from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler, Sampler, WeightedRandomSampler

_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (a splitmix-style hash; stable across processes and runs)."""
    h = 0
    for p in parts:
        h = (h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * _MIX & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & _MASK


def class_balanced_weights(labels: list[int]) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(labels))
    return 1.0 / counts[torch.tensor(labels)].double()


class TrainSampler(Sampler):
    """One rank's share of a training epoch, from batch `start_batch` on.

    mode: `random` (shuffled, via DistributedSampler), `weighted` (class-balanced draws with
    replacement, one seeded draw per epoch split into disjoint per-rank shares) or `sequential`.
    """

    def __init__(self, labels: list[int], mode: str, seed: int, batch_size: int, rank: int = 0, world_size: int = 1):
        self.labels = labels
        self.mode = mode
        self.seed = seed
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.start_batch = 0
        n = len(labels)
        self.weights = class_balanced_weights(labels) if mode == "weighted" else None
        self.shuffler = DistributedSampler(range(n), num_replicas=world_size, rank=rank,
                                           shuffle=(mode == "random"), seed=seed, drop_last=False)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch = epoch
        self.start_batch = start_batch

    def epoch_indices(self, epoch: int) -> list[int]:
        """This rank's sample indices for `epoch`, in order."""
        if self.mode != "weighted":
            self.shuffler.set_epoch(epoch)
            return list(self.shuffler)
        n = len(self.labels)
        per_rank = -(-n // self.world_size)
        generator = torch.Generator().manual_seed(mix_seed(self.seed, epoch, 0x5EED))
        draws = list(WeightedRandomSampler(self.weights, per_rank * self.world_size, replacement=True,
                                           generator=generator))
        return draws[self.rank::self.world_size]

    def num_batches(self) -> int:
        """Full batches per epoch for this rank (the loader drops the short last one)."""
        return len(self.shuffler) // self.batch_size

    def __iter__(self):
        share = self.epoch_indices(self.epoch)
        for position in range(self.start_batch * self.batch_size, len(share)):
            yield share[position], mix_seed(self.seed, self.epoch, self.rank, position)

    def __len__(self) -> int:
        return max(0, len(self.shuffler) - self.start_batch * self.batch_size)


class ShardSampler(Sampler):
    """Evaluation: rank r gets indices r, r + world, ... with no padding, so every sample counts once.

    `limit`: only the first `limit` samples of the split (a dry run's `limit_val_batches x batch`), sharded
    the same way, so a limited validation covers the same samples at any world size."""

    def __init__(self, n: int, rank: int = 0, world_size: int = 1, limit: int | None = None):
        if limit is not None:
            n = min(n, limit)
        self.indices = list(range(rank, n, world_size))

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
