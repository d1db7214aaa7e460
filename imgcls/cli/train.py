"""Train an image classifier: python train.py --config CONFIG [KEY=VALUE ...] [--resume PATH|auto], or
python train.py --resume PATH [KEY=VALUE ...] to continue a run with the config its last.pt recorded."""
import argparse
import os
import sys

from imgcls.cli import announce
from imgcls.config import available_configs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, epilog="Every key, its default and what it does: "
                                     "configs/base.yaml. Exit status: 0 done, 1 failed, 2 usage or config "
                                     "error, 143/130/138 stopped by SIGTERM/SIGINT/SIGUSR1 after saving last.pt.")
    parser.add_argument("--config", help=f"a YAML path or a name in configs/ ({', '.join(available_configs())}); "
                        "required unless --resume PATH, which takes the run's recorded config")
    parser.add_argument("--resume", help="last.pt to continue from (alone: with the config it recorded), or 'auto' "
                        "for the run directory's last.pt (with --config)")
    parser.add_argument("--finetune", help="start a new schedule from this checkpoint's weights")
    parser.add_argument("--extend", metavar="CKPT", help="add the data's new classes to this trained best.pt, keeping "
                        "its classes (sets incremental.base; docs/incremental.md)")
    parser.add_argument("--finetune-partial", action="store_true",
                        help="accept a --finetune checkpoint that matches under half of the model's parameters")
    parser.add_argument("--list-models", nargs="?", const="*", metavar="PATTERN",
                        help="print the model.name values this install builds (timm's, then torchvision's as "
                             "tv:NAME) matching PATTERN, a shell wildcard or a word the name contains "
                             "(e.g. mobilenet), one a line, and exit; docs/training.md has a guide for CPUs")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides, e.g. train.epochs=3")
    args = parser.parse_intermixed_args()  # KEY=VALUE may come before and after --resume / --finetune
    if args.extend is not None:
        if args.finetune:
            parser.error(f"--extend {args.extend} and --finetune {args.finetune} exclude each other: --extend starts "
                         f"from the base's weights already")
        args.overrides = [*args.overrides, f"incremental.base={args.extend}"]
    if args.list_models is not None:
        from imgcls.models.factory import list_model_names

        names = list_model_names(args.list_models)
        if not names:
            parser.error(f"--list-models {args.list_models}: no timm or torchvision model name matches")
        try:
            print("\n".join(names), flush=True)
        except BrokenPipeError:  # `| head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0

    if args.config is None and args.resume in (None, "auto"):
        parser.error("--config is required (unless --resume PATH continues a run with the config its last.pt "
                     "recorded; --resume auto needs --config to find the run directory)")
    if args.config is None:
        from imgcls.config import config_from_checkpoint

        announce(f"train.py: continuing the run of {args.resume} with the config it recorded")
        cfg = config_from_checkpoint(args.resume, args.overrides)
    else:
        from imgcls.config import load_config

        cfg = load_config(args.config, args.overrides)  # config mistakes exit 2 before torch is imported
        data = cfg.data.root or cfg.data.train_csv or cfg.data.train_shards or cfg.data.builtin
        announce(f"train.py: training {cfg.model.name} on {data} into {cfg.output.dir}"
                 + (f", resuming from {args.resume}" if args.resume else ""))

    from imgcls.training.trainer import run

    return run(cfg, resume=args.resume, finetune=args.finetune, finetune_partial=args.finetune_partial)
