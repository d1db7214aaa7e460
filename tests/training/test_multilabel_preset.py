"""A preset's label smoothing with data.task=multilabel (issue 34): the README's multi-label command, on
`--config resnet50` (train.label_smoothing=0.1), trains; multi-hot targets are smoothed as timm's
BinaryCrossEntropy smooths them."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import run_script, tiny_overrides
from multilabel_data import TAGS, make_tag_list

from imgcls.config import load_config
from imgcls.tasks import get_task
from imgcls.tasks.losses import AsymmetricLoss, BinaryCrossEntropy, build_criterion

README_MULTILABEL = ["data.task=multilabel", "data.format=csv", "data.root={root}",
                     "data.train_csv={root}/train.csv", "data.val_fraction=0.2"]


def test_the_resnet50_preset_loads_for_multilabel_with_its_smoothing():
    cfg = load_config("resnet50", [a.format(root="/data/planet") for a in README_MULTILABEL])
    assert cfg.train.label_smoothing == 0.1 and cfg.train.loss == "bce"
    criterion = build_criterion(cfg.train)
    assert isinstance(criterion, BinaryCrossEntropy) and criterion.smoothing == 0.1
    cfg = load_config("resnet50", [a.format(root="/x") for a in README_MULTILABEL] + ["train.loss=asl"])
    assert build_criterion(cfg.train).smoothing == 0.1


def test_multi_hot_targets_are_smoothed_like_timm():
    logits = torch.randn(3, 4)
    targets = torch.tensor([[1.0, 0, 1, 0], [0, 0, 0, 0], [0, 1, 0, 0]])
    s, c = 0.1, 4
    want = torch.where(targets > 0, 1 - s + s / c, s / c)
    assert torch.allclose(BinaryCrossEntropy(s)(logits, targets),
                          F.binary_cross_entropy_with_logits(logits, want))
    plain = AsymmetricLoss(0.0, 0.0, 0.0, smoothing=s)     # no focusing, no clip: BCE on the smoothed targets
    assert torch.allclose(plain(logits, targets), F.binary_cross_entropy_with_logits(logits, want), atol=1e-6)
    assert not torch.allclose(AsymmetricLoss(0.0, 0.0, 0.0)(logits, targets), plain(logits, targets))


@pytest.mark.slow
def test_the_readme_multilabel_command_runs(tmp_path):
    root = tmp_path / "planet"
    root.mkdir()
    make_tag_list(root, 40, name="train.csv")
    run_dir = tmp_path / "run"
    command = [a.format(root=root) for a in README_MULTILABEL]
    tiny = tiny_overrides(root, run_dir, **{"train.epochs": 1, "train.batch_size": 8})
    tiny = [o for o in tiny if not o.startswith("data.root=")]
    result = run_script("train.py", "--config", "resnet50", *command, *tiny)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "label smoothing 0.1" in result.stderr + result.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epochs_completed"] == 1
    best = torch.load(run_dir / "best.pt", weights_only=True)
    assert best["classes"] == sorted(TAGS)


@pytest.mark.slow
def test_the_multilabel_config_learns_the_tags_and_the_default_crop_is_warned_of(tmp_path):
    root = tmp_path / "tags"
    root.mkdir()
    make_tag_list(root, 96, name="train.csv", strength=60)
    run_dir = tmp_path / "run"
    tiny = tiny_overrides(root, run_dir, **{"train.epochs": 6, "train.batch_size": 16, "data.img_size": 24,
                                            "optim.lr": 0.001})
    command = [f"data.train_csv={root}/train.csv", "data.val_fraction=0.25"]
    result = run_script("train.py", "--config", "multilabel", *command, *tiny)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "can cut a tagged object out" not in result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best"]["mAP"] >= 90.0, summary["best"]
    cfg = load_config("multilabel", [f"data.root={root}", *command, "data.scale=[0.08,1.0]"])
    warnings = get_task("multilabel").startup_warnings(cfg)
    assert "a random-resized crop down to 8% of the image can cut a tagged object out" in warnings[0]
