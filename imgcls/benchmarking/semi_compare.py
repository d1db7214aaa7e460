"""The gain of semi-supervised training over supervised-only with few labels (docs/semi_supervised.md): the same
labelled images, validation split and schedule for every row; the rest of the training split as `data.unlabeled`.

python -m imgcls.benchmarking.semi_compare --data digits|generated --out DIR [--labels-per-class K] [--seed S]
    [--methods supervised,fixmatch,flexmatch,self-training] [--noise SD] [KEY=VALUE ...]

digits: scikit-learn's handwritten digits (the quickstart's, written by data.builtin=digits), K labelled images
per class from its train/ split, the rest unlabelled, its val/ split for validation. generated: 6 classes of
6 classes, the top or bottom half of one colour channel brighter than the rest of an image of a
random colour, under pixel noise (--noise), 300 images per class. Rows: supervised-only;
FixMatch; FlexMatch; self-training (the supervised best.pt labels the unlabelled images with infer.py
--pseudo-labels at --pseudo-threshold, then a second supervised run takes them as data.extra_train_csv, same
epochs). Runs go one at a time; each row has the best and last validation top-1 and the wall time. Writes
OUT/results.json and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import csv
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]

# the schedule every row shares (KEY=VALUE overrides change it for all rows)
SHARED = {"model.name": "resnet10t", "data.img_size": 16, "data.crop_pct": 1.0, "data.scale": "[0.7,1.0]",
          "data.ratio": "[0.9,1.1]", "data.hflip": 0.0, "train.epochs": 40, "train.batch_size": 16,
          "optim.lr": 0.1, "optim.base_batch_size": 16, "schedule.warmup_epochs": 2, "train.device": "cpu",
          "train.amp": "none", "data.num_workers": 1, "output.tensorboard": "false", "output.curves": "false",
          "output.progress_bar": "off", "calibration.temperature": "none", "train.threads": 2}


def write_generated(root: Path, noise: float, per_class: int = 300, seed: int = 0, contrast: float = 40.0) -> Path:
    """root/train/<class>/ and root/val/<class>/ (3/4 and 1/4), 16 px: 6 classes, the top or bottom half of one
    colour channel `contrast` brighter than the rest of an image of a random colour, under Gaussian pixel noise of
    sd `noise` (the class is in a contrast inside the image, not in its colour)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for label in range(6):
        for i in range(per_class):
            split = "train" if i < per_class * 3 // 4 else "val"
            folder = root / split / f"{'top' if label < 3 else 'bottom'}_{'rgb'[label % 3]}"
            folder.mkdir(parents=True, exist_ok=True)
            image = np.ones((16, 16, 3)) * rng.uniform(40, 215, size=3)
            half = slice(0, 8) if label < 3 else slice(8, 16)
            image[half, :, label % 3] += contrast
            image = np.clip(image + rng.normal(0, noise, size=image.shape), 0, 255).astype(np.uint8)
            Image.fromarray(image).save(folder / f"{i:04d}.png")
    return root


def split_lists(root: Path, out: Path, per_class: int, seed: int) -> dict:
    """labelled.csv (K per class), unlabeled.csv (the rest of train/), val.csv: absolute paths."""
    rng = random.Random(seed)
    labelled, unlabelled, val = [], [], []
    for folder in sorted(p for p in (root / "train").iterdir() if p.is_dir()):
        files = sorted(str(f.resolve()) for f in folder.iterdir() if f.suffix == ".png")
        rng.shuffle(files)
        labelled += [(f, folder.name) for f in files[:per_class]]
        unlabelled += files[per_class:]
    for folder in sorted(p for p in (root / "val").iterdir() if p.is_dir()):
        val += [(str(f.resolve()), folder.name) for f in sorted(folder.iterdir()) if f.suffix == ".png"]
    lists = {"labelled": out / "labelled.csv", "unlabeled": out / "unlabeled.csv", "val": out / "val.csv"}
    for name, rows in (("labelled", labelled), ("val", val)):
        with lists[name].open("w", newline="") as f:
            csv.writer(f).writerows([("path", "label"), *rows])
    with lists["unlabeled"].open("w", newline="") as f:
        csv.writer(f).writerows([("path",), *[(p,) for p in unlabelled]])
    print(f"{len(labelled)} labelled, {len(unlabelled)} unlabelled, {len(val)} validation images", file=sys.stderr)
    return lists


def train(out: Path, lists: dict, overrides: dict, extra: list[str]) -> dict:
    settings = SHARED | {"data.format": "csv", "data.root": "null", "data.train_csv": lists["labelled"],
                         "data.val_csv": lists["val"], "output.dir": out} | overrides
    cmd = [sys.executable, str(REPO / "train.py"), "--config", "base",
           *[f"{k}={v}" for k, v in settings.items()], *extra]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{out}: train.py failed\n{done.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    with (out / "metrics.csv").open() as f:
        last = list(csv.DictReader(f))[-1]
    return {"best_top1": summary["best"]["top1"], "last_top1": float(last["val_top1"]), "seconds": round(seconds, 1),
            "semi": summary.get("semi")}


def pseudo_label(best: Path, lists: dict, out: Path, threshold: float, truth: dict) -> dict:
    cmd = [sys.executable, str(REPO / "infer.py"), str(lists["unlabeled"]), "--checkpoint", str(best),
           "--num-workers", "1", "--pseudo-labels", str(out), "--pseudo-threshold", str(threshold)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"infer.py --pseudo-labels failed\n{done.stderr[-3000:]}")
    with out.open() as f:
        rows = list(csv.DictReader(f))
    right = sum(1 for r in rows if truth.get(r["path"]) == r["label"])
    return {"written": len(rows), "of": len(truth), "correct": right}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", choices=("digits", "generated"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--labels-per-class", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", default="supervised,fixmatch,flexmatch,self-training")
    parser.add_argument("--ratio", type=int, default=4, help="semi.ratio (mu)")
    parser.add_argument("--pseudo-threshold", type=float, default=0.9)
    parser.add_argument("--noise", type=float, default=50.0, help="generated: the pixel noise's sd (0..255 scale)")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE for every run")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = out / args.data
    if args.data == "digits":
        from imgcls.data.listing import ensure_builtin

        ensure_builtin("digits", root)
    elif not (root / "train").is_dir():
        write_generated(root, args.noise)
    lists = split_lists(root, out, args.labels_per_class, args.seed)
    truth = {p: Path(p).parent.name for (p,) in list(csv.reader(lists["unlabeled"].open()))[1:]}
    seed = {"train.seed": args.seed}
    semi = {"data.unlabeled": lists["unlabeled"], "semi.ratio": args.ratio}
    results = {}
    for method in args.methods.split(","):
        run_dir = out / f"{method}_{args.seed}"
        if method == "supervised":
            results[method] = train(run_dir, lists, seed, args.overrides)
        elif method in ("fixmatch", "flexmatch"):
            results[method] = train(run_dir, lists, seed | semi | {"semi.method": method}, args.overrides)
        elif method == "self-training":
            pseudo = out / f"pseudo_{args.seed}.csv"
            labels = pseudo_label(out / f"supervised_{args.seed}" / "best.pt", lists, pseudo, args.pseudo_threshold,
                                  truth)
            results[method] = train(run_dir, lists, seed | {"data.extra_train_csv": pseudo}, args.overrides)
            results[method]["pseudo_labels"] = labels
        print(method, json.dumps(results[method]), file=sys.stderr, flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print("| run | best top-1 | last top-1 | wall s |\n| --- | --- | --- | --- |")
    for method, r in results.items():
        print(f"| {method} | {r['best_top1']:.2f} | {r['last_top1']:.2f} | {r['seconds']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
