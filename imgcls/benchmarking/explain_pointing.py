"""The pointing game of Grad-CAM on small multi-label inputs: 48 px canvases, a 3x3 grid of 16 px cells of which
1-3 hold an upscaled scikit-learn digit (tags `d0`..`d9`); a resnet10t trained here (multi-label, CSV lists);
for every tag present in a validation canvas that the model calls (sigmoid >= 0.5), whether Grad-CAM's peak,
mapped to the canvas's pixels, lies in a cell holding that digit. Measured for the last stage and for the
layer `evaluation.explain.target_layer` picks at the input size. Nothing is downloaded. Prints one JSON object;
docs/advice.md holds what it measured.

python -m imgcls.benchmarking.explain_pointing --out /tmp/pointing [--epochs 8] [--seed 0]
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
CELL, GRID = 16, 3


def write_canvases(root: Path, seed: int, counts=(("train", 1200), ("val", 200))) -> dict:
    """The canvases, `train.csv` / `val.csv` (path, space-separated tags); returns path -> [[tag, x, y], ...]."""
    from sklearn.datasets import load_digits

    digits, rng, boxes = load_digits(), np.random.default_rng(seed), {}
    side = CELL * GRID
    for split, n in counts:
        (root / split).mkdir(parents=True, exist_ok=True)
        rows = []
        for i in range(n):
            canvas = rng.integers(0, 60, size=(side, side)).astype(np.float32)
            where = []
            for cell in rng.choice(GRID * GRID, size=int(rng.integers(1, 4)), replace=False):
                k = int(rng.integers(len(digits.images)))
                glyph = Image.fromarray((digits.images[k] * 15).astype(np.uint8)).resize((CELL, CELL), Image.BILINEAR)
                y, x = CELL * int(cell // GRID), CELL * int(cell % GRID)
                canvas[y:y + CELL, x:x + CELL] = np.maximum(canvas[y:y + CELL, x:x + CELL], np.asarray(glyph))
                where.append([f"d{digits.target[k]}", x, y])
            path = f"{split}/{i:04d}.png"
            Image.fromarray(canvas.astype(np.uint8)).convert("RGB").save(root / path)
            rows.append({"path": path, "label": " ".join(sorted({w[0] for w in where}))})
            boxes[path] = where
        with open(root / f"{split}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, ["path", "label"])
            writer.writeheader()
            writer.writerows(rows)
    return boxes


def train(data: Path, out: Path, epochs: int, seed: int) -> Path:
    overrides = {"data.root": data, "data.task": "multilabel", "data.format": "csv", "data.train_csv": data / "train.csv",
                 "data.val_csv": data / "val.csv", "model.name": "resnet10t", "data.img_size": CELL * GRID,
                 "data.scale": "[0.9,1.0]", "data.hflip": 0, "data.num_workers": 0, "train.batch_size": 32,
                 "train.epochs": epochs, "train.amp": "none", "train.device": "cpu", "optim.lr": 0.4,
                 "schedule.warmup_epochs": 1, "train.seed": seed, "output.dir": out, "output.progress_bar": "off",
                 "output.tensorboard": "false"}
    command = [sys.executable, str(REPO / "train.py"), "--config", "base", *(f"{k}={v}" for k, v in overrides.items())]
    subprocess.run(command, check=True, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="2"), stdout=subprocess.DEVNULL)
    return out / "best.pt"


def pointing(checkpoint: Path, root: Path, boxes: dict) -> dict:
    """Layer name -> (hits, called tags) for the last stage and the layer picked by resolution."""
    from imgcls.data.transforms import normalize_batch
    from imgcls.evaluation.explain import Explainer, crop_geometry, heatmap_peak, to_original
    from imgcls.model_files.loading import load_model_file

    loaded = load_model_file(checkpoint)
    model = loaded.build_model(torch.device("cpu"), channels_last=False)
    transform, d, classes = loaded.eval_transform(), loaded.cfg.data, loaded.classes
    paths = sorted(p for p in boxes if p.startswith("val/"))
    batch = normalize_batch(torch.stack([transform(str(root / p)) for p in paths]), d.mean, d.std)
    with torch.no_grad():
        probs = model(batch).sigmoid()
    items = [(i, classes.index(tag)) for i, p in enumerate(paths) for tag in sorted({w[0] for w in boxes[p]})
             if probs[i, classes.index(tag)] >= 0.5]
    side = CELL * GRID
    geometry = crop_geometry(side, side, transform.resize_to, transform.img_size)
    result = {}
    for size in (None, transform.img_size):
        explainer, hits = Explainer(model, size), 0
        try:
            for start in range(0, len(items), 64):
                chunk = items[start:start + 64]
                cams = explainer.heatmaps(batch[[i for i, _ in chunk]], [c for _, c in chunk])
                for (i, c), cam in zip(chunk, cams):
                    x, y = to_original(*heatmap_peak(cam), geometry, side, side)
                    hits += any(tag == classes[c] and bx <= x < bx + CELL and by <= y < by + CELL
                                for tag, bx, by in boxes[paths[i]])
        finally:
            explainer.close()
        result[explainer.layer_name] = {"cells": explainer.cells, "hits": hits, "called_tags": len(items),
                                        "percent": round(100.0 * hits / max(len(items), 1), 1)}
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="a new folder for the canvases and the run")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    boxes = write_canvases(out / "data", args.seed)
    checkpoint = train(out / "data", out / "run", args.epochs, args.seed)
    print(json.dumps({"epochs": args.epochs, "seed": args.seed, "pointing": pointing(checkpoint, out / "data", boxes)},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
