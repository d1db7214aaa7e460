"""model.ema_decay: the weight average, what validation and best.pt use, and an exact resume."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, make_tree, run_script, tiny_overrides

from imgcls.models.ema import create_ema

EMA_DECAY = 0.8


def test_ema_follows_the_weights_by_the_decay():
    model = torch.nn.Linear(3, 2)
    ema = create_ema(model, decay=0.75)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema.update(model, step=1)  # the first update copies
    assert torch.equal(ema.module.weight, torch.ones(2, 3))
    with torch.no_grad():
        model.weight.fill_(3.0)
    ema.update(model, step=2)
    assert torch.allclose(ema.module.weight, torch.full((2, 3), 0.75 * 1.0 + 0.25 * 3.0))
    assert not any(p.requires_grad for p in ema.parameters())


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return make_tree(tmp_path_factory.mktemp("ema") / "data", {"a": (16, 7), "b": (16, 7), "c": (16, 7)})


def ema_args(data_root: Path, out: Path) -> list[str]:
    return ["--config", "base", *tiny_overrides(data_root, out, **{"model.ema_decay": EMA_DECAY,
                                                                   "checkpoint.every_steps": 2,
                                                                   "data.num_workers": 0})]


@pytest.mark.slow
def test_validation_and_best_pt_use_the_average(data_root, tmp_path):
    out = tmp_path / "run"
    result = run_script("train.py", *ema_args(data_root, out))
    assert result.returncode == 0, result.stderr
    last = torch.load(out / "last.pt", weights_only=True)
    best = torch.load(out / "best.pt", weights_only=True)
    assert set(last["model_ema"]) == set(last["model"])
    # last.pt: the trained weights, and the average beside them; they differ
    assert any(not torch.equal(last["model"][k], last["model_ema"][k]) for k in last["model"]
               if last["model"][k].is_floating_point())
    # timm's validate.py path (load_checkpoint with use_ema) reads the average from last.pt
    import timm
    from timm.models import load_checkpoint

    fresh = timm.create_model("resnet10t", num_classes=3)
    load_checkpoint(fresh, str(out / "last.pt"), use_ema=True, strict=True)
    assert all(torch.equal(fresh.state_dict()[k], last["model_ema"][k]) for k in last["model_ema"])
    summary = json.loads((out / "summary.json").read_text())
    if summary["best_epoch"] == 2:  # best.pt was written at the end: it holds the average, not the weights
        assert all(torch.equal(best["model"][k], last["model_ema"][k]) for k in best["model"])
    # eval.py on best.pt evaluates what validation evaluated
    evaluated = run_script("eval.py", "--checkpoint", str(out / "best.pt"), "--json", str(tmp_path / "e.json"))
    assert evaluated.returncode == 0, evaluated.stderr
    metrics = json.loads((tmp_path / "e.json").read_text())
    for key in ("top1", "top5", "loss", "mean_class_acc", "num_samples"):
        assert metrics[key] == summary["best"][key], key


@pytest.mark.slow
def test_resume_with_ema_is_bitwise_equal(data_root, tmp_path):
    reference = tmp_path / "reference"
    assert run_script("train.py", *ema_args(data_root, reference)).returncode == 0

    out = tmp_path / "stopped"
    marker = tmp_path / "marker"
    cmd = [sys.executable, str(REPO / "tests" / "paused_train.py"), str(marker), "after_save:5", "--",
           *ema_args(data_root, out)]
    # the same thread count as run_script: float sums are only bitwise repeatable at a fixed thread count
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.time() + 120
    while not marker.exists():
        assert proc.poll() is None and time.time() < deadline, "the run did not reach its pause point"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 6 < torch.load(out / "last.pt", weights_only=True)["step"] < 12  # stopped inside epoch 2

    resumed = run_script("train.py", *ema_args(data_root, out), "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    a = torch.load(reference / "last.pt", weights_only=True)
    b = torch.load(out / "last.pt", weights_only=True)
    for key in ("model", "model_ema"):
        assert a[key].keys() == b[key].keys()
        assert all(torch.equal(a[key][k], b[key][k]) for k in a[key]), key


def test_ema_every_n_steps_updates_at_multiples_with_the_decay_to_the_nth():
    model = torch.nn.Linear(3, 2, bias=False)
    ema = create_ema(model, decay=0.9, every_steps=3)
    initial = ema.module.weight[0, 0].item()
    values = {}
    for step in range(1, 10):
        with torch.no_grad():
            model.weight.fill_(float(step))
        ema.update(model, step=step)
        values[step] = ema.module.weight[0, 0].item()
    assert values[1] == values[2] == initial      # no update before step 3
    assert values[3] == 3.0                       # the first update copies (its window starts at step 1)
    assert values[4] == values[5] == 3.0          # nothing between the multiples
    assert values[6] == pytest.approx(0.9 ** 3 * 3.0 + (1 - 0.9 ** 3) * 6.0)
    assert values[9] == pytest.approx(0.9 ** 3 * values[6] + (1 - 0.9 ** 3) * 9.0)


def test_ema_warmup_ramps_the_decay_up_to_ema_decay():
    ema = create_ema(torch.nn.Linear(2, 2), decay=0.999, warmup=True)
    decays = [ema.get_decay(step) for step in (1, 2, 10, 100, 10**6)]
    assert decays[0] == 0.0
    assert decays[1] == pytest.approx(1 - 2 ** (-2 / 3))   # timm: 1 - (1 + t) ** -2/3 with t = step - 1
    assert decays[1] < decays[2] < decays[3] < 0.999
    assert decays[4] == 0.999
    assert create_ema(torch.nn.Linear(2, 2), decay=0.999).get_decay(2) == 0.999
