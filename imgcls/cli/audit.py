"""Check the data before training, reading it exactly as train.py will: unreadable files, duplicates inside
each split, leaks across splits (the most serious: they inflate the validation accuracy), likely label
errors (cleanlab on out-of-sample predictions from K-fold cross-validation or a checkpoint), and the class
balance and image shapes. The data is never changed.

python audit.py --config CONFIG [KEY=VALUE ...] [--checkpoint CKPT] [--folds K] [--fold-epochs E]
                [--near-threshold D] [--json FILE] [--html FILE] [--write-clean-csv FILE [--drop-label-issues N]]
"""
import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Optional

from imgcls.config import available_configs
from imgcls.core.errors import ConfigError
from imgcls.core.files import check_output_file

# flag -> the config key it sets (configs/base.yaml documents each)
FLAG_KEYS = {"folds": "audit.folds", "fold_epochs": "audit.fold_epochs", "near_threshold": "audit.near_threshold",
             "drop_label_issues": "audit.drop_label_issues"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Exit status: 0 done (at least one image could be read), 1 none could "
                                            "be read or a fold's training failed, 2 usage or config error.")
    parser.add_argument("--config", required=True,
                        help=f"a YAML path or a name in configs/ ({', '.join(available_configs())})")
    parser.add_argument("--checkpoint", help="find label errors with this model's predictions on the images it "
                                             "did not train on, instead of K-fold training")
    parser.add_argument("--folds", type=int, help="K-fold cross-validation runs for the label-error search "
                                                  "(audit.folds, default 4; 0: no search)")
    parser.add_argument("--fold-epochs", type=int, help="epochs of each fold's training run (audit.fold_epochs; "
                                                        "default: train.epochs)")
    parser.add_argument("--near-threshold", type=int, help="near duplicates: pHash Hamming distance up to this, "
                                                           "0..64 (audit.near_threshold, default 6)")
    parser.add_argument("--json", help="write the findings here (unreadable, duplicates, leaks, label_issues, "
                                       "class_counts, image_stats)")
    parser.add_argument("--html", help="write a self-contained HTML page with the flagged images as thumbnails")
    parser.add_argument("--write-clean-csv", metavar="FILE", help="write the training split without leaked and "
                        "duplicate copies as a CSV list (path,label) for data.format=csv")
    parser.add_argument("--drop-label-issues", type=int, metavar="N", help="with --write-clean-csv: also leave out "
                        "the N most likely label errors (audit.drop_label_issues)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides, e.g. "
                                                                           "data.root=/data")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s", stream=sys.stderr)
    for flag in ("json", "html", "write_clean_csv"):
        check_output_file(f"--{flag.replace('_', '-')}", getattr(args, flag))
    overrides = list(args.overrides) + [f"{key}={getattr(args, flag)}" for flag, key in FLAG_KEYS.items()
                                        if getattr(args, flag) is not None]

    from imgcls.config import load_config
    from imgcls.data.settings import check_data_root

    cfg = load_config(args.config, overrides)  # config mistakes exit 2 before torch is imported
    if not cfg.data.builtin:
        check_data_root(cfg)
    check_arguments(cfg, args.checkpoint, args.write_clean_csv)
    from imgcls.commands.output_roles import check_audit_outputs

    check_audit_outputs(cfg, args.checkpoint, {"--json": args.json, "--html": args.html,
                                               "--write-clean-csv": args.write_clean_csv})

    from imgcls.cli import announce, require_extra

    require_extra("audit", "audit.py")

    announce(f"audit.py: auditing {cfg.data.root or cfg.data.train_csv or 'the configured data'}")
    from imgcls.commands.audit import run_audit

    return run_audit(cfg, args.checkpoint, args.json, args.html, args.write_clean_csv)


def check_arguments(cfg, checkpoint: Optional[str], clean_csv: Optional[str]) -> None:
    """Usage mistakes, before any work (exit 2)."""
    a, d = cfg.audit, cfg.data
    if clean_csv and d.format == "webdataset":
        raise ConfigError("--write-clean-csv: shard samples are not files a CSV list can name; write the shards "
                          "out as files first, or audit without --write-clean-csv")
    if a.drop_label_issues and not clean_csv:
        raise ConfigError("--drop-label-issues (audit.drop_label_issues) only shapes --write-clean-csv FILE; "
                          "pass both")
    if a.drop_label_issues and a.folds == 0 and not checkpoint:
        raise ConfigError("--drop-label-issues needs a label-issue search: --folds K (K >= 2) or --checkpoint CKPT")
    if checkpoint and not Path(checkpoint).exists():
        raise ConfigError(f"--checkpoint {checkpoint}: no such file or folder")
    if clean_csv:
        lists = {os.path.realpath(p) for p in (d.train_csv, d.val_csv) if p}
        if os.path.realpath(clean_csv) in lists:
            raise ConfigError(f"--write-clean-csv {clean_csv} is one of the data's own lists; the audit never "
                              f"changes the data: name a new file")
