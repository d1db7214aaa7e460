#!/usr/bin/env python
"""Train an image classifier: python train.py --config CONFIG [KEY=VALUE ...] [--resume PATH|auto]."""
import argparse

from commands.cli import run_main
from core.config import available_configs


def main(host=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, epilog="Every key, its default and what it does: "
                                     "configs/base.yaml. Exit status: 0 done, 1 failed, 2 usage or config "
                                     "error, 143/130 stopped by SIGTERM/SIGINT after saving last.pt.")
    parser.add_argument("--config", required=True,
                        help=f"a YAML path or a name in configs/ ({', '.join(available_configs())})")
    parser.add_argument("--resume", help="last.pt to continue from, or 'auto' for the run directory's last.pt")
    parser.add_argument("--finetune", help="start a new schedule from this checkpoint's weights")
    parser.add_argument("--finetune-partial", action="store_true",
                        help="accept a --finetune checkpoint that matches under half of the model's parameters")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides, e.g. train.epochs=3")
    args = parser.parse_intermixed_args()  # KEY=VALUE may come before and after --resume / --finetune

    from core.config import load_config

    cfg = load_config(args.config, args.overrides)  # config mistakes exit 2 before torch is imported

    from engine.run.trainer import run

    return run(cfg, resume=args.resume, finetune=args.finetune, finetune_partial=args.finetune_partial, host=host)


if __name__ == "__main__":
    run_main(main)
