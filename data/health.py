"""Data policies the training run applies: how many unreadable files a split may have, and what to
tell a user whose model waits for data."""
from __future__ import annotations

from core.errors import BadDataError

# Above this share of a logging interval spent waiting for batches, the run says once what to change.
DATA_WAIT_WARN_FRAC = 0.2


def check_bad_fraction(files: list[str], total: int, split: str, limit: float) -> None:
    """BadDataError (exit 1, listing the files) when more than `limit` of a split's `total` files are unreadable."""
    if total and len(files) / total > limit:
        listing = "\n  ".join(files[:20]) + ("\n  ..." if len(files) > 20 else "")
        raise BadDataError(f"{len(files)} of {total} {split} files could not be read, more than "
                           f"data.max_bad_fraction={limit}:\n  {listing}")


def data_wait_advice(wait_frac: float, num_workers: int, cores: int, prefetch_factor: int) -> str:
    return (f"the model waited for data {100 * wait_frac:.0f}% of the time: the input pipeline is the bottleneck. "
            f"Try more loader workers (data.num_workers, now {num_workers}; this machine has {cores} cores), a "
            f"deeper prefetch (data.prefetch_factor, now {prefetch_factor}), pinned memory on CUDA "
            f"(data.pin_memory), a smaller data.img_size, or images stored as JPEGs near the training size "
            f"(decoding the full-size file is most of the cost). `benchmark.py --mode loader` times the "
            f"pipeline alone")
