"""The LR range test's held-out check: on generated photos-like data (benchmarking/reject_matrix.py's seven
shape classes on photo backgrounds, never in the repo), run `tune.py --lr-range`, then train the same
epochs with its `use: optim.lr=...` and with the default recipe's optim.lr, and compare validation top-1.
Prints one JSON object; docs/advice.md holds the figures it measured.

python -m imgcls.benchmarking.lr_heldout --out /tmp/lrcheck [--epochs 8] [--batch 32] [--steps 60]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from imgcls.benchmarking.reject_matrix import write_photos_tree

REPO = Path(__file__).resolve().parents[2]


def common(data: Path, out: Path, batch: int, epochs: int, seed: int) -> list[str]:
    values = {"data.root": data, "output.dir": out, "model.name": "resnet10t", "data.img_size": 32,
              "data.num_workers": 0, "train.batch_size": batch, "train.epochs": epochs, "train.amp": "none",
              "train.device": "cpu", "train.seed": seed, "output.progress_bar": "off", "output.tensorboard": "false"}
    return [f"{k}={v}" for k, v in values.items()]


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / script), *args], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="2"), check=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    out = Path(args.out)
    data = write_photos_tree(out / "data", 100, 20, seed=args.seed + 10)
    lr_json = out / "lr.json"
    run("tune.py", "--config", "base", *common(data, out / "unused", args.batch, 1, args.seed),
        "--lr-range", "1e-4,100", "--steps", str(args.steps), "--json", str(lr_json))
    found = json.loads(lr_json.read_text())
    result = {"suggested_optim_lr": found["optim_lr"], "confidence": found["confidence"],
              "confidence_reasons": found["confidence_reasons"], "steepest_lr": found["steepest_lr"],
              "minimum_lr": found["minimum_lr"], "divergence_lr": found["divergence_lr"], "runs": {}}
    for name, lr in (("default", None), ("suggested", found["optim_lr"])):
        run_dir = out / f"run_{name}"
        extra = [] if lr is None else [f"optim.lr={lr:.4g}"]
        run("train.py", "--config", "base", *common(data, run_dir, args.batch, args.epochs, args.seed), *extra)
        summary = json.loads((run_dir / "summary.json").read_text())
        result["runs"][name] = {"optim_lr": lr if lr is not None else 0.1, "best_top1": summary["best"]["top1"],
                                "best_loss": summary["best"]["loss"]}
        print(json.dumps({name: result["runs"][name]}), file=sys.stderr, flush=True)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
