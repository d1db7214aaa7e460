"""The labelling loop measured with a simulated annotator: start with a few labels (the same per class), train,
pick K pool images with a strategy (imgcls/labelling/strategies.py, scored by `label pick`'s pass), reveal their
labels, retrain, repeat; top-1 on a held-out split after each round, per strategy and seed. Round 0's model is
shared by every strategy of a seed. Data: the built-in digits (sklearn's 8x8 digits; held out: its val split)
and generated shapes on photo-like backgrounds (benchmarking/reject_matrix.py, 7 classes).
`--learner linear`: the same loop with a logistic regression on fixed features as the model (digits' pixels, and
a generated set), which measures the strategies in seconds where the trained network takes minutes a round.
Prints one JSON object; with --markdown FILE, the mean table, and with --plot FILE.png, the curves.

python -m imgcls.benchmarking.labelling_loop --out /tmp/loop [--datasets digits,shapes]
       [--strategies default,random,margin,entropy,coreset] [--seeds 0,1,2] [--rounds 4] [--start-per-class 2]
       [--budget 20] [--epochs 12] [--learner imgcls|linear] [--markdown FILE] [--plot FILE.png]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import numpy as np

from imgcls.benchmarking.reject_matrix import write_photos_tree
from imgcls.data.listing import ensure_builtin, list_images
from imgcls.labelling.picking import PickOptions, open_predictor, score_paths
from imgcls.labelling.strategies import STRATEGIES, is_young, select

IMG_SIZE = {"digits": 16, "shapes": 32}

MODEL = "resnet10t"  # the tests' model: the loop trains 1 + rounds x strategies models per seed


def dataset(name: str, root: Path) -> tuple[list[str], list[str], list[str], list[str]]:
    """(pool paths, their labels, held-out paths, their labels)."""
    if name == "digits":
        folder = ensure_builtin("digits", root / "digits")
    elif name == "shapes":
        folder = root / "shapes"
        if not (folder / ".complete").exists():
            write_photos_tree(folder, 120, 30, seed=0)
            (folder / ".complete").touch()
    else:
        raise ValueError(f"unknown data set {name!r}")
    split = {}
    for side in ("train", "val"):
        paths = list_images(folder / side)
        split[side] = (paths, [Path(p).parent.name for p in paths])
    return (*split["train"], *split["val"])


def write_list(path: Path, paths: list[str], labels: list[str]) -> Path:
    import csv

    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "label"])
        writer.writerows(zip(paths, labels))
    return path


def train_round(out: Path, train_csv: Path, test_csv: Path, classes_file: Path, img_size: int, epochs: int,
                seed: int) -> tuple[Path, float]:
    """Train on the labelled list (validated once, after the last epoch: no choice by the held-out split);
    returns (best.pt, held-out top-1)."""
    from imgcls.config import load_config
    from imgcls.training.trainer import run

    values = {"data.format": "csv", "data.train_csv": train_csv, "data.val_csv": test_csv, "data.classes": classes_file,
              "output.dir": out, "model.name": MODEL, "data.img_size": img_size, "data.num_workers": 0,
              "train.batch_size": 16, "train.epochs": epochs, "train.val_interval": epochs, "train.amp": "none",
              "train.device": "cpu", "train.seed": seed, "optim.lr": 0.03, "optim.lr_scaling": "none",
              "schedule.warmup_epochs": 1, "output.progress_bar": "off", "output.log_interval": 1000,
              "output.tensorboard": "false", "output.curves": "false", "calibration.temperature": "none"}
    cfg = load_config("base", [f"{k}={v}" for k, v in values.items()])
    if run(cfg) != 0:
        raise RuntimeError(f"training in {out} failed")
    summary = json.loads((out / "summary.json").read_text())
    return out / "best.pt", float(summary["best"]["top1"])


def initial_labels(labels: list[str], per_class: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    chosen = []
    for name in sorted(set(labels)):
        members = [i for i, label in enumerate(labels) if label == name]
        chosen.extend(int(i) for i in rng.choice(members, size=per_class, replace=False))
    return sorted(chosen)


def pick_next(checkpoint: Path, pool: list[str], labelled: list[int], strategy: str, budget: int, seed: int,
              num_classes: int) -> list[int]:
    """The strategy's picks among the unlabelled pool positions, as `label pick` scores them."""
    rest = [i for i in range(len(pool)) if i not in set(labelled)]
    scored = score_paths(open_predictor(str(checkpoint), PickOptions(budget, device="cpu")),
                         [pool[i] for i in rest] + [pool[i] for i in labelled])
    vectors, probs = scored.vectors, scored.probs
    chosen = select(strategy, probs[:len(rest)], vectors[:len(rest)], vectors[len(rest):], budget, seed,
                    is_young(len(labelled), num_classes))
    return [rest[int(i)] for i in chosen.positions]


def run_loop(name: str, root: Path, strategies: list[str], seeds: list[int], rounds: int, per_class: int,
             budget: int, epochs: int) -> list[dict]:
    pool, pool_labels, test, test_labels = dataset(name, root)
    classes = sorted(set(pool_labels))
    work = root / f"{name}-runs"
    work.mkdir(parents=True, exist_ok=True)
    classes_file = work / "classes.txt"
    classes_file.write_text("".join(f"{c}\n" for c in classes))
    test_csv = write_list(work / "test.csv", test, test_labels)
    records = []
    for seed in seeds:
        start = initial_labels(pool_labels, per_class, seed)
        first = work / f"s{seed}-r0"
        checkpoint0, top1 = train_round(first, write_list(work / f"s{seed}-r0.csv", [pool[i] for i in start],
                                                          [pool_labels[i] for i in start]),
                                        test_csv, classes_file, IMG_SIZE[name], epochs, seed)
        for strategy in strategies:
            labelled, checkpoint = list(start), checkpoint0
            records.append({"data": name, "strategy": strategy, "seed": seed, "round": 0, "labels": len(labelled),
                            "top1": top1})
            print(json.dumps(records[-1]), file=sys.stderr, flush=True)
            for r in range(1, rounds + 1):
                labelled += pick_next(checkpoint, pool, labelled, strategy, budget, seed * 1000 + r, len(classes))
                tag = f"s{seed}-{strategy}-r{r}"
                listing = write_list(work / f"{tag}.csv", [pool[i] for i in labelled],
                                     [pool_labels[i] for i in labelled])
                checkpoint, accuracy = train_round(work / tag, listing, test_csv, classes_file, IMG_SIZE[name],
                                                   epochs, seed)
                records.append({"data": name, "strategy": strategy, "seed": seed, "round": r,
                                "labels": len(labelled), "top1": accuracy})
                print(json.dumps(records[-1]), file=sys.stderr, flush=True)
    return records


def feature_set(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(pool features, pool labels, held-out features, held-out labels), standardised on the pool: sklearn's
    digits as their 64 pixels, or a generated set (make_classification: 8 classes of 3 sub-clusters each)."""
    from sklearn.datasets import load_digits, make_classification
    from sklearn.model_selection import train_test_split

    if name == "digits":
        x, y = load_digits(return_X_y=True)
    elif name == "generated":
        x, y = make_classification(n_samples=2400, n_features=32, n_informative=12, n_redundant=4, n_classes=8,
                                   n_clusters_per_class=3, class_sep=1.5, random_state=0)
    else:
        raise ValueError(f"unknown data set {name!r} for the linear learner (digits, generated)")
    pool, test, pool_y, test_y = train_test_split(x.astype(np.float64), y, test_size=0.2, stratify=y, random_state=0)
    mean, std = pool.mean(0), pool.std(0) + 1e-6
    return (pool - mean) / std, pool_y, (test - mean) / std, test_y


def run_linear_loop(name: str, strategies: list[str], seeds: list[int], rounds: int, per_class: int,
                    budget: int) -> list[dict]:
    """The same loop with a logistic regression on fixed features as the model (seconds, not hours): the
    strategies' probabilities are its calibrated ones, their embeddings the normalised features."""
    from sklearn.linear_model import LogisticRegression

    pool, pool_y, test, test_y = feature_set(name)
    vectors = pool / np.linalg.norm(pool, axis=1, keepdims=True)
    num_classes = len(set(pool_y.tolist()))
    records = []
    for seed in seeds:
        start = initial_labels([str(v) for v in pool_y], per_class, seed)
        for strategy in strategies:
            labelled = list(start)
            for r in range(rounds + 1):
                model = LogisticRegression(max_iter=2000).fit(pool[labelled], pool_y[labelled])
                records.append({"data": name, "strategy": strategy, "seed": seed, "round": r,
                                "labels": len(labelled), "top1": 100.0 * float((model.predict(test) == test_y).mean())})
                print(json.dumps(records[-1]), file=sys.stderr, flush=True)
                if r == rounds:
                    break
                rest = np.setdiff1d(np.arange(len(pool)), labelled)
                chosen = select(strategy, model.predict_proba(pool[rest]), vectors[rest], vectors[labelled], budget,
                                seed * 1000 + r, is_young(len(labelled), num_classes))
                labelled += rest[chosen.positions].tolist()
    return records


def mean_table(records: list[dict]) -> str:
    """Markdown: one row per data set and strategy, mean held-out top-1 (%) over the seeds per round, and the
    rounds where it beat random's mean."""
    lines = []
    for name in dict.fromkeys(r["data"] for r in records):
        rows = [r for r in records if r["data"] == name]
        rounds = sorted({r["round"] for r in rows})
        labels = {r["round"]: r["labels"] for r in rows}
        lines += [f"| {name} | " + " | ".join(f"round {k} ({labels[k]} labels)" for k in rounds) + " | beats random |",
                  "| --- |" + " --- |" * (len(rounds) + 1)]
        mean = {(s, k): np.mean([r["top1"] for r in rows if r["strategy"] == s and r["round"] == k])
                for s in dict.fromkeys(r["strategy"] for r in rows) for k in rounds}
        for strategy in dict.fromkeys(r["strategy"] for r in rows):
            beats = sum(mean[(strategy, k)] > mean[("random", k)] for k in rounds[1:]) if ("random", 1) in mean else 0
            lines.append(f"| {strategy} | " + " | ".join(f"{mean[(strategy, k)]:.1f}" for k in rounds) +
                         f" | {beats} of {len(rounds) - 1} |")
        lines.append("")
    return "\n".join(lines)


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["data"] for r in records))
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.6), squeeze=False)
    for ax, name in zip(axes[0], names):
        rows = [r for r in records if r["data"] == name]
        for strategy in dict.fromkeys(r["strategy"] for r in rows):
            rounds = sorted({r["labels"] for r in rows if r["strategy"] == strategy})
            means = [np.mean([r["top1"] for r in rows if r["strategy"] == strategy and r["labels"] == n])
                     for n in rounds]
            ax.plot(rounds, means, marker="o", label=strategy, linestyle="--" if strategy == "random" else "-")
        ax.set_title(name)
        ax.set_xlabel("labelled images")
        ax.set_ylabel("held-out top-1 (%)")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--datasets", default="digits,shapes")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--start-per-class", type=int, default=2)
    parser.add_argument("--budget", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--learner", choices=("imgcls", "linear"), default="imgcls",
                        help="imgcls: train.py's training each round (resnet10t); linear: a logistic regression on "
                             "fixed features (digits' pixels, a generated set)")
    parser.add_argument("--markdown")
    parser.add_argument("--plot")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    records = []
    for name in args.datasets.split(","):
        if args.learner == "linear":
            records += run_linear_loop(name, args.strategies.split(","), [int(s) for s in args.seeds.split(",")],
                                       args.rounds, args.start_per_class, args.budget)
            continue
        records += run_loop(name, Path(args.out), args.strategies.split(","), [int(s) for s in args.seeds.split(",")],
                            args.rounds, args.start_per_class, args.budget, args.epochs)
    if args.markdown:
        Path(args.markdown).write_text(mean_table(records))
    if args.plot:
        plot(records, args.plot)
    print(json.dumps({"records": records}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
