#!/usr/bin/env python
"""The multi-label figures of docs/multilabel.md: train.py with train.loss=bce and =asl on the generated tag set of the
tests (tests/multilabel_data.py), eval.py's mAP on the held-out files, scikit-learn's mAP on infer.py's
probabilities for the same files, and a plain PyTorch BCE loop (same model, split, optimizer and epochs) as
the baseline.

python docs/multilabel_example.py [--images 256] [--epochs 4] [--strength 12] [--workdir /tmp/imgcls-multilabel]
"""
from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from sklearn.metrics import average_precision_score

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from multilabel_data import TAGS, make_tag_list  # noqa: E402

COMMON = {"data.task": "multilabel", "data.format": "csv", "data.val_fraction": 0.25, "model.name": "resnet10t",
          "data.img_size": 16, "data.num_workers": 0, "train.batch_size": 16, "train.amp": "none",
          "train.device": "cpu", "optim.name": "adamw", "optim.lr": 0.001, "optim.lr_scaling": "none",
          "schedule.warmup_epochs": 1, "output.progress_bar": "off", "output.tensorboard": "false"}


def run(*args) -> None:
    subprocess.run([sys.executable, *map(str, args)], cwd=REPO, check=True, capture_output=True, text=True)


def split_rows(run_dir: Path, side: str) -> list[dict]:
    with open(run_dir / f"split_{side}.csv") as f:
        return list(csv.DictReader(f))


def truth(rows: list[dict]) -> np.ndarray:
    return np.array([[t in r["label"].split(" ") for t in TAGS] for r in rows], dtype=int)


def ours(data: Path, work: Path, loss: str, epochs: int) -> dict:
    out = work / f"run_{loss}"
    values = {**COMMON, "data.train_csv": data / "list.csv", "output.dir": out, "train.loss": loss,
              "train.epochs": epochs, "output.overwrite": "true"}
    run("train.py", "--config", "base", *(f"{k}={v}" for k, v in values.items()))
    run("eval.py", "--checkpoint", out / "best.pt", "--json", work / f"eval_{loss}.json")
    rows = split_rows(out, "val")
    run("infer.py", *(data / r["path"] for r in rows), "--checkpoint", out / "best.pt", "--output",
        work / f"infer_{loss}.csv", "--num-workers", "0")
    with open(work / f"infer_{loss}.csv") as f:
        probs = np.array([[float(r[t]) for t in TAGS] for r in csv.DictReader(f)])
    doc = json.loads((work / f"eval_{loss}.json").read_text())
    return {"eval_mAP": doc["mAP"], "sklearn_mAP": 100 * average_precision_score(truth(rows), probs),
            "micro_f1": doc["micro_f1"], "micro_f1_at_0.5": doc["micro_f1_at_0.5"], "run": out}


def load(data: Path, rows: list[dict]) -> torch.Tensor:
    images = [np.asarray(Image.open(data / r["path"]).convert("RGB").resize((16, 16), Image.BILINEAR))
              for r in rows]
    x = torch.tensor(np.stack(images)).permute(0, 3, 1, 2).float() / 255
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    return (x - mean[:, None, None]) / std[:, None, None]


def plain_loop(data: Path, run_dir: Path, epochs: int) -> float:
    """The baseline: timm's resnet10t, AdamW 1e-3, BCEWithLogits, horizontal flips, best validation mAP."""
    import timm

    torch.manual_seed(0)
    train_rows, val_rows = split_rows(run_dir, "train"), split_rows(run_dir, "val")
    x, y = load(data, train_rows), torch.tensor(truth(train_rows)).float()
    xv, yv = load(data, val_rows), truth(val_rows)
    model = timm.create_model("resnet10t", num_classes=len(TAGS))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    best = 0.0
    for _ in range(epochs):
        model.train()
        for batch in torch.randperm(len(x)).split(16):
            if len(batch) < 2:
                continue
            images = torch.where(torch.rand(len(batch), 1, 1, 1) < 0.5, x[batch].flip(3), x[batch])
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(images), y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            probs = model(xv).sigmoid().numpy()
        best = max(best, 100 * average_precision_score(yv, probs))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--strength", type=float, default=12, help="a tag's brightening of its quadrant "
                        "(the noise has sd 25): lower is harder")
    parser.add_argument("--workdir", default="/tmp/imgcls-multilabel")
    args = parser.parse_args()
    work = Path(args.workdir)
    data = work / "data"
    if not (data / "list.csv").exists():
        make_tag_list(data, args.images, strength=args.strength)
    results = {loss: ours(data, work, loss, args.epochs) for loss in ("bce", "asl")}
    baseline = plain_loop(data, results["bce"]["run"], args.epochs)
    print("| run | eval.py mAP | scikit-learn mAP on infer.py's probabilities | micro F1 (tuned) | micro F1 at 0.5 |")
    print("| --- | --- | --- | --- | --- |")
    for loss, r in results.items():
        print(f"| train.py, train.loss={loss} | {r['eval_mAP']:.2f} | {r['sklearn_mAP']:.2f} | {r['micro_f1']:.2f} | "
              f"{r['micro_f1_at_0.5']:.2f} |")
    print(f"| plain PyTorch BCE loop (best epoch) | - | {baseline:.2f} | - | - |")


if __name__ == "__main__":
    main()
