"""`tune.py`'s glue: check the arguments, run the batch-size sweep or the LR range test (tuning/sweep.py),
and report: the table on stdout, the verdict, the memory breakdown, JSON and a PNG plot."""
from __future__ import annotations

import logging
import math
import sys

from imgcls.cli import announce
from imgcls.core.errors import ConfigError
from imgcls.core.outputs import check_output_file

log = logging.getLogger(__name__)
# optimizer steps per size (or of the LR range test) when --steps is not given
DEFAULT_STEPS = 100


def parse_batch_sizes(text: str) -> list[int]:
    """"64,128,256" -> [64, 128, 256]: positive integers, each once."""
    sizes = []
    for part in text.split(","):
        try:
            size = int(part.strip())
        except ValueError:
            size = 0
        if size < 1 or str(size) != part.strip():
            raise ConfigError(f"--batch-sizes {text}: '{part.strip()}' is not a positive integer "
                              f"(comma-separated, e.g. 64,128,256)")
        sizes.append(size)
    if len(set(sizes)) != len(sizes):
        raise ConfigError(f"--batch-sizes {text}: a size is repeated")
    return sorted(sizes)


def parse_lr_range(text: str) -> tuple[float, float]:
    """"1e-5,10" -> (1e-5, 10.0), with 0 < low < high."""
    parts = text.split(",")
    try:
        low, high = (float(p) for p in parts) if len(parts) == 2 else (math.nan, math.nan)
    except ValueError:
        low = high = math.nan
    if not (math.isfinite(low) and math.isfinite(high)) or low <= 0 or low >= high:
        raise ConfigError(f"--lr-range {text}: needs LOW,HIGH with 0 < LOW < HIGH (e.g. 1e-5,10)")
    return low, high


def check_arguments(args) -> None:
    """Every usage error before any work (exit 2)."""
    if args.steps is not None and args.steps < 2:
        raise ConfigError("--steps must be >= 2")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        raise ConfigError("--warmup-steps must be >= 0")
    steps = args.steps or DEFAULT_STEPS
    if args.warmup_steps is not None and args.warmup_steps >= steps:
        raise ConfigError(f"--warmup-steps {args.warmup_steps} is not below --steps {steps}: the LR would never "
                          f"reach its peak and the sizes would be compared during warmup; give fewer warmup "
                          f"steps or more steps")
    if args.target_loss is not None and not (math.isfinite(args.target_loss) and args.target_loss > 0):
        raise ConfigError(f"--target-loss {args.target_loss}: must be a positive number")
    if args.lr_range is not None and (args.batch_sizes or args.target_loss is not None or args.checkpointing):
        raise ConfigError("--lr-range runs the LR range test at train.batch_size; it does not take --batch-sizes, "
                          "--target-loss or --try-checkpointing")
    check_output_file("--json", args.json, ".json", outside_runs=True)
    check_output_file("--plot", args.plot, ".png", outside_runs=True)


def main(args) -> int:
    from imgcls.core.config import load_config
    from imgcls.tracking.store_location import check_tracking_client

    check_arguments(args)
    args.steps = args.steps or DEFAULT_STEPS
    sizes = parse_batch_sizes(args.batch_sizes) if args.batch_sizes else None
    lr_range = parse_lr_range(args.lr_range) if args.lr_range else None
    cfg = load_config(args.config, args.overrides)
    check_tracking_client(cfg.tracking)
    from imgcls.tracking.store_location import check_store_apart

    check_store_apart(cfg)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    announce(f"tune.py: {'LR range test' if lr_range else 'batch-size sweep'} with --config {args.config}")
    from imgcls.commands.tuning.tune_run import run_lr_test, run_sweep

    if lr_range is not None:
        return run_lr_test(cfg, args, lr_range)
    return run_sweep(cfg, args, sizes)
