"""Distillation under faults and processes: a distilled run (feature type: the projection trains, its weights
and optimizer state are in last.pt) killed mid-epoch resumes bitwise equal to an uninterrupted one; under
torchrun two processes train the same student as one process (GroupNorm student, fixed crops: the math
is the same, up to the order of float sums)."""
from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from conftest import make_tree, run_script, tiny_overrides, write_pretrained_folder
from kill_and_resume import STEPS_PER_EPOCH, assert_same_result, kill_at_pause, paused, run_to_end, start, train_cmd

CLASSES = ["a", "b", "c"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return make_tree(tmp_path_factory.mktemp("distill_faults") / "data", {c: (12, 3) for c in CLASSES})


@pytest.fixture(scope="module")
def teacher_folder(tmp_path_factory) -> Path:
    """A timm folder teacher on these classes (label_names), with its own mean/std and input size."""
    folder = tmp_path_factory.mktemp("teacher") / "timm"
    write_pretrained_folder(folder, "test_resnet", num_classes=3, label_names=CLASSES)
    return folder


@pytest.mark.slow
def test_sigkill_mid_epoch_of_a_distilled_run_then_resume_is_bitwise_equal(data_root, teacher_folder, tmp_path):
    distill = [f"distill.teacher=local-dir:{teacher_folder}", "distill.type=feature"]
    reference, run, marker = tmp_path / "reference", tmp_path / "run", tmp_path / "paused"
    run_to_end(train_cmd(data_root, reference, *distill))
    proc = start(train_cmd(data_root, run, *distill, script=paused(marker, f"after_save:{STEPS_PER_EPOCH + 2}")))
    kill_at_pause(proc, marker)
    assert proc.returncode == -signal.SIGKILL
    saved = torch.load(run / "last.pt", map_location="cpu", weights_only=True)
    assert (saved["epoch"], saved["step"], saved["batch_in_epoch"]) == (1, STEPS_PER_EPOCH + 1, 1)
    done = run_to_end(train_cmd(data_root, run, *distill, "--resume", "auto"))
    assert "resumed at epoch 2, batch 1, optimizer step 5" in done.stderr
    assert_same_result(run, reference)
    a = torch.load(reference / "last.pt", map_location="cpu", weights_only=True)
    b = torch.load(run / "last.pt", map_location="cpu", weights_only=True)
    assert all(torch.equal(a["distill"]["projection"][k], b["distill"]["projection"][k]) for k in ("weight", "bias"))
    assert a["distill"]["teacher_metrics"] == b["distill"]["teacher_metrics"]


@pytest.mark.slow
def test_two_processes_distil_the_same_student_as_one(data_root, teacher_folder, tmp_path):
    from test_distributed import torchrun

    same_images = {"data.scale": "[1.0,1.0]", "data.ratio": "[1.0,1.0]", "data.hflip": 0, "model.norm": "group",
                   "model.group_norm_groups": 4, "model.name": "test_resnet", "output.tensorboard": "false",
                   "distill.teacher": f"local-dir:{teacher_folder}", "distill.alpha": 0.7}
    one = run_script("train.py", "--config", "base",
                     *tiny_overrides(data_root, tmp_path / "one", **same_images, **{"train.batch_size": 8}))
    assert one.returncode == 0, one.stderr[-2000:]
    two = torchrun("--config", "base", *tiny_overrides(data_root, tmp_path / "two", **same_images,
                                                       **{"train.batch_size": 4}))
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    a = torch.load(tmp_path / "one" / "last.pt", map_location="cpu", weights_only=True)
    b = torch.load(tmp_path / "two" / "last.pt", map_location="cpu", weights_only=True)
    assert a["step"] == b["step"] == 8
    for key in a["model"]:
        assert torch.allclose(a["model"][key], b["model"][key], rtol=1e-4, atol=1e-6), key
    assert a["distill"]["teacher_metrics"] == pytest.approx(b["distill"]["teacher_metrics"])
    import csv

    rows = [list(csv.DictReader((tmp_path / d / "metrics.csv").open())) for d in ("one", "two")]
    assert [r["val_teacher_agreement"] for r in rows[0]] == [r["val_teacher_agreement"] for r in rows[1]]


def test_ranks_that_load_different_teacher_files_are_refused_on_every_rank(monkeypatch):
    """Every rank gathers every rank's digest (all_gather: the same list everywhere), so all of them refuse,
    listing the digests; the same teacher everywhere passes."""
    from types import SimpleNamespace

    import imgcls.objectives.teacher as teacher_module
    from imgcls.core.errors import ConfigError

    ours = SimpleNamespace(identity={"source": "/nfs/teacher/best.pt", "sha256": "a" * 64})
    gathered = [["a" * 64, None], ["b" * 64, None]]  # what all_gather gives every rank: rank 1 saw another file
    monkeypatch.setattr(teacher_module.dist_utils, "all_gather_objects", lambda item: gathered)
    with pytest.raises(ConfigError) as caught:
        teacher_module.check_same_teacher_everywhere(ours)
    assert str(caught.value).startswith("'distill.teacher' = /nfs/teacher/best.pt: the processes loaded different "
                                        "teachers (rank 0: aaaaaaaaaaaa, rank 1: bbbbbbbbbbbb)")
    gathered[1] = ["a" * 64, None]
    teacher_module.check_same_teacher_everywhere(ours)
