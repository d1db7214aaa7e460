"""Tune before a long run.

python tune.py --config CONFIG [KEY=VALUE ...] [--batch-sizes 64,128,256,512] [--steps N] [--target-loss L]
               [--warmup-steps N] [--try-checkpointing] [--json FILE] [--plot FILE.png]
    batch-size sweep: N real optimizer steps per size on the real data, the LR scaled by optim.lr_scaling;
    img/s, peak memory, the loss after the same samples, the time to a target loss, and the verdict
python tune.py --config CONFIG --lr-range 1e-5,10 [--steps N] [--json FILE] [--plot FILE.png] [KEY=VALUE ...]
    LR range test at train.batch_size: prints the optim.lr to use (also under torchrun)
python tune.py --config CONFIG --search SPACE.yaml --trials N --study DIR [--pruner median|hyperband|none]
               [--startup-trials K] [--keep best|all] [--nproc-per-node P] [KEY=VALUE ...]
    hyper-parameter search (Optuna): each trial a train.py run in DIR/trials/<number>/, pruned on the
    validation metric after each epoch; DIR/study.db, resumable by re-running the same command; writes
    DIR/trials.csv, DIR/best.yaml and the plots history.png, slice.png, importances.png
"""
import argparse
import logging
import math
import sys
from pathlib import Path

from imgcls.cli import announce, require_extra
from imgcls.core.errors import ConfigError
from imgcls.core.files import check_output_file


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Exit status: 0 done, 1 failed, 2 usage or config error, 130 after "
                                            "Ctrl-C, 143 after SIGTERM (the table and JSON of the sizes so far "
                                            "are written). Writes no run directory, except --search: its trials' runs "
                                            "in --study DIR (after a signal the running trial has saved its last.pt; "
                                            "the same command continues the study).")
    parser.add_argument("--config", required=True, help="a YAML path or a name in configs/")
    parser.add_argument("--batch-sizes", help="effective batch sizes to compare, comma-separated "
                                              "(default: train.batch_size halved, as it is, x2, x4)")
    parser.add_argument("--steps", type=int, help="optimizer steps per batch size, or of the LR range test (100)")
    parser.add_argument("--warmup-steps", type=int, help="linear warmup in optimizer steps (default: steps/10)")
    parser.add_argument("--target-loss", type=float,
                        help="smoothed training loss to reach (default: the median of the sizes' lowest losses, the "
                             "level at least half of them reached)")
    parser.add_argument("--try-checkpointing", dest="checkpointing", action="store_true",
                        help="a size that does not fit is tried with model.grad_checkpointing before accumulation")
    parser.add_argument("--lr-range", metavar="LOW,HIGH", help="run the LR range test from LOW to HIGH instead")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="draw the curves into this PNG")
    search = parser.add_argument_group("hyper-parameter search (--search)")
    search.add_argument("--search", metavar="SPACE.yaml",
                        help="search these keys: KEY: {low, high[, log: true][, step]} or KEY: [choices]")
    search.add_argument("--trials", type=int, help="finished (complete or pruned) trials to reach")
    search.add_argument("--study", metavar="DIR", help="the study's folder: study.db, trials/<number>/, results")
    search.add_argument("--pruner", choices=("median", "hyperband", "none"), default="median",
                        help="stop unpromising trials after an epoch's validation (default: median)")
    search.add_argument("--startup-trials", type=int, default=2,
                        help="median pruner: trials that finish before any trial is pruned (default: 2)")
    search.add_argument("--keep", choices=("best", "all"), default="best",
                        help="checkpoints kept when the study ends: the best trial's only (default), or all")
    search.add_argument("--nproc-per-node", type=int, default=1,
                        help="train each trial under torchrun on this many processes (default: 1, no torchrun)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    args = parser.parse_intermixed_args()

    if args.search is None and (args.trials is not None or args.study is not None):
        parser.error("--trials and --study belong to --search SPACE.yaml (the hyper-parameter search)")
    if args.search is not None:
        require_extra("tune", "--search")
        return search_main(args)
    return sweep_main(args)


PRUNERS = ("median", "hyperband", "none")


KEEP = ("best", "all")


# tune.py's flags of the batch-size sweep and the LR range test, which a search does not take
SWEEP_FLAGS = {"batch_sizes": "--batch-sizes", "lr_range": "--lr-range", "steps": "--steps",
               "warmup_steps": "--warmup-steps", "target_loss": "--target-loss", "json": "--json", "plot": "--plot"}


def check_search_arguments(args) -> None:
    """Every usage error of the search's flags before any work (exit 2)."""
    given = [flag for name, flag in SWEEP_FLAGS.items() if getattr(args, name, None) not in (None, False)]
    if args.checkpointing:
        given.append("--try-checkpointing")
    if given:
        raise ConfigError(f"--search runs a hyper-parameter study; it does not take {', '.join(given)} (flags of the "
                          f"batch-size sweep and the LR range test)")
    if args.trials is None or args.study is None:
        raise ConfigError("--search needs --trials N (the finished trials to reach) and --study DIR (where the "
                          "study lives: DIR/study.db, DIR/trials/<number>/)")
    if args.trials < 1:
        raise ConfigError(f"--trials {args.trials}: must be >= 1")
    if args.startup_trials < 0:
        raise ConfigError(f"--startup-trials {args.startup_trials}: must be >= 0")
    if args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node {args.nproc_per_node}: must be >= 1")
    study = Path(args.study)
    if study.exists() and not study.is_dir():
        raise ConfigError(f"--study {args.study}: is a file; pass a folder (created when missing)")
    if (study / "config.yaml").exists() or (study / "last.pt").exists():
        raise ConfigError(f"--study {args.study}: is a training run's directory; pass a folder of its own")


def launcher(nproc_per_node: int) -> tuple:
    """The command that trains a trial, before train.py's arguments: `imgcls train`, or the same under torchrun."""
    if nproc_per_node == 1:
        return (sys.executable, "-m", "imgcls", "train")
    return (sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc_per_node}",
            "-m", "imgcls", "train")


def search_main(args) -> int:
    from imgcls.commands.output_roles import check_tune_outputs
    from imgcls.config import load_config
    from imgcls.data.settings import check_data_root
    from imgcls.tasks import metric_named
    from imgcls.tracking.tracker import check_tracking_client
    from imgcls.tuning.search import load_space

    check_search_arguments(args)
    cfg = load_config(args.config, args.overrides)
    check_tune_outputs(cfg, args.config, args.search, args.study)
    dims = load_space(args.search, args.config, args.overrides)
    check_data_root(cfg)
    check_tracking_client(cfg.tracking)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    announce(f"tune.py: search over {', '.join(d.key for d in dims)} with --config {args.config}: "
             f"{args.trials} trial(s) in {args.study}")
    from imgcls.models.factory import check_model_name

    for name in next((d.choices for d in dims if d.key == "model.name"), None) or (cfg.model.name,):
        check_model_name(name)
    from imgcls.tuning.search import SearchPlan, resolved_record, run_search

    metric = cfg.early_stop.metric
    plan = SearchPlan(config=args.config, overrides=list(args.overrides), dims=dims, trials=args.trials,
                      study_dir=Path(args.study), metric=metric, higher_is_better=metric_named(metric).higher_is_better,
                      epochs=cfg.train.epochs, seed=cfg.train.seed, pruner=args.pruner,
                      startup_trials=args.startup_trials, keep=args.keep, launcher=launcher(args.nproc_per_node),
                      tracking=cfg.tracking, experiment=cfg.source_name or "imgcls",
                      resolved=resolved_record(cfg, dims))
    for dim in dims:
        logging.getLogger(__name__).info("search: %s", dim.describe())
    return run_search(plan)


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


def sweep_main(args) -> int:
    from imgcls.config import load_config
    from imgcls.data.settings import check_outside_data
    from imgcls.tracking.tracker import check_tracking_client

    check_arguments(args)
    args.steps = args.steps or DEFAULT_STEPS
    sizes = parse_batch_sizes(args.batch_sizes) if args.batch_sizes else None
    lr_range = parse_lr_range(args.lr_range) if args.lr_range else None
    cfg = load_config(args.config, args.overrides)
    for flag, path in (("--json", args.json), ("--plot", args.plot)):  # a PNG there would be a training image
        check_outside_data(cfg, flag, path)
    check_tracking_client(cfg.tracking)
    from imgcls.tracking.tracker import check_store_apart

    check_store_apart(cfg)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    announce(f"tune.py: {'LR range test' if lr_range else 'batch-size sweep'} with --config {args.config}")
    from imgcls.commands.tune import run_lr_test, run_sweep

    if lr_range is not None:
        return run_lr_test(cfg, args, lr_range)
    return run_sweep(cfg, args, sizes)
