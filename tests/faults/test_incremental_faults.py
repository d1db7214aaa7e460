"""Class-incremental runs under faults: an extension (exemplar memory, distillation from the base) killed
mid-epoch resumes bitwise equal to an uninterrupted one, reading its memory.csv back; a base whose training
files are gone leaves no exemplars and the run goes on with distillation alone, saying so; a resumed run whose
exemplar changed is refused."""
from __future__ import annotations

import csv
import json
import logging
import shutil
import signal
from pathlib import Path

import pytest
import torch
from conftest import make_tree, tiny_overrides
from kill_and_resume import STEPS_PER_EPOCH, assert_same_result, kill_at_pause, paused, run_to_end, start, train_cmd

from imgcls.config import load_config
from imgcls.training.trainer import run as train_run


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, Path]:
    """(the base's data root, its best.pt): classes a, b, c."""
    root = tmp_path_factory.mktemp("incremental_faults")
    data = make_tree(root / "A", {"a": (10, 3), "b": (10, 3), "c": (10, 3)})
    cfg = load_config("base", tiny_overrides(data, root / "runA", **{"model.name": "test_resnet", "train.epochs": 1,
                                                                      "output.tensorboard": "false",
                                                                      "calibration.temperature": "none"}))
    assert train_run(cfg) == 0
    return data, root / "runA" / "best.pt"


@pytest.mark.slow
def test_sigkill_mid_epoch_of_an_extension_then_resume_is_bitwise_equal(base, tmp_path):
    _, best = base
    # new classes d, e (12 each) + 4 exemplars of each old class: 36 training images, as the harness expects
    data = make_tree(tmp_path / "B", {"a": (1, 3), "b": (1, 3), "c": (1, 3), "d": (12, 3), "e": (12, 3)})
    for name in "abc":
        shutil.rmtree(data / "train" / name)
    extend = [f"incremental.base={best}", "incremental.memory_per_class=4", "incremental.align=true"]
    reference, run, marker = tmp_path / "reference", tmp_path / "run", tmp_path / "paused"
    run_to_end(train_cmd(data, reference, *extend))
    proc = start(train_cmd(data, run, *extend, script=paused(marker, f"after_save:{STEPS_PER_EPOCH + 2}")))
    kill_at_pause(proc, marker)
    assert proc.returncode == -signal.SIGKILL
    listed = (run / "memory.csv").read_text()
    done = run_to_end(train_cmd(data, run, *extend, "--resume", "auto"))
    assert "resumed at epoch 2, batch 1, optimizer step 5" in done.stderr
    assert_same_result(run, reference)
    assert (run / "memory.csv").read_text() == listed == (reference / "memory.csv").read_text()
    a, b = (json.loads((d / "summary.json").read_text()) for d in (reference, run))
    assert a["incremental"] == b["incremental"]
    assert (a["best"]["old_top1"], a["best"]["new_top1"]) == (b["best"]["old_top1"], b["best"]["new_top1"])

    # an exemplar whose bytes changed: the resume is refused (exit 2) before any work
    exemplar = Path(next(csv.DictReader(listed.splitlines()))["path"])
    saved = exemplar.read_bytes()
    try:
        exemplar.write_bytes(saved + b"\0")
        refused = __import__("subprocess").run(train_cmd(data, run, *extend, "--resume", "auto", "train.epochs=3"),
                                               capture_output=True, text=True, timeout=240)
        assert refused.returncode == 2 and "changed since the run started" in refused.stderr
    finally:
        exemplar.write_bytes(saved)


def test_base_files_gone_leave_no_exemplars_and_say_so(base, tmp_path, caplog):
    from imgcls.incremental.memory import choose_memory
    from imgcls.objectives.incremental import base_teacher, open_base

    data, best = base
    opened = open_base(str(best))
    model = base_teacher(opened, str(best), torch.device("cpu")).model
    kept = choose_memory(opened, model, best, 3, torch.device("cpu"), 8, 0)
    assert [e.label for e in kept] == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    moved = tmp_path / "moved"
    shutil.move(str(data / "train"), moved)
    try:
        with caplog.at_level(logging.WARNING):
            assert choose_memory(opened, model, best, 3, torch.device("cpu"), 8, 0) == []
    finally:
        shutil.move(str(moved), str(data / "train"))
    text = caplog.text
    assert "the base run's training files cannot be read" in text and "distillation alone" in text
