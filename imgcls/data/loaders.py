"""Samplers whose order is a pure function of (seed, epoch), so a run can resume at any batch.

`TrainSampler` yields `(sample index, augmentation seed)` pairs for one rank's share of an epoch. The
augmentation seed is derived from (seed, epoch, rank, position), never from worker state, so the same
sample at the same position gets the same crop whatever the worker count or a resume.

Repeated augmentation (`data.repeated_augment` = k > 1, torchvision's RASampler / timm's
RepeatAugSampler): the epoch takes the first ceil(N / k) images of a seeded permutation, each k times in
a row, cut to the epoch's usual length, and rank r takes positions r, r + world, ... of that list. The
epoch keeps the dataset's length; the k copies of an image sit at different positions (so get different
augmentation seeds) and, with at least k processes, on different ranks.

DataLoaders: pinned, multi-worker, seeded; drop_last for training, never for evaluation; worker processes
that `shutdown_workers` ends at once on any exit path."""
from __future__ import annotations

import logging
import random
import signal
import time
import weakref
from typing import Optional

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler, WeightedRandomSampler, _utils as loader_utils

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

log = logging.getLogger(__name__)


# A worker that got a SIGTERM keeps serving this long, then exits on its own.
WORKER_SIGTERM_GRACE_S = 60


# On shutdown, a worker that has not exited this long after being asked is killed (one blocked in a read).
WORKER_STOP_WAIT_S = 2.0


class Loader(DataLoader):
    """A DataLoader that keeps track of its multi-process iterators, so `shutdown_workers` can end their
    workers on any exit path. Left to torch, the workers of an iterator that a failing run's traceback
    still references are shut down only at interpreter exit, which first sends them SIGTERM: our workers
    survive that for WORKER_SIGTERM_GRACE_S (see `leave_stop_signals_to_the_main_process`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._live_iterators = weakref.WeakSet()

    def _get_iterator(self):
        iterator = super()._get_iterator()
        if self.num_workers > 0:
            self._live_iterators.add(iterator)
        return iterator


def original_message(err: BaseException) -> str:
    """The message of an error raised in a loader worker, without the "Caught ... in DataLoader worker
    process N. Original Traceback ..." that torch wraps it in when re-raising it here."""
    text = str(err)
    head = f"{type(err).__module__}.{type(err).__qualname__}: "
    at = text.rfind("\n" + head)
    return text[at + 1 + len(head):] if "Original Traceback" in text and at >= 0 else text


def shutdown_workers(*loaders) -> None:
    """End the worker processes of `loaders` now: asked to exit, then killed after WORKER_STOP_WAIT_S."""
    for loader in loaders:
        for iterator in list(getattr(loader, "_live_iterators", ())):
            _stop_iterator(iterator, WORKER_STOP_WAIT_S)
        if getattr(loader, "_iterator", None) is not None:
            loader._iterator = None  # a persistent iterator: the next iter() starts new workers


def _stop_iterator(it, wait_s: float) -> None:
    """torch's own shutdown (`_shutdown_workers`), with bounded waits: the pin-memory thread first (dying
    workers may leave partial data in the queue it reads), then the workers asked to exit, the ones still
    there after `wait_s` killed, off torch's SIGCHLD watch so their death raises nothing here."""
    if getattr(it, "_shutdown", True):
        return
    try:
        if it._worker_pids_set:
            loader_utils.signal_handling._remove_worker_pids(id(it))
            it._worker_pids_set = False
        if hasattr(it, "_pin_memory_thread"):
            it._pin_memory_thread_done_event.set()
            it._worker_result_queue.put((None, None))
            it._pin_memory_thread.join(wait_s)
        it._workers_done_event.set()
        for worker_id in range(len(it._workers)):
            if it._persistent_workers or it._workers_status[worker_id]:
                it._mark_worker_as_unavailable(worker_id, shutdown=True)
        deadline = time.monotonic() + wait_s
        for worker in it._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        for worker in it._workers:
            if worker.is_alive():
                log.warning("loader worker %d did not exit within %.0f s (blocked in a read?); killed it",
                            worker.pid, wait_s)
                worker.kill()
                worker.join(wait_s)
    except (AttributeError, AssertionError, OSError, ValueError) as err:  # another torch's internals
        log.debug("loader shutdown: %s; leaving it to torch", err)
    it._shutdown_workers()  # closes the queues; every worker is gone, so it waits for none


def seed_worker(worker_id: int) -> None:
    # Per-sample randomness is seeded by the sampler; this only keeps numpy / random users in
    # third-party transforms from repeating across workers.
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)
    leave_stop_signals_to_the_main_process()


def leave_stop_signals_to_the_main_process() -> None:
    """In a loader worker: survive a SIGTERM / SIGINT / SIGUSR1 sent to the whole process group (Slurm,
    Ctrl-C).

    The main process then finishes its step, saves last.pt and shuts the workers down; a worker that
    died at once would make it fail with "DataLoader worker killed by signal" instead. A second SIGTERM
    (torch's own clean-up) still ends the worker, and so does the grace period, so nothing can hang.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # Slurm's warning before the time limit, to the whole job

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
    return Loader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                  pin_memory=pin_memory, drop_last=True, generator=torch.Generator().manual_seed(seed),
                  **_worker_options(num_workers, persistent_workers, prefetch_factor))


def build_eval_loader(dataset, batch_size: int, num_workers: int, pin_memory: bool, rank: int = 0,
                      world_size: int = 1, persistent_workers: bool = False, prefetch_factor: int = 2,
                      limit_samples: int | None = None) -> DataLoader:
    sampler = UnpaddedEvalSampler(len(dataset), rank, world_size, limit_samples)
    return Loader(dataset, batch_size=batch_size, sampler=sampler,
                  num_workers=num_workers, pin_memory=pin_memory, drop_last=False,
                  generator=torch.Generator().manual_seed(0),
                  **_worker_options(num_workers, persistent_workers, prefetch_factor))


def build_stream_train_loader(dataset, batch_size: int, num_workers: int, pin_memory: bool,
                              prefetch_factor: int) -> DataLoader:
    """A shard stream's loader. Workers are started anew each epoch (not persistent): an iterable dataset's
    epoch (`set_epoch`) reaches the workers only when they start. Like every loader here it has its own
    generator: each iter() draws the workers' base seed, and from the global RNG that draw would move the
    stream a resumed run restores, depending on when the iterator starts (before or after a save)."""
    options = {"prefetch_factor": prefetch_factor, "worker_init_fn": seed_worker} if num_workers else {}
    return Loader(dataset, batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory,
                  drop_last=True, generator=torch.Generator().manual_seed(0), **options)


def build_stream_eval_loader(dataset, batch_size: int, num_workers: int, pin_memory: bool,
                             prefetch_factor: int = 2) -> DataLoader:
    options = {"prefetch_factor": prefetch_factor, "worker_init_fn": seed_worker} if num_workers else {}
    return Loader(dataset, batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory,
                  drop_last=False, generator=torch.Generator().manual_seed(0), **options)


def loader_length(loader) -> Optional[int]:
    """Batches per pass, or None for a loader over a stream (a shard stream has no length)."""
    try:
        return len(loader)
    except TypeError:
        return None
