"""Data policies the training run applies: how many unreadable files a split may have, and what to
tell a user whose model waits for data."""
from __future__ import annotations

import logging

from imgcls.core.errors import BadDataError

log = logging.getLogger(__name__)

# Above this share of a logging interval spent waiting for batches, the run says once what to change.
DATA_WAIT_WARN_FRAC = 0.2


def check_bad_fraction(files: list[str], total: int, split: str, limit: float) -> None:
    """BadDataError (exit 1, listing the files) when more than `limit` of a split's `total` files are unreadable."""
    if total and len(files) / total > limit:
        listing = "\n  ".join(files[:20]) + ("\n  ..." if len(files) > 20 else "")
        raise BadDataError(f"{len(files)} of {total} {split} files could not be read, more than "
                           f"data.max_bad_fraction={limit}:\n  {listing}")


def check_validation_files(unreadable: list[str], total: int, evaluated: int, limit: float) -> None:
    """After a validation pass: name the files left out, stop (BadDataError, exit 1) above `limit` of the split
    or when not one image was evaluated (nothing to compare, no best.pt)."""
    if unreadable:
        log.warning("%d validation file(s) could not be read and were left out: %s", len(unreadable),
                    ", ".join(unreadable[:10]))
        check_bad_fraction(unreadable, total, "validation", limit)
    if evaluated == 0:
        raise BadDataError(f"validation evaluated no image: none of the {len(unreadable)} validation files it read "
                           f"could be decoded, so there is nothing to compare and no best.pt")


def data_wait_advice(wait_frac: float, num_workers: int, cores: int, prefetch_factor: int) -> str:
    return (f"the model waited for data {100 * wait_frac:.0f}% of the time: the input pipeline is the bottleneck. "
            f"Try more loader workers (data.num_workers, now {num_workers}; this machine has {cores} cores), a "
            f"deeper prefetch (data.prefetch_factor, now {prefetch_factor}), pinned memory on CUDA "
            f"(data.pin_memory), a smaller data.img_size, or images stored as JPEGs near the training size "
            f"(decoding the full-size file is most of the cost). `benchmark.py --mode loader` times the "
            f"pipeline alone")
