"""Samplers whose order is a pure function of (seed, epoch), so a run can resume at any batch.

`TrainSampler` yields `(sample index, augmentation seed)` pairs for one rank's share of an epoch. The
augmentation seed is derived from (seed, epoch, rank, position), never from worker state, so the same
sample at the same position gets the same crop whatever the worker count or a resume.

Repeated augmentation (`data.repeated_augment` = k > 1, torchvision's RASampler / timm's
RepeatAugSampler): the epoch takes the first ceil(N / k) images of a seeded permutation, each k times in
a row, cut to the epoch's usual length, and rank r takes positions r, r + world, ... of that list. The
epoch keeps the dataset's length; the k copies of an image sit at different positions (so get different
augmentation seeds) and, with at least k processes, on different ranks.
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


def repeated_order(n: int, repeats: int, total: int, generator: torch.Generator) -> list[int]:
    """`total` positions: a permutation of range(n) (drawn from `generator`) with each image repeated
    `repeats` times in a row, cut to `total` (from the start: the last images of the permutation are left
    out, as RASampler does; wrapping around when `total` exceeds n x repeats)."""
    order = torch.randperm(n, generator=generator).repeat_interleave(repeats).tolist()
    while len(order) < total:
        order += order[: total - len(order)]
    return order[:total]


def class_balanced_weights(labels: list[int]) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(labels))
    return 1.0 / counts[torch.tensor(labels)].double()


class TrainSampler(Sampler):
    """One rank's share of a training epoch, from batch `start_batch` on.

    mode: `random` (shuffled, via DistributedSampler), `weighted` (class-balanced draws with
    replacement, one seeded draw per epoch split into disjoint per-rank shares) or `sequential`.
    repeats: repeated augmentation (`random` mode only): each image taken this many times per epoch.
    """

    def __init__(self, labels: list[int], mode: str, seed: int, batch_size: int, rank: int = 0, world_size: int = 1,
                 repeats: int = 1):
        if repeats > 1 and mode != "random":
            raise ValueError(f"repeated augmentation needs the random sampler, not {mode!r}")
        self.labels = labels
        self.mode = mode
        self.repeats = repeats
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
        n = len(self.labels)
        per_rank = -(-n // self.world_size)
        if self.repeats > 1:
            generator = torch.Generator().manual_seed(mix_seed(self.seed, epoch, 0x2EA7))
            order = repeated_order(n, self.repeats, per_rank * self.world_size, generator)
            return order[self.rank::self.world_size]
        if self.mode != "weighted":
            self.shuffler.set_epoch(epoch)
            return list(self.shuffler)
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


class UnpaddedEvalSampler(Sampler):
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
