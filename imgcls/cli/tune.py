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
        from imgcls.commands.tune import search_main as search

        return search(args)
    from imgcls.commands.tune import main as tune

    return tune(args)
