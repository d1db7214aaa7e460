"""Exact resume with real processes: a run killed (SIGKILL, SIGTERM, SIGINT) at several points and
resumed with `--resume auto` ends with weights bitwise equal to an uninterrupted run, with the same
best top-1, best.pt and metrics.csv.

Shuffled order, random augmentation (RandomResizedCrop + flip), two loader workers, fp32 on the CPU,
last.pt every optimizer step. Kill points are exact, not timed: tests/paused_train.py runs the real
train.py and halts it just after a save, halfway through writing last.pt, or inside a validation pass
(or waits there for the signal). A process killed between two saves leaves the same files whatever
instant it dies at, so these points stand for every moment of the run.
"""
from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tree, wait_for, write_pretrained_folder
from kill_and_resume import (ENV, STEPS_PER_EPOCH, TIMEOUT, assert_same_result, kill_at_pause, paused, run_to_end,
                             start, train_cmd)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return make_tree(tmp_path_factory.mktemp("resume") / "data", {"a": (12, 4), "b": (12, 4), "c": (12, 4)})


@pytest.fixture(scope="module")
def reference(data_root, tmp_path_factory) -> Path:
    """The uninterrupted run."""
    out = tmp_path_factory.mktemp("reference") / "run"
    run_to_end(train_cmd(data_root, out))
    return out


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_is_bitwise_equal(data_root, reference, tmp_path):
    run, marker = tmp_path / "run", tmp_path / "paused"
    # Killed in epoch 2 after its first step (step 5 of 8), loader workers mid-prefetch. Epoch 1 wrote
    # last.pt 5 times (after each step and at its end), so step 5's is the 6th.
    proc = start(train_cmd(data_root, run, script=paused(marker, f"after_save:{STEPS_PER_EPOCH + 2}")))
    kill_at_pause(proc, marker)
    assert proc.returncode == -signal.SIGKILL
    saved = torch.load(run / "last.pt", map_location="cpu", weights_only=True)
    assert (saved["epoch"], saved["step"], saved["batch_in_epoch"]) == (1, STEPS_PER_EPOCH + 1, 1)

    done = run_to_end(train_cmd(data_root, run, "--resume", "auto"))
    assert "resuming from" in done.stderr and "resumed at epoch 2, batch 1, optimizer step 5" in done.stderr
    assert_same_result(run, reference)


@pytest.mark.slow
def test_sigkill_early_during_a_save_and_during_validation(data_root, reference, tmp_path):
    """One run killed twice: halfway through writing its 2nd last.pt, then inside a validation pass."""
    run, marker = tmp_path / "run", tmp_path / "paused"

    proc = start(train_cmd(data_root, run, script=paused(marker, "save:2")))
    kill_at_pause(proc, marker)
    temps = list(run.glob(".last.pt.*.tmp"))
    assert temps, "the halted save should have left its half-written temp file"
    first = torch.load(run / "last.pt", map_location="cpu", weights_only=True)  # the previous file, whole
    assert (first["epoch"], first["step"]) == (0, 1)

    proc = start(train_cmd(data_root, run, "--resume", "auto", script=paused(marker, "validate:1")))
    kill_at_pause(proc, marker)
    during_val = torch.load(run / "last.pt", map_location="cpu", weights_only=True)
    # Epoch 1's training is done and saved, its validation is not.
    assert (during_val["epoch"], during_val["step"]) == (0, STEPS_PER_EPOCH)
    assert during_val["batch_in_epoch"] == STEPS_PER_EPOCH
    assert not (run / "metrics.csv").exists() and not (run / "best.pt").exists()

    run_to_end(train_cmd(data_root, run, "--resume", "auto"))
    assert not any(t.exists() for t in temps), "a later save removes the stale temp file"
    assert_same_result(run, reference)


@pytest.mark.slow
@pytest.mark.parametrize("sig, code, to_group", [
    (signal.SIGTERM, 143, True),   # a batch scheduler (Slurm) signals every process: loader workers too
    (signal.SIGINT, 130, True),    # Ctrl-C in a terminal reaches the whole foreground process group
    (signal.SIGTERM, 143, False),  # docker stop / kill PID: the main process only
])
def test_a_stop_signal_saves_exits_143_or_130_and_resumes_to_the_same_weights(data_root, reference, tmp_path,
                                                                              sig, code, to_group):
    run, marker = tmp_path / "run", tmp_path / "paused"
    # The signal arrives during step 3 (after last.pt holds step 2): step 3 finishes, is saved, the run stops.
    proc = start(train_cmd(data_root, run, script=paused(marker, "wait_signal:2")))
    wait_for(proc, marker.exists, "step 2")
    if to_group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    err = proc.communicate(timeout=TIMEOUT)[1]
    assert proc.returncode == code, err[-3000:]
    saved = torch.load(run / "last.pt", map_location="cpu", weights_only=True)
    assert (saved["step"], saved["batch_in_epoch"]) == (3, 3)
    assert f"received {sig.name}" in err and "(step 3); continue with: python " in err
    assert "DataLoader worker" not in err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps_completed"] == 3

    if sig == signal.SIGTERM:  # the same files after SIGINT; resuming after SIGTERM is enough
        # The stop message's command, run verbatim (no --config, no overrides retyped: last.pt holds the
        # config). Per-sample seeds do not depend on the workers: resuming with none gives the same weights too.
        command = re.search(r"continue with: (.+)$", err, re.M).group(1)
        extra = "" if to_group else " data.num_workers=0"
        done = subprocess.run(command + extra, shell=True, capture_output=True, text=True, timeout=TIMEOUT,
                              env=dict(ENV, PATH=f"{Path(sys.executable).parent}{os.pathsep}{ENV['PATH']}"))
        assert done.returncode == 0, done.stderr[-3000:]
        assert "resumed at epoch 1, batch 3, optimizer step 3" in done.stderr
        assert_same_result(run, reference)


# Every random piece of the recipes on at once: random erasing, mixup and CutMix (drawn per micro-batch from
# (seed, step, micro-batch)), with BCE, LAMB, a multistep schedule and a strided, warmed-up EMA.
RECIPE = ["train.mixup_alpha=0.4", "train.cutmix_alpha=1.0", "train.mix_prob=0.8", "data.random_erasing=0.5",
          "train.label_smoothing=0.1", "train.loss=bce", "optim.name=lamb", "optim.lr=0.01",
          "schedule.name=multistep", "schedule.milestones=[1.5]", "model.ema_decay=0.9", "model.ema_every_steps=2",
          "model.ema_warmup=true", "train.accum_steps=2", "data.num_workers=0"]


@pytest.mark.slow
def test_sigkill_with_erasing_mixup_and_cutmix_on_resumes_bitwise_equal(data_root, tmp_path):
    reference, run, marker = tmp_path / "reference", tmp_path / "run", tmp_path / "paused"
    done = run_to_end(train_cmd(data_root, reference, *RECIPE))
    assert "mixing: mixup alpha 0.4 / cutmix alpha 1" in done.stderr and "random erasing 0.5" in done.stderr
    # 4 batches of 8, accumulation 2: 2 optimizer steps per epoch; killed after step 3 (mid epoch 2)
    proc = start(train_cmd(data_root, run, *RECIPE, script=paused(marker, "after_save:4")))
    kill_at_pause(proc, marker)
    saved = torch.load(run / "last.pt", map_location="cpu", weights_only=True)
    assert (saved["epoch"], saved["step"], saved["batch_in_epoch"]) == (1, 3, 2)
    run_to_end(train_cmd(data_root, run, *RECIPE, "--resume", "auto"))
    a = torch.load(reference / "last.pt", map_location="cpu", weights_only=True)
    b = torch.load(run / "last.pt", map_location="cpu", weights_only=True)
    assert a["step"] == b["step"] == 4
    for key in ("model", "model_ema"):
        assert all(torch.equal(a[key][k], b[key][k]) for k in a[key]), key
    assert a["optimizer"]["param_groups"][0]["lr"] == b["optimizer"]["param_groups"][0]["lr"]
    with (run / "metrics.csv").open() as f, (reference / "metrics.csv").open() as g:
        assert [r["train_loss"] for r in csv.DictReader(f)] == [r["train_loss"] for r in csv.DictReader(g)]
@pytest.mark.slow
def test_sigkill_before_and_after_the_unfreeze_then_resume_is_bitwise_equal(data_root, tmp_path_factory, tmp_path):
    """Fine-tuning a pretrained folder with the backbone frozen in epoch 1 (classifier LR x5): killed in epoch 1
    (frozen), resumed and killed again in epoch 2 (unfrozen, backbone momentum started), resumed to the end:
    bitwise the uninterrupted run. A resume loads no pretrained weights (last.pt restores them)."""
    folder = tmp_path_factory.mktemp("pretrained") / "folder"
    write_pretrained_folder(folder)
    finetune = [f"model.name=local-dir:{folder}", "model.pretrained=true", "model.freeze=backbone",
                "model.unfreeze_epoch=1", "optim.head_lr_scale=5", "data.num_workers=0"]
    reference = tmp_path / "reference"
    run_to_end(train_cmd(data_root, reference, *finetune))
    run, marker = tmp_path / "run", tmp_path / "paused"

    kill_at_pause(start(train_cmd(data_root, run, *finetune, script=paused(marker, "after_save:2"))), marker)
    assert torch.load(run / "last.pt", map_location="cpu", weights_only=True)["step"] == 2
    # resumed at step 2, its saves: steps 3 and 4, epoch 1's end, step 5 (epoch 2's first, unfrozen)
    proc = start(train_cmd(data_root, run, *finetune, "--resume", "auto", script=paused(marker, "after_save:4")))
    kill_at_pause(proc, marker)
    saved = torch.load(run / "last.pt", map_location="cpu", weights_only=True)
    assert (saved["epoch"], saved["step"]) == (1, STEPS_PER_EPOCH + 1)
    assert len(saved["optimizer"]["state"]) > 2, "after the unfreeze the backbone has optimizer state"

    done = run_to_end(train_cmd(data_root, run, *finetune, "--resume", "auto"))
    assert "resuming, so nothing is loaded" in done.stderr and "tensors loaded from" not in done.stderr
    assert "backbone unfrozen" in done.stderr


@pytest.mark.slow
def test_a_stop_signal_during_a_validation_pass_blocked_in_a_read_saves_and_resumes(data_root, reference, tmp_path):
    """Every validation read blocks (loader workers stuck on a FIFO): SIGTERM still ends the run at once, with
    last.pt at the end of epoch 1's training; the resumed run validates that epoch again and ends equal."""
    run, marker = tmp_path / "run", tmp_path / "paused"
    proc = start(train_cmd(data_root, run, "checkpoint.every_steps=0", script=paused(marker, "block_read:1")))
    try:
        wait_for(proc, marker.exists, "a blocked validation read")
        proc.send_signal(signal.SIGTERM)  # the main process only: the workers stay blocked
        err = proc.communicate(timeout=TIMEOUT)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, err[-3000:]
    assert "stopping the validation pass" in err and "(step 4); continue with: python " in err
    saved = torch.load(run / "last.pt", map_location="cpu", weights_only=True)
    assert (saved["epoch"], saved["step"], saved["batch_in_epoch"]) == (0, STEPS_PER_EPOCH, STEPS_PER_EPOCH)
    assert not (run / "best.pt").exists() and not (run / "metrics.csv").exists()

    done = run_to_end(train_cmd(data_root, run, "checkpoint.every_steps=0", "--resume", "auto"))
    assert "resumed at epoch 1, batch 4, optimizer step 4" in done.stderr
    assert_same_result(run, reference)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_resume_right_after_sigkill_of_the_main_process_while_its_loader_workers_live(data_root, reference,
                                                                                      tmp_path):
    """kill -9 of the run alone (its persistent loader workers orphaned, still alive): the directory is free
    at once, and a resume started right away runs to the end (the flock was shared with the workers: 'in use
    by another run' naming the dead pid)."""
    from imgcls.training.rundir import open_run_dir

    run, marker = tmp_path / "run", tmp_path / "paused"
    proc = start(train_cmd(data_root, run, "data.persistent_workers=true",
                           script=paused(marker, f"after_save:{STEPS_PER_EPOCH + 2}")))
    wait_for(proc, marker.exists, "the pause point")
    workers = _children(proc.pid)
    assert len(workers) >= 2, workers
    os.kill(proc.pid, signal.SIGKILL)  # the main process only
    proc.wait(timeout=TIMEOUT)
    marker.unlink()
    try:
        alive = [w for w in workers if Path(f"/proc/{w}").exists()]
        lock = open_run_dir(run)  # taken while the orphans still hold the inherited descriptor
        assert lock is not None
        lock.release()
        assert alive, "the workers had already gone: the check proves nothing"
        done = run_to_end(train_cmd(data_root, run, "data.persistent_workers=true", "--resume", "auto"))
        assert "resumed at epoch 2, batch 1, optimizer step 5" in done.stderr
        assert_same_result(run, reference)
    finally:
        for w in workers:
            try:
                os.kill(w, signal.SIGKILL)
            except ProcessLookupError:
                pass
