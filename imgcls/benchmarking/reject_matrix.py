"""The reject option measured in every direction: a photos-like model and a digit-like model, each trained
here on generated data, each shown the other's images and two more kinds of foreign image (line sketches and
noise), with every reject score at the threshold that keeps `--coverage` of its own validation images:
the penultimate-feature scores, the input's statistics alone (`input`), each stage's pooled-statistics
score alone (`layer0`...) and the multi-layer ones. Nothing is downloaded (the digits are scikit-learn's
bundled ones). Prints one JSON object; docs/advice.md holds the tables it measured (--seed 0 and 1).
`--photos DIR` trains the photos model on a tree of real photos instead (python benchmark.py --make-photos DIR
--photo-source samples), at `--img-size`.

python -m imgcls.benchmarking.reject_matrix --out /tmp/reject [--epochs 6] [--images 150] [--coverage 0.95]
    [--models photos_model,digits_model] [--photos DIR] [--img-size 64]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from imgcls.benchmarking.modes import photo
from imgcls.compute.device import DeviceInput
from imgcls.data.build import build_eval_loader_for, scan_splits
from imgcls.data.listing import ImageIndex, ensure_builtin
from imgcls.evaluation.rejection import (INPUT_STAGE, collect_outputs, combined_score, energy_score, knn_score,
                                         layer_fits, layer_names, layer_scores, layer_weights, mahalanobis_fit,
                                         mahalanobis_score, msp_score, multilayer_score, normalise, score_scale,
                                         threshold_for_coverage)
from imgcls.evaluation.trust import feature_bank
from imgcls.model_files.loading import load_model_file
from imgcls.training.calibrate import bank_index

REPO = Path(__file__).resolve().parents[2]
SHAPES = ("circle", "square", "triangle", "hstripes", "vstripes", "cross", "ring")


def shape_photo(rng: np.random.Generator, kind: str, size: int = 48) -> Image.Image:
    """A photo-like background (benchmarking/modes.py) with one object of `kind` in a random colour, place and
    size: a 7-class photos-like task."""
    img = Image.fromarray(photo(rng, size, size))
    draw = ImageDraw.Draw(img)
    colour = tuple(int(v) for v in rng.integers(0, 256, size=3))
    r = int(rng.integers(size // 4, size * 2 // 5))
    cx, cy = (int(v) for v in rng.integers(r, size - r, size=2))
    box = (cx - r, cy - r, cx + r, cy + r)
    if kind == "circle":
        draw.ellipse(box, fill=colour)
    elif kind == "square":
        draw.rectangle(box, fill=colour)
    elif kind == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    elif kind == "hstripes":
        for y in range(cy - r, cy + r, 4):
            draw.rectangle((cx - r, y, cx + r, y + 1), fill=colour)
    elif kind == "vstripes":
        for x in range(cx - r, cx + r, 4):
            draw.rectangle((x, cy - r, x + 1, cy + r), fill=colour)
    elif kind == "cross":
        draw.rectangle((cx - r, cy - r // 4, cx + r, cy + r // 4), fill=colour)
        draw.rectangle((cx - r // 4, cy - r, cx + r // 4, cy + r), fill=colour)
    else:
        draw.ellipse(box, outline=colour, width=max(2, r // 4))
    return img


def sketch(rng: np.random.Generator, size: int = 48) -> Image.Image:
    """A line drawing: dark strokes on white paper."""
    img = Image.new("RGB", (size, size), (245, 245, 240))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 8))):
        points = [tuple(int(v) for v in rng.integers(0, size, size=2)) for _ in range(3)]
        draw.line(points, fill=(20, 20, 30), width=int(rng.integers(1, 3)))
    return img


def noise(rng: np.random.Generator, size: int = 48) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8))


def write_photos_tree(root: Path, train: int, val: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    for split, count in (("train", train), ("val", val)):
        for kind in SHAPES:
            folder = root / split / kind
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                shape_photo(rng, kind).save(folder / f"{i:04d}.png")
    return root


def write_foreign(folder: Path, make, count: int, seed: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        path = folder / f"{i:04d}.png"
        make(rng).save(path)
        paths.append(str(path))
    return paths


def train(data: Path, out: Path, epochs: int, seed: int, img_size: int = 32) -> Path:
    overrides = {"data.root": data, "output.dir": out, "model.name": "resnet10t", "data.img_size": img_size,
                 "data.num_workers": 0, "train.batch_size": 32, "train.epochs": epochs, "train.amp": "none",
                 "train.device": "cpu", "optim.lr": 0.4, "schedule.warmup_epochs": 1, "train.seed": seed,
                 "output.progress_bar": "off", "output.tensorboard": "false"}
    command = [sys.executable, str(REPO / "train.py"), "--config", "base", *(f"{k}={v}" for k, v in overrides.items())]
    subprocess.run(command, check=True, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="2"),
                   stdout=subprocess.DEVNULL)
    return out / "best.pt"


# the combinations measured for `combined` (rejection.COMBINED_OF was the default before mahalanobis_layers)
COMBINATIONS = (("mahalanobis", "energy"), ("mahalanobis_l2", "energy"), ("mahalanobis", "mahalanobis_l2"),
                ("mahalanobis", "mahalanobis_l2", "energy"), ("mahalanobis_layers", "energy"),
                ("mahalanobis_layers", "mahalanobis_l2", "energy"))


def all_scores(out, bank, val_ref=None) -> dict:
    """Every candidate score of `out`; the fits come from the training bank, the scales of the combinations
    and of the stages from `val_ref` (the validation scores; None: `out` is the validation split itself).
    `mahalanobis_layers` weighs the input's score INPUT_WEIGHT and the stages' the rest;
    `mahalanobis_layers_stages` averages the stages alone (the default before the input view);
    `mahalanobis_layers_min` takes the lowest standardised stage score; `mahalanobis_layers_early` averages
    the first half of the stages only; `mahalanobis_layers_input_min` the lower of the input's score and the
    stages' mean."""
    raw_means, raw_precision = mahalanobis_fit(bank.features, bank.labels, bank.num_classes)
    l2_means, l2_precision = mahalanobis_fit(normalise(bank.features), bank.labels, bank.num_classes)
    scores = {"msp": msp_score(out.logits), "energy": energy_score(out.logits),
              "knn": knn_score(out.features, bank.stored.float()),
              "mahalanobis": mahalanobis_score(out.features, raw_means, raw_precision),
              "mahalanobis_l2": mahalanobis_score(normalise(out.features), l2_means, l2_precision)}
    names = bank.layer_names
    views = layer_scores(out.layers, bank.layer_fits, names)
    view_names = [INPUT_STAGE if name == INPUT_STAGE else f"layer{i - (INPUT_STAGE in names)}"
                  for i, name in enumerate(names)]
    scores.update(zip(view_names, views))
    ref = val_ref or scores
    view_scales = [score_scale(ref[name]) for name in view_names]
    scores["mahalanobis_layers"] = multilayer_score(views, view_scales, layer_weights(names))
    stages = [i for i, name in enumerate(names) if name != INPUT_STAGE]
    per_layer, layer_scales = [views[i] for i in stages], [view_scales[i] for i in stages]
    scores["mahalanobis_layers_stages"] = multilayer_score(per_layer, layer_scales)
    scores["mahalanobis_layers_min"] = combined_score(per_layer, layer_scales)
    if INPUT_STAGE in names:
        at = names.index(INPUT_STAGE)
        scores["mahalanobis_layers_input_min"] = combined_score(
            [views[at], scores["mahalanobis_layers_stages"]], [view_scales[at], (0.0, 1.0)])
    early = max(1, (len(per_layer) + 1) // 2)        # the first half of the stages (resnet: stem, layer1, layer2)
    scores["mahalanobis_layers_early"] = multilayer_score(per_layer[:early], layer_scales[:early])
    for parts in COMBINATIONS:
        scores["+".join(parts)] = combined_score([scores[p] for p in parts], [score_scale(ref[p]) for p in parts])
    return scores


def measure_model(checkpoint: Path, foreign: dict[str, list[str]], coverage: float) -> dict:
    loaded = load_model_file(checkpoint)
    cfg = loaded.cfg
    train_index, val_index = scan_splits(cfg)
    device_input = DeviceInput.from_config(cfg, torch.device("cpu"), None)
    model = loaded.build_model(torch.device("cpu"), channels_last=False)

    def outputs(index):
        loader = build_eval_loader_for(index, loaded.eval_transform(), cfg.data.img_size, 64, 0, False)
        return collect_outputs(model, loader, device_input, with_features=True, with_layers=True)
    val = outputs(val_index)
    bank = outputs(bank_index(train_index, cfg.train.seed))
    bank.num_classes, bank.stored = len(loaded.classes), feature_bank(bank, cfg.train.seed)
    bank.layer_names = layer_names(model)
    bank.layer_fits = layer_fits(bank.layers, bank.labels, bank.num_classes, bank.layer_names)
    val_scores = all_scores(val, bank)
    thresholds = {n: threshold_for_coverage(s, coverage) for n, s in val_scores.items()}
    halves = [torch.arange(0, len(val), 2), torch.arange(1, len(val), 2)]
    kept = {n: sum(100.0 * float((s[b] >= threshold_for_coverage(s[a], coverage)).double().mean())
                   for a, b in (halves, halves[::-1])) / 2 for n, s in val_scores.items()}
    result = {"checkpoint": str(checkpoint), "val_images": len(val), "layers": layer_names(model),
              "val_top1": 100.0 * float((val.logits.argmax(1) == val.labels).double().mean()),
              "val_kept_held_out": kept, "rejected": {}}
    for name, paths in foreign.items():
        index = ImageIndex(Path(paths[0]).parent, list(loaded.classes), paths, [0] * len(paths))
        scores = all_scores(outputs(index), bank, val_scores)
        result["rejected"][name] = {n: 100.0 * float((s < thresholds[n]).double().mean()) for n, s in scores.items()}
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="a new folder for the data sets and the two runs")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--images", type=int, default=150, help="foreign images per kind")
    parser.add_argument("--coverage", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--photos", type=Path, help="a train/val tree of real photos for the photos model "
                        "(python benchmark.py --make-photos DIR --photo-source samples) instead of generated ones")
    parser.add_argument("--img-size", type=int, default=32, help="the photos model's input size")
    parser.add_argument("--models", default="photos_model,digits_model", help="which of the two to train")
    args = parser.parse_args(argv)
    out = Path(args.out)
    photos = args.photos or write_photos_tree(out / "photos", 100, 20, args.seed)
    digits = ensure_builtin("digits", out / "digits")
    n = args.images
    foreign = {"digits": sorted(str(p) for p in (digits / "val").rglob("*.png"))[:n],
               "photos": sorted(str(p) for p in (photos / "val").rglob("*.*") if p.is_file())[:n],
               "sketches": write_foreign(out / "foreign" / "sketches", sketch, n, args.seed + 1),
               "noise": write_foreign(out / "foreign" / "noise", noise, n, args.seed + 2)}
    result = {"coverage": args.coverage, "epochs": args.epochs, "models": {}}
    for name, data, own, size in (("photos_model", photos, "photos", args.img_size),
                                  ("digits_model", digits, "digits", 32)):
        if name not in args.models.split(","):
            continue
        checkpoint = train(data, out / f"run_{name}", args.epochs, args.seed, size)
        shown = {k: v for k, v in foreign.items() if k != own}
        result["models"][name] = measure_model(checkpoint, shown, args.coverage)
        print(json.dumps({name: result["models"][name]}), file=sys.stderr, flush=True)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
