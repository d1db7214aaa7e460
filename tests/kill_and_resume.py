"""The kill-and-resume harness: train.py in real processes, halted at exact points by tests/paused_train.py
and killed there, and the check that a resumed run ends bitwise equal to an uninterrupted one. Used by the
resume tests of every feature."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from conftest import REPO, tiny_overrides, wait_for

# 36 training images, batch 8: 4 optimizer steps per epoch (the short last batch is dropped), 2 epochs.
STEPS_PER_EPOCH = 4
TOTAL_STEPS = 8
SETTINGS = {"model.name": "test_resnet", "data.num_workers": 2, "data.scale": "[0.25,1.0]", "data.hflip": 0.5,
            "checkpoint.every_steps": 1, "output.log_interval": 1, "output.tensorboard": "false"}
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
TIMEOUT = 240


def train_cmd(data_root: Path, out: Path, *extra: str, script: list | None = None) -> list:
    script = script or [str(REPO / "train.py")]
    return [sys.executable, *script, "--config", "base", *tiny_overrides(data_root, out, **SETTINGS), *extra]


def run_to_end(cmd: list) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def start(cmd: list) -> subprocess.Popen:
    """The run in its own process group (with its loader workers), as a job under a scheduler is."""
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def kill_at_pause(proc: subprocess.Popen, marker: Path) -> None:
    wait_for(proc, marker.exists, f"the pause point ({marker.name})")
    os.killpg(proc.pid, signal.SIGKILL)  # the run and its loader workers, as a node failure would
    proc.wait(timeout=TIMEOUT)
    marker.unlink()


def assert_same_result(run: Path, reference: Path) -> None:
    a = torch.load(reference / "last.pt", map_location="cpu", weights_only=True)
    b = torch.load(run / "last.pt", map_location="cpu", weights_only=True)
    assert (a["step"], a["epoch"]) == (b["step"], b["epoch"]) == (TOTAL_STEPS, 2)
    assert a["model"].keys() == b["model"].keys()
    different = [k for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])]
    assert not different, f"weights differ from the uninterrupted run in {different[:5]}"
    best_a = torch.load(reference / "best.pt", map_location="cpu", weights_only=True)
    best_b = torch.load(run / "best.pt", map_location="cpu", weights_only=True)
    assert best_a["epoch"] == best_b["epoch"]
    assert all(torch.equal(best_a["model"][k], best_b["model"][k]) for k in best_a["model"])
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (reference, run))
    assert sb["best"]["top1"] == sa["best"]["top1"] and sb["best_epoch"] == sa["best_epoch"]
    assert sb["best"]["loss"] == sa["best"]["loss"]
    assert (sb["epochs_completed"], sb["steps_completed"]) == (2, TOTAL_STEPS)
    with (run / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [1, 2], "metrics.csv must hold each epoch once"
    with (reference / "metrics.csv").open() as f:
        ref_rows = list(csv.DictReader(f))
    for row, ref in zip(rows, ref_rows):
        for key in ("step", "lr", "train_loss", "val_top1", "val_loss", "val_num_samples"):
            assert row[key] == ref[key], (key, row, ref)


def paused(marker: Path, point: str) -> list:
    return [str(REPO / "tests" / "paused_train.py"), str(marker), point, "--"]
