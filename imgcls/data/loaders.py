"""DataLoaders: pinned, multi-worker, seeded; drop_last for training, never for evaluation; worker processes
that `shutdown_workers` ends at once on any exit path."""
from __future__ import annotations

import logging
import random
import signal
import time
import weakref

import numpy as np
from typing import Optional

import torch
from torch.utils.data import DataLoader
from torch.utils.data import _utils as loader_utils

from imgcls.data.samplers import UnpaddedEvalSampler, TrainSampler

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
