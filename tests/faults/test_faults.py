"""Crash-safe saves, damaged or mismatched checkpoints on resume, and non-finite steps under each policy.

Training runs here are in-process (no loader workers) so faults can be injected with monkeypatch.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import HalfWriter, exit_code, make_cfg, make_tree
from rundir import atomic_files as checkpoint
from core.safe_load import load_checkpoint
from rundir.atomic_files import save_atomic
from core.config import ConfigError
from rundir.resume import resolve_resume
from training_run.trainer import Trainer, run

def finite(state_dict: dict) -> bool:
    return all(torch.isfinite(t).all() for t in state_dict.values() if t.is_floating_point())


# ---------------------------------------------------------------- save_atomic


@pytest.mark.parametrize("fail_at", ["write", "fsync", "replace"])
def test_an_interrupted_save_leaves_the_old_file_whole_and_no_temp_file(tmp_path, monkeypatch, fail_at):
    path = tmp_path / "last.pt"
    save_atomic({"step": 1, "w": torch.arange(1000.0)}, path)
    before = path.read_bytes()

    def boom(*args, **kwargs):
        raise OSError(f"injected failure in {fail_at}")

    if fail_at == "write":
        real_fdopen = os.fdopen

        def disk_full():
            raise OSError("injected failure halfway through the write (disk full)")

        monkeypatch.setattr(checkpoint.os, "fdopen",
                            lambda fd, *a, **k: HalfWriter(real_fdopen(fd, *a, **k), disk_full))
    elif fail_at == "replace":
        real_replace = os.replace
        monkeypatch.setattr(checkpoint.os, "replace",
                            lambda src, dst: boom() if Path(dst) == path else real_replace(src, dst))
    else:
        monkeypatch.setattr(checkpoint.os, fail_at, boom)
    with pytest.raises(OSError, match="injected"):
        save_atomic({"step": 2, "w": torch.zeros(5000)}, path, keep_previous=True)
    monkeypatch.undo()

    assert path.read_bytes() == before
    assert load_checkpoint(path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.prev.pt", "last.pt"]


def test_a_second_signal_during_a_save_waits_until_the_file_is_whole(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    received = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: received.append(("handler", path.exists())))
    real_fsync = os.fsync
    try:
        def fsync_then_signal(fd):
            if not received:
                os.kill(os.getpid(), signal.SIGTERM)  # arrives in the middle of the save
                received.append(("sent", path.exists()))
            real_fsync(fd)

        monkeypatch.setattr(checkpoint.os, "fsync", fsync_then_signal)
        save_atomic({"step": 3}, path)
    finally:
        signal.signal(signal.SIGTERM, previous)
    # The handler ran only after the save, when the new file was in place.
    assert received == [("sent", False), ("handler", True)]
    assert load_checkpoint(path)["step"] == 3


@pytest.mark.slow
def test_a_save_removes_temp_files_left_by_a_killed_save_and_only_those(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()  # a writer that is gone, as a SIGKILLed run is
    live = subprocess.Popen(["sleep", "60"])
    try:
        stale = tmp_path / f".last.pt.{checkpoint._OWNER}.{dead.pid}.ab12cd34.tmp"
        in_flight = tmp_path / f".last.pt.{checkpoint._OWNER}.{live.pid}.ab12cd34.tmp"
        elsewhere = tmp_path / f".last.pt.otherhost.{dead.pid}.ab12cd34.tmp"
        for path in (stale, in_flight, elsewhere):
            path.write_bytes(b"half a checkpoint")
        save_atomic({"step": 1}, tmp_path / "last.pt")
        assert not stale.exists()
        assert in_flight.exists() and elsewhere.exists()  # a live run's (or another machine's) temp file stays
    finally:
        live.kill()
        live.wait()


def test_saves_skip_the_zip_crcs_torch_never_checks_and_leave_torchs_setting_alone(tmp_path):
    import zipfile

    import torch.utils.serialization.config as serialization_config

    weights = torch.randn(2000, generator=torch.Generator().manual_seed(0))
    save_atomic({"step": 1, "w": weights}, tmp_path / "last.pt")
    assert torch.equal(torch.load(tmp_path / "last.pt", weights_only=True)["w"], weights)
    with zipfile.ZipFile(tmp_path / "last.pt") as archive:
        assert {info.CRC for info in archive.infolist()} == {0}
    assert serialization_config.save.compute_crc32 is True  # other torch.save calls keep the default
    torch.save({"w": weights}, tmp_path / "plain.pt")
    with zipfile.ZipFile(tmp_path / "plain.pt") as archive:
        assert 0 not in {info.CRC for info in archive.infolist() if info.file_size}


def test_checkpoints_follow_the_umask(tmp_path):
    previous = os.umask(0o022)
    try:
        save_atomic({"step": 1}, tmp_path / "last.pt")
        save_atomic({"step": 2}, tmp_path / "last.pt", keep_previous=True)
    finally:
        os.umask(previous)
    assert (tmp_path / "last.pt").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "last.prev.pt").stat().st_mode & 0o777 == 0o644


# ---------------------------------------------------------------- resume: damaged files, mismatched configs


def damage(path: Path, how: str) -> None:
    if how == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 3])
    elif how == "garbage":
        path.write_bytes(os.urandom(4096))
    else:
        path.write_bytes(b"")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated", "garbage", "empty"])
def test_resume_auto_falls_back_to_the_previous_state_with_a_warning(finished_run, tmp_path, how, caplog):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    damage(run_dir / "last.pt", how)
    with caplog.at_level("WARNING"):
        ckpt = resolve_resume("auto", run_dir)
    assert ckpt["step"] == 4  # last.prev.pt: the end of epoch 1
    assert any("damaged or truncated" in r.message and "trying the previous state" in r.message
               for r in caplog.records)
    damage(run_dir / "last.prev.pt", how)
    with pytest.raises(ConfigError, match="no loadable checkpoint"):
        resolve_resume("auto", run_dir)


@pytest.mark.slow
def test_resume_auto_with_a_damaged_last_pt_continues_the_run(faults_tree, finished_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    damage(run_dir / "last.pt", "truncated")
    assert run(make_cfg(faults_tree, run_dir), resume="auto") == 0
    log = (run_dir / "train.log").read_text()
    assert "trying the previous state" in log and "resuming from" in log and "last.prev.pt" in log
    # Epoch 2 was trained again from the end of epoch 1, and gives the same weights as the first time.
    redone, original = load_checkpoint(run_dir / "last.pt"), load_checkpoint(finished_run / "last.pt")
    assert redone["step"] == 8
    assert all(torch.equal(redone["model"][k], original["model"][k]) for k in original["model"])


@pytest.mark.slow
@pytest.mark.parametrize("how", ["missing", "truncated", "garbage"])
def test_explicit_resume_of_a_missing_or_damaged_file_exits_2(faults_tree, finished_run, tmp_path, how, capsys):
    target = tmp_path / "last.pt"
    if how != "missing":
        shutil.copy(finished_run / "last.pt", target)
        damage(target, how)
    cfg = make_cfg(faults_tree, tmp_path / "run")
    assert exit_code(lambda: run(cfg, resume=str(target))) == 2
    err = capsys.readouterr().err
    assert f"--resume {target}" in err
    assert ("does not exist" if how == "missing" else "damaged or truncated") in err
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "last.pt").exists()


@pytest.mark.slow
@pytest.mark.parametrize("change, key", [
    ({"model.name": "resnet10t"}, "model.name"),
    ({"train.batch_size": 4}, "train.batch_size"),
    ({"data.img_size": 24}, "data.img_size"),
    ({"data.scale": "[0.5,1.0]"}, "data.scale"),
    ({"optim.lr": 0.1, "train.seed": 3}, "optim.lr"),
])
def test_resume_with_a_config_that_changes_the_math_exits_2_listing_the_keys(faults_tree, finished_run, tmp_path,
                                                                               change, key, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    cfg = make_cfg(faults_tree, run_dir, **change)
    assert exit_code(lambda: run(cfg, resume="auto")) == 2
    err = capsys.readouterr().err
    assert "--resume: the run would not continue the same training" in err and "--finetune" in err
    for k in change:
        assert f"{k}:" in err
    assert key in err


@pytest.mark.slow
def test_resume_with_different_classes_exits_2(finished_run, tmp_path, capsys):
    other = make_tree(tmp_path / "other", {"a": (12, 3), "b": (12, 3), "c": (12, 3), "d": (12, 3)})
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    cfg = make_cfg(other, run_dir)
    assert exit_code(lambda: run(cfg, resume="auto")) == 2
    err = capsys.readouterr().err
    assert "classes: ['a', 'b', 'c'] -> ['a', 'b', 'c', 'd']" in err


@pytest.mark.slow
def test_resume_free_keys_may_change(faults_tree, finished_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    ckpt = load_checkpoint(run_dir / "last.prev.pt")
    save_atomic(ckpt, run_dir / "last.pt")  # back to the end of epoch 1
    # batch_size=auto on resume keeps the batch of the run instead of searching again.
    cfg = make_cfg(faults_tree, run_dir, **{"output.log_interval": 1, "checkpoint.every_steps": 3,
                                          "train.nonfinite": "skip", "train.batch_size": "auto",
                                          "output.overwrite": "true"})  # a resume deletes nothing
    assert run(cfg, resume="auto") == 0
    assert "resuming with the batch chosen before, 8 x accum 1" in (run_dir / "train.log").read_text()
    redone, original = load_checkpoint(run_dir / "last.pt"), load_checkpoint(finished_run / "last.pt")
    assert redone["step"] == 8
    assert all(torch.equal(redone["model"][k], original["model"][k]) for k in original["model"])


@pytest.mark.slow
def test_sigint_in_process_saves_returns_130_and_restores_the_handlers(faults_tree, tmp_path):
    out = tmp_path / "run"
    trainer = Trainer(make_cfg(faults_tree, out))
    trainer.setup()
    criterion, calls = trainer.step.criterion, [0]

    def interrupting(logits, targets):
        calls[0] += 1
        if calls[0] == 2:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during step 2
        return criterion(logits, targets)

    trainer.step.criterion = interrupting
    handler_before = signal.getsignal(signal.SIGINT)
    assert trainer.fit() == 130
    assert signal.getsignal(signal.SIGINT) is handler_before
    last = load_checkpoint(out / "last.pt")
    assert (last["step"], last["batch_in_epoch"]) == (2, 2)
    assert "received SIGINT" in (out / "train.log").read_text()


@pytest.mark.slow
def test_finetune_loads_the_weights_and_starts_a_fresh_schedule(faults_tree, finished_run, tmp_path):
    out = tmp_path / "tuned"
    cfg = make_cfg(faults_tree, out, **{"train.batch_size": 4, "train.epochs": 1, "optim.lr": 0.01})
    trainer = Trainer(cfg, finetune=str(finished_run / "best.pt"))
    trainer.setup()
    source = load_checkpoint(finished_run / "best.pt")["model"]
    now = trainer.model.state_dict()
    assert all(torch.equal(now[k], source[k]) for k in source)
    assert trainer.state.step == 0 and trainer.state.epoch == 0
    assert trainer.fit() == 0
    tuned = load_checkpoint(out / "last.pt")
    assert tuned["step"] == 9 and tuned["epoch"] == 1  # 36 images / batch 4: a new one-epoch schedule
    assert tuned["config"]["train"]["batch_size"] == 4
    assert "--finetune: " in (out / "train.log").read_text()


@pytest.mark.slow
def test_resume_of_a_best_pt_is_refused_and_points_to_finetune(faults_tree, finished_run, tmp_path, capsys):
    cfg = make_cfg(faults_tree, tmp_path / "run")
    assert exit_code(lambda: run(cfg, resume=str(finished_run / "best.pt"))) == 2
    assert "no training state" in capsys.readouterr().err


# ---------------------------------------------------------------- checkpoints hold plain data only


PLAIN = (int, float, str, bool, type(None), torch.Tensor)


def non_plain(obj, where="") -> list:
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in ([] if isinstance(k, (str, int)) else [f"{where} key {k!r}"])
                + non_plain(v, f"{where}.{k}")]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in non_plain(v, f"{where}[{i}]")]
    return [] if isinstance(obj, PLAIN) else [f"{where}: {type(obj).__name__}"]


@pytest.mark.slow
def test_checkpoints_hold_only_tensors_numbers_strings_lists_and_dicts(finished_run):
    for name in ("last.pt", "best.pt"):
        ckpt = torch.load(finished_run / name, map_location="cpu", weights_only=True)
        assert non_plain(ckpt) == [], name
    last = torch.load(finished_run / "last.pt", map_location="cpu", weights_only=True)
    assert isinstance(last["config"], dict) and isinstance(last["config"]["train"], dict)
    assert isinstance(last["rng"]["numpy"]["state"], torch.Tensor)
    assert set(last) >= {"model", "optimizer", "scheduler", "scaler", "rng", "train_state", "batch_in_epoch",
                         "world_size", "epoch", "step", "classes", "config", "preprocessing"}


# ---------------------------------------------------------------- non-finite loss


class NaNAt:
    """The criterion, returning NaN (with NaN gradients) on the given 1-based training steps."""

    def __init__(self, criterion, steps):
        self.criterion, self.steps, self.calls = criterion, set(steps), 0

    def __call__(self, logits, targets):
        self.calls += 1
        loss = self.criterion(logits, targets)
        return loss * float("nan") if self.calls in self.steps else loss


def nan_trainer(faults_tree, out, steps, snapshot_before=(), **extra):
    trainer = Trainer(make_cfg(faults_tree, out, **extra))
    trainer.setup()
    trainer.step.criterion = NaNAt(trainer.step.criterion, steps)
    snapshots, calls = {}, [0]

    def before_forward(module, args):  # the state before training step k's forward (accum_steps 1)
        if module.training:
            calls[0] += 1
            if calls[0] in snapshot_before:
                snapshots[calls[0]] = {k: v.detach().clone() for k, v in module.state_dict().items()}

    trainer.model.register_forward_pre_hook(before_forward)
    return trainer, snapshots


def test_nonfinite_stop_exits_1_naming_the_step_and_keeps_the_last_good_state(faults_tree, tmp_path):
    out = tmp_path / "run"
    trainer, before = nan_trainer(faults_tree, out, steps=[3], snapshot_before=[3], **{"checkpoint.every_steps": 2})
    assert trainer.fit() == 1
    log = (out / "train.log").read_text()
    assert "non-finite loss or gradients at optimizer step 3" in log
    last = load_checkpoint(out / "last.pt")
    assert last["step"] == 2  # the save at step 4 was refused; step 2 is the last good state
    assert finite(last["model"])
    assert all(torch.equal(last["model"][k], before[3][k]) for k in before[3])
    assert not (out / "best.pt").exists()


def test_nonfinite_stop_found_at_the_epoch_end_never_reaches_best_or_last(faults_tree, tmp_path):
    out = tmp_path / "run"
    trainer, _ = nan_trainer(faults_tree, out, steps=[6])
    assert trainer.fit() == 1
    assert "non-finite loss or gradients at optimizer step 6" in (out / "train.log").read_text()
    last, best = load_checkpoint(out / "last.pt"), load_checkpoint(out / "best.pt")
    assert (last["step"], best["step"]) == (4, 4)
    assert finite(last["model"]) and finite(best["model"])


@pytest.mark.slow
def test_nonfinite_stop_finds_finite_loss_with_inf_gradients_in_the_next_loss(faults_tree, tmp_path, monkeypatch):
    """Under `stop` the gradients are not checked on every step (their norm is a pass over all of them): step
    3's finite loss with inf gradients makes the weights, so step 4's loss, non-finite; the run stops there
    and last.pt keeps step 2. The norm runs only at the log lines (every 2nd step here)."""
    norms = []
    real_norm = torch.nn.utils.get_total_norm
    monkeypatch.setattr(torch.nn.utils, "get_total_norm", lambda *a, **k: norms.append(1) or real_norm(*a, **k))
    out = tmp_path / "run"
    trainer = Trainer(make_cfg(faults_tree, out, **{"checkpoint.every_steps": 2, "output.log_interval": 2}))
    trainer.setup()
    backward = [0]

    def inf_on_step_3(grad):
        backward[0] += 1
        return grad * float("inf") if backward[0] == 3 else grad

    next(trainer.model.parameters()).register_hook(inf_on_step_3)
    assert trainer.fit() == 1
    assert "non-finite loss or gradients at optimizer step 4" in (out / "train.log").read_text()
    last = load_checkpoint(out / "last.pt")
    assert last["step"] == 2 and finite(last["model"])
    assert len(norms) == 2  # the log lines of steps 2 and 4 only


def test_nonfinite_skip_skips_and_counts_the_step_and_trains_on(faults_tree, tmp_path):
    out = tmp_path / "run"
    trainer, before = nan_trainer(faults_tree, out, steps=[3], snapshot_before=[3, 4],
                                  **{"train.nonfinite": "skip"})
    assert trainer.fit() == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_steps"] == 1 and summary["steps_completed"] == 8
    assert "step 3: non-finite loss or gradients, update skipped (1 in a row)" in (out / "train.log").read_text()
    # The skipped step left the parameters as they were (BatchNorm statistics still moved in its forward).
    params = {name for name, _ in trainer.model.named_parameters()}
    assert all(torch.equal(before[3][k], before[4][k]) for k in params)
    last = load_checkpoint(out / "last.pt")
    assert finite(last["model"]) and last["step"] == 8


def test_nonfinite_skip_stops_after_n_in_a_row_and_counts_every_skipped_step(faults_tree, tmp_path):
    out = tmp_path / "run"
    trainer, _ = nan_trainer(faults_tree, out, steps=[2, 3], **{"train.nonfinite": "skip",
                                                               "train.max_nonfinite_in_row": 2,
                                                               "output.log_interval": 1})
    assert trainer.fit() == 1
    log = (out / "train.log").read_text()
    assert "2 optimizer steps in a row had non-finite loss or gradients (last at step 3)" in log
    summary = json.loads((out / "summary.json").read_text())
    # The summary agrees with the message: steps 1-3 ran, 2 and 3 were skipped.
    assert (summary["steps_completed"], summary["skipped_steps"]) == (3, 2)
    # The skipped steps' loss is NaN in the step lines, not the 0 that the finite-only sums would give.
    step_lines = [line for line in log.splitlines() if " step 2/8 " in line or " step 3/8 " in line]
    assert len(step_lines) == 2 and all("loss nan" in line and "(1 skipped)" in line for line in step_lines)
    assert "loss 0.0000" not in log


def file_bytes(run_dir: Path) -> dict:
    return {p.relative_to(run_dir): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("keep", ["all", "best_only"])
def test_a_new_run_in_a_directory_with_checkpoints_of_another_run_exits_2_and_changes_nothing(
        faults_tree, finished_run, tmp_path, capsys, keep):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    if keep == "best_only":
        (run_dir / "last.pt").unlink()
        (run_dir / "last.prev.pt").unlink()
    before = file_bytes(run_dir)
    # a dry run, the way a newcomer replaced a good best.pt; --resume auto without a last.pt is a new run too
    cfg = make_cfg(faults_tree, run_dir, **{"data.limit_train_batches": 1, "train.epochs": 1})
    assert exit_code(lambda: run(cfg, resume="auto" if keep == "best_only" else None)) == 2
    err = capsys.readouterr().err
    assert f"output.dir {run_dir} holds checkpoints of another run" in err
    assert "a new output.dir=" in err and "output.overwrite=true" in err
    if keep == "all":
        assert "(last.pt, last.prev.pt, best.pt)" in err and "--resume auto" in err
    else:
        assert "(best.pt)" in err and f"--finetune {run_dir / 'best.pt'}" in err and "--resume" not in err
    assert file_bytes(run_dir) == before  # refused before any work


@pytest.mark.slow
def test_overwrite_deletes_the_previous_runs_files_and_nothing_else(faults_tree, finished_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    (run_dir / "notes.txt").write_text("the user's own file")
    (run_dir / "tensorboard").mkdir()
    (run_dir / "tensorboard" / "events.out.tfevents.1.old.0").write_bytes(b"old events")
    assert run(make_cfg(faults_tree, run_dir, **{"train.epochs": 1, "output.overwrite": "true"})) == 0
    log = (run_dir / "train.log").read_text()
    assert log.index("output.overwrite=true: deleted the previous run's last.pt, last.prev.pt, best.pt, "
                     "summary.json, metrics.csv, config.yaml and 1 TensorBoard event file(s)") < log.index("data: ")
    assert log.count("effective batch") == 1  # the old run's log is gone
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert len(rows) == 2 and rows[1].startswith("1,")  # the header and this run's one epoch
    assert load_checkpoint(run_dir / "last.pt")["step"] == 4 and not (run_dir / "last.prev.pt").exists()
    assert json.loads((run_dir / "summary.json").read_text())["epochs_completed"] == 1
    assert (run_dir / "notes.txt").read_text() == "the user's own file"
    assert not (run_dir / "tensorboard" / "events.out.tfevents.1.old.0").exists()


@pytest.mark.slow
@pytest.mark.parametrize("role", ["distill.teacher", "--finetune", "model.weights"])
def test_overwrite_refuses_before_deleting_the_model_the_run_starts_from(faults_tree, finished_run, tmp_path,
                                                                        capsys, role):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    before = file_bytes(run_dir)
    best = str(run_dir / "best.pt")
    extra = {"distill.teacher": best} if role == "distill.teacher" else {"model.weights": best} \
        if role == "model.weights" else {}
    cfg = make_cfg(faults_tree, run_dir, **{"train.epochs": 1, "output.overwrite": "true", **extra})
    assert exit_code(lambda: run(cfg, finetune=best if role == "--finetune" else None)) == 2
    err = capsys.readouterr().err
    assert (f"output.dir (output.overwrite=true deletes its run files) {run_dir}: holds the {role} {best}, which "
            f"this command reads") in err, err[-2000:]
    assert file_bytes(run_dir) == before  # nothing deleted


@pytest.mark.slow
def test_resume_auto_of_a_finished_run_says_it_is_complete_and_how_to_train_further(faults_tree, finished_run,
                                                                                     tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    before = file_bytes(run_dir)
    assert run(make_cfg(faults_tree, run_dir), resume="auto") == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    line = (run_dir / "train.log").read_text().splitlines()[-1]
    assert f"the run in {run_dir} is complete (all 2 epochs done)" in line
    assert f"best epoch {summary['best_epoch']}: top1 {summary['best']['top1']:.2f} ({run_dir / 'best.pt'})" in line
    assert f"--finetune {run_dir / 'best.pt'} with a new output.dir" in line and "a larger train.epochs" in line
    after = file_bytes(run_dir)
    for name in ("last.pt", "last.prev.pt", "best.pt", "summary.json", "metrics.csv"):
        assert after[Path(name)] == before[Path(name)], name  # nothing trained, nothing rewritten
