"""`tune.py --search SPACE.yaml`'s glue: check the arguments, the config and the space (every mistake exits 2
before any trial), then run the study (tuning/search_study.py), each trial a train.py run."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

from imgcls.cli import announce
from imgcls.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]
PRUNERS = ("median", "hyperband", "none")
KEEP = ("best", "all")
# tune.py's flags of the batch-size sweep and the LR range test, which a search does not take
SWEEP_FLAGS = {"batch_sizes": "--batch-sizes", "lr_range": "--lr-range", "steps": "--steps",
               "warmup_steps": "--warmup-steps", "target_loss": "--target-loss", "json": "--json", "plot": "--plot"}


def check_arguments(args) -> None:
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
    """The command that trains a trial, before train.py's arguments: train.py itself, or under torchrun."""
    script = str(REPO / "train.py")
    if nproc_per_node == 1:
        return (sys.executable, script)
    return (sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc_per_node}",
            script)


def main(args) -> int:
    from imgcls.core.config import check_data_root, load_config
    from imgcls.tracking.store_location import check_tracking_client
    from imgcls.tasks import metric_named
    from imgcls.tuning.search_space import load_space

    check_arguments(args)
    cfg = load_config(args.config, args.overrides)
    dims = load_space(args.search, args.config, args.overrides)
    check_data_root(cfg)
    check_tracking_client(cfg.tracking)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S", stream=sys.stderr)
    announce(f"tune.py: search over {', '.join(d.key for d in dims)} with --config {args.config}: "
             f"{args.trials} trial(s) in {args.study}")
    from imgcls.models.factory import check_model_name

    for name in next((d.choices for d in dims if d.key == "model.name"), None) or (cfg.model.name,):
        check_model_name(name)
    from imgcls.tuning.search_study import SearchPlan, run_search

    metric = cfg.early_stop.metric
    plan = SearchPlan(config=args.config, overrides=list(args.overrides), dims=dims, trials=args.trials,
                      study_dir=Path(args.study), metric=metric, higher_is_better=metric_named(metric).higher_is_better,
                      epochs=cfg.train.epochs, seed=cfg.train.seed, pruner=args.pruner,
                      startup_trials=args.startup_trials, keep=args.keep, launcher=launcher(args.nproc_per_node),
                      tracking=cfg.tracking, experiment=cfg.source_name or "imgcls")
    for dim in dims:
        logging.getLogger(__name__).info("search: %s", dim.describe())
    return run_search(plan)
