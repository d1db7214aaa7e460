"""Semi-supervised training under faults and processes: a FlexMatch run with distribution alignment, killed with
SIGKILL mid-epoch, resumes bitwise equal to an uninterrupted one (the unlabelled stream's position, the class
index per unlabelled image, the alignment's running mean, the logged sums); under torchrun two processes train
the same model as one (GroupNorm, fixed labelled crops: the unlabelled views are seeded by their place in the
stream, not by the process)."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from conftest import make_tree, run_script, tiny_overrides
from kill_and_resume import STEPS_PER_EPOCH, assert_same_result, kill_at_pause, paused, run_to_end, start, train_cmd

CLASSES = ["a", "b", "c"]


@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("semi_faults")
    data = make_tree(base / "data", {c: (12, 3) for c in CLASSES})
    pool = make_tree(base / "pool", {c: 8 for c in CLASSES}, splits=("pool",), size=(20, 20), seed=5)
    return data, pool


def semi_args(pool: Path) -> list[str]:
    return ["semi.method=flexmatch", f"data.unlabeled={pool}", "semi.ratio=1", "semi.threshold=0.6",
            "semi.dist_align=true", "calibration.temperature=none"]


@pytest.mark.slow
def test_sigkill_mid_epoch_of_a_flexmatch_run_then_resume_is_bitwise_equal(trees, tmp_path):
    data, pool = trees
    reference, run, marker = tmp_path / "reference", tmp_path / "run", tmp_path / "paused"
    run_to_end(train_cmd(data, reference, *semi_args(pool)))
    proc = start(train_cmd(data, run, *semi_args(pool), script=paused(marker, f"after_save:{STEPS_PER_EPOCH + 2}")))
    kill_at_pause(proc, marker)
    assert proc.returncode == -signal.SIGKILL
    saved = torch.load(run / "last.pt", map_location="cpu", weights_only=True)
    assert (saved["epoch"], saved["step"], saved["batch_in_epoch"]) == (1, STEPS_PER_EPOCH + 1, 1)
    assert saved["semi"]["batches_taken"] == STEPS_PER_EPOCH + 1
    done = run_to_end(train_cmd(data, run, *semi_args(pool), "--resume", "auto"))
    assert "resumed at epoch 2, batch 1, optimizer step 5" in done.stderr
    assert_same_result(run, reference)
    a = torch.load(reference / "last.pt", map_location="cpu", weights_only=True)["semi"]
    b = torch.load(run / "last.pt", map_location="cpu", weights_only=True)["semi"]
    assert a["batches_taken"] == b["batches_taken"] == 8
    for key in ("class_of_image", "p_model", "totals", "sums"):
        assert torch.equal(a[key], b[key]), key
    assert (a["class_of_image"] >= 0).any()  # some images reached the threshold: the state is not trivially equal


@pytest.mark.slow
def test_two_processes_train_the_same_semi_supervised_model_as_one(trees, tmp_path):
    from test_distributed import torchrun

    data, pool = trees
    same = {"data.scale": "[1.0,1.0]", "data.ratio": "[1.0,1.0]", "data.hflip": 0, "model.norm": "group",
            "model.group_norm_groups": 4, "model.name": "test_resnet", "output.tensorboard": "false",
            "semi.method": "flexmatch", "data.unlabeled": str(pool), "semi.ratio": 1, "semi.threshold": 0.6,
            "train.epochs": 1, "calibration.temperature": "none"}
    one = run_script("train.py", "--config", "base",
                     *tiny_overrides(data, tmp_path / "one", **same, **{"train.batch_size": 8}))
    assert one.returncode == 0, one.stderr[-2000:]
    two = torchrun("--config", "base", *tiny_overrides(data, tmp_path / "two", **same, **{"train.batch_size": 4}))
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    a = torch.load(tmp_path / "one" / "last.pt", map_location="cpu", weights_only=True)
    b = torch.load(tmp_path / "two" / "last.pt", map_location="cpu", weights_only=True)
    assert a["step"] == b["step"] == 4
    for key in a["model"]:
        assert torch.allclose(a["model"][key], b["model"][key], rtol=1e-4, atol=1e-6), key
    assert a["semi"]["batches_taken"] == b["semi"]["batches_taken"] == 4
    assert torch.equal(a["semi"]["class_of_image"], b["semi"]["class_of_image"])
    assert torch.equal(a["semi"]["totals"], b["semi"]["totals"])
