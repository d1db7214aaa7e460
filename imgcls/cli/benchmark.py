"""Measure throughput; prints one JSON object on stdout.

python benchmark.py --config CONFIG --mode loader|train|infer|find-batch|diagnose [--synthetic] [--steps N]
                    [--warmup N] [--baseline torchvision] [--rounds N] [KEY=VALUE ...]
python benchmark.py --make-photos DIR [--photos N] [--photo-source generated|samples]
                                         # writes a tree of photo JPEGs to benchmark the loader on
--mode diagnose: the loader alone (at 0, 1, 2, 4, ... workers), the model alone and the real step; says
whether data loading, compute or the host-to-device copy bounds the run, and the overrides to apply.
"""
import argparse
import json
import logging
import sys

from imgcls.cli import announce
from imgcls.core.errors import ConfigError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a YAML path or a name in configs/ (resnet18, resnet50, quickstart)")
    parser.add_argument("--mode", choices=["loader", "train", "infer", "find-batch", "diagnose"])
    parser.add_argument("--synthetic", action="store_true",
                        help="train/infer: random batches already on the device (the model alone, no loader)")
    parser.add_argument("--steps", type=int, default=20, help="timed batches (loader: at least, in whole epochs)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed batches first (train, infer)")
    parser.add_argument("--baseline", choices=["torchvision"],
                        help="loader: also time torchvision ImageFolder + PIL + transforms, alternating with ours")
    parser.add_argument("--rounds", type=int, default=3, help="loader: alternating timed rounds per pipeline")
    parser.add_argument("--make-photos", metavar="DIR", help="write DIR/{train,val}/class_k/*.jpg and exit")
    parser.add_argument("--photos", type=int, default=200, help="with --make-photos: training images (val: a fifth)")
    parser.add_argument("--photo-source", choices=["generated", "samples"], default="generated",
                        help="with --make-photos: noisy generated photos of 500x375 to 1024x768 (decode-heavy), or "
                             "crops of scikit-learn's two real sample photos at ImageNet sizes (400-640 px)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    args = parser.parse_args()

    if args.make_photos:
        from imgcls.benchmarking.modes import write_photo_tree

        write_photo_tree(args.make_photos, args.photos, max(1, args.photos // 5), source=args.photo_source)
        print(json.dumps({"photos": args.make_photos, "train_images": args.photos, "source": args.photo_source}))
        return 0
    if not args.config or not args.mode:
        raise ConfigError("benchmark.py needs --config and --mode (loader, train, infer, find-batch or diagnose)")
    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name} must be >= 1")
    if args.warmup < 0:
        raise ConfigError("--warmup must be >= 0")
    if args.baseline and args.mode != "loader":
        raise ConfigError("--baseline torchvision only applies to --mode loader")
    from imgcls.config import load_config

    cfg = load_config(args.config, args.overrides)
    if args.baseline and cfg.data.format != "folder":
        raise ConfigError(f"--baseline torchvision reads class-folder trees; data.format is {cfg.data.format}")
    if args.mode == "infer" and not args.synthetic and cfg.data.format == "webdataset":
        raise ConfigError("--mode infer times infer.py, which reads files: use a folder or CSV source (or --synthetic)")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    announce(f"benchmark.py: --mode {args.mode} with --config {args.config}")
    print(json.dumps(run_benchmark(cfg, args)))
    return 0


def run_benchmark(cfg, args) -> dict:
    import torch

    from imgcls.benchmarking.modes import bench_infer, bench_loader, bench_train, settings
    from imgcls.compute.device import build_runtime
    from imgcls.data.build import prepare_root, scan_splits
    from imgcls.data.settings import check_data_root

    if args.mode in ("train", "find-batch"):
        from imgcls.training.optim import check_optimizer

        check_optimizer(cfg.optim)  # optim.name and its options against timm's optimizer, before any work
    runtime = build_runtime(cfg)
    device, amp_dtype = runtime.device, runtime.amp_dtype
    needs_data = args.mode in ("loader", "diagnose") or (args.mode in ("train", "infer") and not args.synthetic)
    if needs_data:
        check_data_root(cfg)
        prepare_root(cfg)
    if args.mode == "find-batch":
        from imgcls.training.batch_finder import run_finder

        num_classes, train_images = 1000, 1 << 30
        if cfg.data.root:
            prepare_root(cfg)
            train_index, _ = scan_splits(cfg)
            num_classes, train_images = len(train_index.classes), len(train_index)
        from imgcls.benchmarking.modes import MIN_STEPS_PER_EPOCH, find_batch_summary

        report = run_finder(cfg, device, amp_dtype, num_classes, train_images, compare_checkpointing=True,
                            min_steps_per_epoch=MIN_STEPS_PER_EPOCH)
        print(find_batch_summary(report), file=sys.stderr)
        out = {"mode": "find-batch", "img_per_s": max(row["img_per_s"] for row in report["table"]), **report}
        out["settings"] = settings(cfg, runtime, report["batch_size"], True)
        return out
    batch = cfg.train.batch_size
    if batch == "auto":
        raise ConfigError("benchmark.py needs a number for train.batch_size (use --mode find-batch to pick one)")
    torch.manual_seed(cfg.train.seed)
    if args.mode == "loader":
        out = bench_loader(cfg, device, batch, args.steps, args.rounds, args.baseline)
    elif args.mode == "diagnose":
        from imgcls.benchmarking.modes import diagnose

        out = diagnose(cfg, device, amp_dtype, batch, args.steps, args.warmup)
        print(f"bottleneck: {out['bottleneck']}: {out['why']} Overrides: {' '.join(out['overrides']) or 'none'}",
              file=sys.stderr)
    elif args.mode == "train":
        out = bench_train(cfg, device, amp_dtype, batch, args.steps, args.warmup, args.synthetic)
    else:
        out = bench_infer(cfg, device, amp_dtype, batch, args.steps, args.warmup, args.synthetic)
    out["settings"] = settings(cfg, runtime, batch, args.synthetic)
    return out
