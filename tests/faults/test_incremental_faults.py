"""Class-incremental runs under faults: an extension (exemplar memory, distillation from the base) killed
mid-epoch resumes bitwise equal to an uninterrupted one, reading its memory.csv back; a base whose training
files are gone leaves no exemplars and the run goes on with distillation alone, saying so; a resumed run whose
exemplar changed is refused; under torchrun two processes extend a base as one process does (the same memory,
the same base figure, the same weights), and processes that opened different bases are refused."""
from __future__ import annotations

import csv
import json
import logging
import shutil
import signal
from pathlib import Path

import pytest
import torch
from conftest import make_tree, run_script, tiny_overrides
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


@pytest.mark.slow
def test_two_processes_extend_the_same_base_as_one(tmp_path):
    """Under torchrun two processes (batch 4 each) extend a GroupNorm base as one process with batch 8 does
    (fixed crops): the same memory.csv (rank 0 herds it, every rank trains on it), the same base old-class
    figure (its sums gathered over the ranks: 6 of 9 images, where rank 0's own share would give 3 of 5), the
    same imprinted start, the same trained and aligned weights (up to the order of float sums) and figures."""
    from test_distributed import torchrun

    same = {"data.scale": "[1.0,1.0]", "data.ratio": "[1.0,1.0]", "data.hflip": 0, "model.norm": "group",
            "model.group_norm_groups": 4, "model.name": "test_resnet", "output.tensorboard": "false",
            "calibration.temperature": "none", "train.epochs": 2}
    base_data = make_tree(tmp_path / "A", {"a": (8, 3), "b": (8, 3), "c": (8, 3)})
    base = run_script("train.py", "--config", "base", *tiny_overrides(base_data, tmp_path / "runA", **same))
    assert base.returncode == 0, base.stderr[-2000:]
    # new classes d, e (10 each) + 4 exemplars of each old class: 32 training images, 4 steps of 8 (2 x 4) an
    # epoch; the validation split holds every class (3 + 3 + 3 old, 3 + 2 new: 14, 7 per rank)
    data = make_tree(tmp_path / "B", {"a": (1, 3), "b": (1, 3), "c": (1, 3), "d": (10, 3), "e": (10, 2)})
    for name in "abc":
        shutil.rmtree(data / "train" / name)
    extend = {**same, "incremental.base": str(tmp_path / "runA" / "best.pt"), "incremental.memory_per_class": 4,
              "incremental.align": "true"}
    one = run_script("train.py", "--config", "base",
                     *tiny_overrides(data, tmp_path / "one", **extend, **{"train.batch_size": 8}))
    assert one.returncode == 0, one.stderr[-2000:]
    two = torchrun("--config", "base", *tiny_overrides(data, tmp_path / "two", **extend, **{"train.batch_size": 4}))
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]

    listed = (tmp_path / "one" / "memory.csv").read_text()
    assert listed == (tmp_path / "two" / "memory.csv").read_text() and len(listed.splitlines()) == 1 + 3 * 4
    a = torch.load(tmp_path / "one" / "last.pt", map_location="cpu", weights_only=True)
    b = torch.load(tmp_path / "two" / "last.pt", map_location="cpu", weights_only=True)
    assert a["step"] == b["step"] == 8
    for key in a["model"]:
        assert torch.allclose(a["model"][key], b["model"][key], rtol=1e-4, atol=1e-6), key
    best = [torch.load(tmp_path / d / "best.pt", map_location="cpu", weights_only=True)["model"]
            for d in ("one", "two")]
    for key in best[0]:
        assert torch.allclose(best[0][key], best[1][key], rtol=1e-4, atol=1e-6), key
    assert a["incremental"] == b["incremental"] and 0 < a["incremental"]["base_old_top1"] < 100
    x, y = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "two"))
    assert x["incremental"] == y["incremental"]
    assert x["incremental"]["memory"]["exemplars"] == 12
    assert (x["best"]["old_top1"], x["best"]["new_top1"]) == (y["best"]["old_top1"], y["best"]["new_top1"])
    rows = [list(csv.DictReader((tmp_path / d / "metrics.csv").open())) for d in ("one", "two")]
    assert [(r["val_old_top1"], r["val_new_top1"], r["val_top1"]) for r in rows[0]] == \
        [(r["val_old_top1"], r["val_new_top1"], r["val_top1"]) for r in rows[1]]


def test_ranks_that_open_different_bases_are_refused_on_every_rank(base, monkeypatch):
    """Every rank gathers every rank's digest of the base file (the same list everywhere), so all of them refuse
    before the memory is chosen, listing the digests; the same base everywhere passes."""
    import imgcls.objectives.incremental as incremental_module
    from imgcls.core.errors import ConfigError
    from imgcls.objectives.teacher import file_sha256

    _, best = base
    opened = incremental_module.open_base(str(best))
    ours = file_sha256(best)
    gathered = [ours, "b" * 64]  # what all_gather gives every rank: rank 1's node holds another file there
    monkeypatch.setattr(incremental_module.dist_utils, "all_gather_objects", lambda item: gathered)
    with pytest.raises(ConfigError) as caught:
        incremental_module.check_same_base_everywhere(str(best), opened)
    assert str(caught.value) == (f"'incremental.base' = {best}: the processes loaded different bases (rank 0: "
                                 f"{ours[:12]}, rank 1: bbbbbbbbbbbb); every node must see the same file")
    gathered[1] = ours
    incremental_module.check_same_base_everywhere(str(best), opened)
