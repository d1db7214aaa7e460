"""Class-incremental training against the naive way and joint training (docs/incremental.md's table): a base
run on the first half of the classes, then the second half added six ways (each run from the base's best.pt,
the same epochs and recipe): `naive` (the new classes' images alone: no memory, no distillation, no aligning),
`distillation alone` (no memory: what a run whose base files are gone does) with and without weight aligning, `memory` (the exemplar memory alone),
and `memory + distillation` (the defaults: `incremental.align: auto` is off with exemplars) with and without
weight aligning; `joint` trains on every class's training images from scratch for the base's epochs plus
the extension's. Every model is evaluated by eval.py on the whole validation split (every class); old / new
top-1 are over the old / new classes' validation images.

python -m imgcls.benchmarking.incremental_compare --data digits --out /tmp/inc [--seeds 0] [KEY=VALUE ...]

`--data digits`: scikit-learn's digits (written by the built-in data set), classes 0-4 then 5-9;
`--data generated`: coloured-pattern images like the tests', six classes, a-c then d-f. Writes
OUT/results.json and prints a Markdown table."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]

RECIPE = ["model.name=resnet10t", "data.img_size=32", "data.crop_pct=1.0", "data.scale=[0.7,1.0]",
          "data.ratio=[0.9,1.1]", "data.hflip=0.0", "train.batch_size=64", "optim.lr=0.4", "optim.base_batch_size=256",
          "schedule.warmup_epochs=1", "train.label_smoothing=0.1", "train.channels_last=false",
          "output.tensorboard=false", "output.progress_bar=off", "output.curves=false", "data.num_workers=1"]

VARIANTS = {
    "naive": ["incremental.memory_per_class=0", "incremental.distill=false", "incremental.align=false"],
    "distillation alone": ["incremental.memory_per_class=0", "incremental.align=false"],
    "distillation alone, aligned": ["incremental.memory_per_class=0", "incremental.align=true"],
    "memory": ["incremental.distill=false", "incremental.align=false"],
    "memory + distillation": ["incremental.align=false"],
    "memory + distillation, aligned": ["incremental.align=true"],
}


def generated_tree(out: Path, seed: int = 0) -> tuple[list[str], list[str]]:
    """Six classes of 24 px coloured patterns with noise (the tests' kind), 40 train / 12 val images each."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    names = ["a", "b", "c", "d", "e", "f"]
    for label, name in enumerate(names):
        for split, count in (("train", 40), ("val", 12)):
            folder = out / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = np.zeros((24, 24, 3))
                pixels[..., label % 3] = 200
                if label >= 3:
                    pixels[:12, :, (label + 1) % 3] = 180
                noise = rng.normal(0, 40, size=pixels.shape)
                Image.fromarray(np.clip(pixels + noise, 0, 255).astype(np.uint8)).save(folder / f"{i:03d}.png")
    return names[:3], names[3:]


def digits_tree(out: Path) -> tuple[list[str], list[str]]:
    from imgcls.data.listing import ensure_builtin

    ensure_builtin("digits", out)
    return [str(d) for d in range(5)], [str(d) for d in range(5, 10)]


def subset(whole: Path, out: Path, train: list[str], val: list[str]) -> Path:
    """A class-folder tree with copies of `train`'s and `val`'s class folders (copies: links out of a tree are
    not followed)."""
    for split, names in (("train", train), ("val", val)):
        for name in names:
            shutil.copytree(whole / split / name, out / split / name, dirs_exist_ok=True)
    return out


def train(args: list[str], log: Path) -> float:
    started = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", "base", *args], stdout=f,
                              stderr=subprocess.STDOUT, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"train.py failed ({log}):\n{log.read_text()[-3000:]}")
    return time.perf_counter() - started


def evaluate(best: Path, val_root: Path, old: list[str], json_path: Path) -> dict:
    done = subprocess.run([sys.executable, str(REPO / "eval.py"), "--checkpoint", str(best), "--data", str(val_root),
                           "--json", str(json_path)], capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"eval.py failed on {best}:\n{done.stderr[-3000:]}")
    doc = json.loads(json_path.read_text())

    def top1(names):
        figures = [doc["per_class"][n] for n in names if n in doc["per_class"]]
        seen = sum(f["count"] for f in figures)
        return round(sum(f["accuracy"] * f["count"] for f in figures) / seen, 2) if seen else None

    new = [n for n in doc["per_class"] if n not in old]
    return {"all_top1": round(doc["top1"], 2), "old_top1": top1(old), "new_top1": top1(new)}


def one_seed(root: Path, whole: Path, old: list[str], new: list[str], seed: int, epochs: int,
             overrides: list[str]) -> list[dict]:
    common = [*RECIPE, f"train.seed={seed}", *overrides]
    base_data, new_data = subset(whole, root / "old", old, old), subset(whole, root / "new", new, old + new)
    rows = []
    base_dir = root / f"base_s{seed}"
    seconds = train([*common, f"data.root={base_data}", f"output.dir={base_dir}", f"train.epochs={epochs}"],
                    root / f"base_s{seed}.log")
    rows.append({"run": "base (old classes only)", "seed": seed, "train_s": round(seconds, 1),
                 **evaluate(base_dir / "best.pt", base_data, old, root / f"base_s{seed}.json")})
    for name, keys in VARIANTS.items():
        out = root / f"{name.replace(', ', '_').replace(' ', '_')}_s{seed}"
        seconds = train([*common, f"data.root={new_data}", f"output.dir={out}", f"train.epochs={epochs}", *keys,
                         "--extend", str(base_dir / "best.pt")], root / f"{out.name}.log")
        rows.append({"run": name, "seed": seed, "train_s": round(seconds, 1),
                     **evaluate(out / "best.pt", new_data, old, root / f"{out.name}.json")})
    joint = root / f"joint_s{seed}"
    all_data = subset(whole, root / "all", old + new, old + new)
    seconds = train([*common, f"data.root={all_data}", f"output.dir={joint}", f"train.epochs={2 * epochs}"],
                    root / f"joint_s{seed}.log")
    rows.append({"run": "joint (every class, from scratch)", "seed": seed, "train_s": round(seconds, 1),
                 **evaluate(joint / "best.pt", new_data, old, root / f"joint_s{seed}.json")})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", choices=["digits", "generated"], default="digits")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--epochs", type=int, default=6, help="of the base and of each extension (joint: twice)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    whole = root / "whole"
    old, new = digits_tree(whole) if args.data == "digits" else generated_tree(whole)
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        rows += one_seed(root, whole, old, new, seed, args.epochs, args.overrides)
    (root / "results.json").write_text(json.dumps({"data": args.data, "load_avg": os.getloadavg(), "rows": rows},
                                                  indent=1))
    print("| run | seed | old top-1 | new top-1 | all top-1 | train s |\n| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['run']} | {r['seed']} | {r['old_top1']} | {r['new_top1']} | {r['all_top1']} | {r['train_s']} |")


if __name__ == "__main__":
    main()
