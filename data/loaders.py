"""DataLoaders: pinned, multi-worker, seeded; drop_last for training, never for evaluation."""
from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import DataLoader

from data.samplers import ShardSampler, TrainSampler


def seed_worker(worker_id: int) -> None:
    # Per-sample randomness is seeded by the sampler; this only keeps numpy / random users in
    # third-party transforms from repeating across workers.
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def _worker_options(num_workers: int, persistent: bool, prefetch_factor: int) -> dict:
    if num_workers == 0:
        return {}
    return {"persistent_workers": persistent, "prefetch_factor": prefetch_factor, "worker_init_fn": seed_worker}


def build_train_loader(dataset, sampler: TrainSampler, batch_size: int, num_workers: int, pin_memory: bool,
                       persistent_workers: bool, prefetch_factor: int, seed: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      pin_memory=pin_memory, drop_last=True, generator=torch.Generator().manual_seed(seed),
                      **_worker_options(num_workers, persistent_workers, prefetch_factor))


def build_eval_loader(dataset, batch_size: int, num_workers: int, pin_memory: bool, rank: int = 0,
                      world_size: int = 1, persistent_workers: bool = False, prefetch_factor: int = 2) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, sampler=ShardSampler(len(dataset), rank, world_size),
                      num_workers=num_workers, pin_memory=pin_memory, drop_last=False,
                      generator=torch.Generator().manual_seed(0),
                      **_worker_options(num_workers, persistent_workers, prefetch_factor))
