"""DataLoaders: pinned, multi-worker, seeded; drop_last for training, never for evaluation."""
from __future__ import annotations

import random
import signal

import numpy as np
import torch
from torch.utils.data import DataLoader

from data.samplers import ShardSampler, TrainSampler


# A worker that got a SIGTERM keeps serving this long, then exits on its own.
WORKER_SIGTERM_GRACE_S = 60


def seed_worker(worker_id: int) -> None:
    # Per-sample randomness is seeded by the sampler; this only keeps numpy / random users in
    # third-party transforms from repeating across workers.
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)
    leave_stop_signals_to_the_main_process()


def leave_stop_signals_to_the_main_process() -> None:
    """In a loader worker: survive a SIGTERM / SIGINT sent to the whole process group (Slurm, Ctrl-C).

    The main process then finishes its step, saves last.pt and shuts the workers down; a worker that
    died at once would make it fail with "DataLoader worker killed by signal" instead. A second SIGTERM
    (torch's own clean-up) still ends the worker, and so does the grace period, so nothing can hang.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def on_sigterm(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.alarm(WORKER_SIGTERM_GRACE_S)  # SIGALRM's default action ends the process

    signal.signal(signal.SIGTERM, on_sigterm)


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
                      world_size: int = 1, persistent_workers: bool = False, prefetch_factor: int = 2,
                      limit_samples: int | None = None) -> DataLoader:
    sampler = ShardSampler(len(dataset), rank, world_size, limit_samples)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                      num_workers=num_workers, pin_memory=pin_memory, drop_last=False,
                      generator=torch.Generator().manual_seed(0),
                      **_worker_options(num_workers, persistent_workers, prefetch_factor))


def build_stream_train_loader(dataset, batch_size: int, num_workers: int, pin_memory: bool,
                              prefetch_factor: int) -> DataLoader:
    """A shard stream's loader. Workers are started anew each epoch (not persistent): an iterable dataset's
    epoch (`set_epoch`) reaches the workers only when they start."""
    options = {"prefetch_factor": prefetch_factor, "worker_init_fn": seed_worker} if num_workers else {}
    return DataLoader(dataset, batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory,
                      drop_last=True, **options)


def build_stream_eval_loader(dataset, batch_size: int, num_workers: int, pin_memory: bool,
                             prefetch_factor: int = 2) -> DataLoader:
    options = {"prefetch_factor": prefetch_factor, "worker_init_fn": seed_worker} if num_workers else {}
    return DataLoader(dataset, batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory,
                      drop_last=False, **options)
