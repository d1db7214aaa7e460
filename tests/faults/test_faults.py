"""Crash-safe saves, damaged or mismatched checkpoints on resume (other data, a damaged but loadable state),
one run per run directory, a full disk, and non-finite steps and validations under each policy.

Training runs here are in-process (no loader workers) so faults can be injected with monkeypatch.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import IN_PROCESS, REPO, HalfWriter, class_image, exit_code, make_cfg, make_tree, tiny_overrides, wait_for

import imgcls.training.checkpoints as checkpoint
from imgcls.config import ConfigError
from imgcls.core.safe_load import load_checkpoint
from imgcls.training.checkpoints import save_atomic
from imgcls.training.rundir import open_run_dir, resolve_resume
from imgcls.training.state import TrainState
from imgcls.training.trainer import Trainer, run


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


def test_the_final_last_pt_written_in_the_background_holds_the_weights_it_started_with(tmp_path, monkeypatch):
    """After the final epoch last.pt is written on a thread while the calibration loads best.pt's weights into
    the same model: the file holds the weights of the moment it was started, and a full disk reaches wait()."""
    import imgcls.training.checkpoints as checkpoints
    from imgcls.core.errors import DiskFullError
    from imgcls.training.checkpoints import Checkpointer, ModuleWeights, RandomState, RunRecord

    cfg = make_cfg(tmp_path / "data", tmp_path / "run")
    model = torch.nn.Linear(300, 200)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 300)).sum().backward()
    optimizer.step()
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    saver = Checkpointer(tmp_path, True, RunRecord(cfg, ["a", "b"], 1),
                         {"model": ModuleWeights(model), "optimizer": optimizer, "rng": RandomState()}, model)
    state = TrainState(epoch=2, step=7)
    pending = saver.start_last(state)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()                                           # what loading an earlier best.pt does
    assert saver.saved_state is None or saver.saved_state.step != 7   # not whole before wait()
    best = saver.start_best(state, {"top1": 50.0}, after=pending)        # lands after last.pt
    pending.wait()
    best.wait()
    assert load_checkpoint(tmp_path / "best.pt")["metrics"] == {"top1": 50.0}
    saved = load_checkpoint(tmp_path / "last.pt")
    assert all(torch.equal(saved["model"][k], trained[k]) for k in trained) and saved["step"] == 7
    assert saver.saved_state.step == 7

    def full(*args, **kwargs):
        raise DiskFullError("no space left on device (injected)")

    monkeypatch.setattr(checkpoints, "save_atomic", full)
    pending = saver.start_last(TrainState(epoch=3, step=9))
    with pytest.raises(DiskFullError, match="injected"):
        pending.wait()
    assert saver.saved_state.step == 7 and load_checkpoint(tmp_path / "last.pt")["step"] == 7


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


def copy_run(finished_run: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    return run_dir


def damage(path: Path, how: str) -> None:
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 3])
    elif how == "garbage":
        path.write_bytes(os.urandom(4096))
    else:
        path.write_bytes(b"")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["missing", "truncated", "garbage", "empty"])
def test_resume_auto_falls_back_to_the_previous_state_with_a_warning(finished_run, tmp_path, how, caplog):
    run_dir = copy_run(finished_run, tmp_path)
    damage(run_dir / "last.pt", how)
    with caplog.at_level("WARNING"):
        ckpt = resolve_resume("auto", run_dir)
    assert ckpt["step"] == 4  # last.prev.pt: the end of epoch 1
    warnings = [r.message for r in caplog.records if r.levelname == "WARNING"]
    said = "missing" if how == "missing" else "damaged"
    assert any(f"last.pt in {run_dir} is {said}" in m and "last.prev.pt (epoch 1, step 4)" in m for m in warnings)
    if how != "missing":
        assert any("damaged or truncated" in m and "trying the previous state" in m for m in warnings)
    damage(run_dir / "last.prev.pt", "empty")
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
def test_sigint_in_process_saves_returns_130_and_restores_the_handlers(trainer_of, faults_tree, tmp_path):
    out = tmp_path / "run"
    trainer = trainer_of(make_cfg(faults_tree, out))
    objective = trainer.run.step.objective
    criterion, calls = objective.criterion, [0]

    def interrupting(logits, targets):
        calls[0] += 1
        if calls[0] == 2:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during step 2
        return criterion(logits, targets)

    objective.criterion = interrupting
    handler_before = signal.getsignal(signal.SIGINT)
    assert trainer.fit() == 130
    assert signal.getsignal(signal.SIGINT) is handler_before
    last = load_checkpoint(out / "last.pt")
    assert (last["step"], last["batch_in_epoch"]) == (2, 2)
    assert "received SIGINT" in (out / "train.log").read_text()


@pytest.mark.slow
def test_finetune_loads_the_weights_and_starts_a_fresh_schedule(trainer_of, faults_tree, finished_run, tmp_path):
    out = tmp_path / "tuned"
    cfg = make_cfg(faults_tree, out, **{"train.batch_size": 4, "train.epochs": 1, "optim.lr": 0.01})
    trainer = trainer_of(cfg, finetune=str(finished_run / "best.pt"))
    source = load_checkpoint(finished_run / "best.pt")["model"]
    now = trainer.run.models.model.state_dict()
    assert all(torch.equal(now[k], source[k]) for k in source)
    assert trainer.run.state.step == 0 and trainer.run.state.epoch == 0
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


def nan_trainer(trainer_of, faults_tree, out, steps, snapshot_before=(), **extra):
    trainer = trainer_of(make_cfg(faults_tree, out, **extra))
    objective = trainer.run.step.objective
    objective.criterion = NaNAt(objective.criterion, steps)
    snapshots, calls = {}, [0]

    def before_forward(module, args):  # the state before training step k's forward (accum_steps 1)
        if module.training:
            calls[0] += 1
            if calls[0] in snapshot_before:
                snapshots[calls[0]] = {k: v.detach().clone() for k, v in module.state_dict().items()}

    trainer.run.models.model.register_forward_pre_hook(before_forward)
    return trainer, snapshots


def test_nonfinite_stop_exits_1_naming_the_step_and_keeps_the_last_good_state(trainer_of, faults_tree, tmp_path):
    out = tmp_path / "run"
    trainer, before = nan_trainer(trainer_of, faults_tree, out, steps=[3], snapshot_before=[3], **{"checkpoint.every_steps": 2})
    assert trainer.fit() == 1
    log = (out / "train.log").read_text()
    assert "non-finite loss or gradients at optimizer step 3" in log
    last = load_checkpoint(out / "last.pt")
    assert last["step"] == 2  # the save at step 4 was refused; step 2 is the last good state
    assert finite(last["model"])
    assert all(torch.equal(last["model"][k], before[3][k]) for k in before[3])
    assert not (out / "best.pt").exists()


def test_nonfinite_stop_found_at_the_epoch_end_never_reaches_best_or_last(trainer_of, faults_tree, tmp_path):
    out = tmp_path / "run"
    trainer, _ = nan_trainer(trainer_of, faults_tree, out, steps=[6])
    assert trainer.fit() == 1
    assert "non-finite loss or gradients at optimizer step 6" in (out / "train.log").read_text()
    last, best = load_checkpoint(out / "last.pt"), load_checkpoint(out / "best.pt")
    assert (last["step"], best["step"]) == (4, 4)
    assert finite(last["model"]) and finite(best["model"])


@pytest.mark.slow
def test_nonfinite_stop_finds_finite_loss_with_inf_gradients_in_the_next_loss(trainer_of, faults_tree, tmp_path, monkeypatch):
    """Under `stop` the gradients are not checked on every step (their norm is a pass over all of them): step
    3's finite loss with inf gradients makes the weights, so step 4's loss, non-finite; the run stops there
    and last.pt keeps step 2. The norm runs only at the log lines (every 2nd step here)."""
    norms = []
    real_norm = torch.nn.utils.get_total_norm
    monkeypatch.setattr(torch.nn.utils, "get_total_norm", lambda *a, **k: norms.append(1) or real_norm(*a, **k))
    out = tmp_path / "run"
    trainer = trainer_of(make_cfg(faults_tree, out, **{"checkpoint.every_steps": 2, "output.log_interval": 2}))
    backward = [0]

    def inf_on_step_3(grad):
        backward[0] += 1
        return grad * float("inf") if backward[0] == 3 else grad

    next(trainer.run.models.model.parameters()).register_hook(inf_on_step_3)
    assert trainer.fit() == 1
    assert "non-finite loss or gradients at optimizer step 4" in (out / "train.log").read_text()
    last = load_checkpoint(out / "last.pt")
    assert last["step"] == 2 and finite(last["model"])
    assert len(norms) == 2  # the log lines of steps 2 and 4 only


def test_nonfinite_skip_skips_and_counts_the_step_and_trains_on(trainer_of, faults_tree, tmp_path):
    out = tmp_path / "run"
    trainer, before = nan_trainer(trainer_of, faults_tree, out, steps=[3], snapshot_before=[3, 4],
                                  **{"train.nonfinite": "skip"})
    assert trainer.fit() == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_steps"] == 1 and summary["steps_completed"] == 8
    assert "step 3: non-finite loss or gradients, update skipped (1 in a row)" in (out / "train.log").read_text()
    # The skipped step left the parameters as they were (BatchNorm statistics still moved in its forward).
    params = {name for name, _ in trainer.run.models.model.named_parameters()}
    assert all(torch.equal(before[3][k], before[4][k]) for k in params)
    last = load_checkpoint(out / "last.pt")
    assert finite(last["model"]) and last["step"] == 8


def test_nonfinite_skip_stops_after_n_in_a_row_and_counts_every_skipped_step(trainer_of, faults_tree, tmp_path):
    out = tmp_path / "run"
    trainer, _ = nan_trainer(trainer_of, faults_tree, out, steps=[2, 3], **{"train.nonfinite": "skip",
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


# ---------------------------------------------------------------- resume on other data, from a damaged state


@pytest.mark.slow
def test_resume_on_a_different_data_set_with_the_same_classes_exits_2_naming_what_changed(faults_tree, finished_run,
                                                                                         tmp_path, capsys):
    smaller = make_tree(tmp_path / "smaller", {"a": 8, "b": 8, "c": 8}, splits=("train",))
    shutil.copytree(faults_tree / "val", smaller / "val")
    cfg = make_cfg(smaller, copy_run(finished_run, tmp_path))
    assert exit_code(lambda: run(cfg, resume="auto")) == 2
    err = capsys.readouterr().err
    assert "data (training split): 36 files -> 24 files (a: 12 -> 8, b: 12 -> 8, c: 12 -> 8)" in err
    assert "validation split" not in err and "Traceback" not in err


@pytest.mark.slow
def test_resume_notices_a_rewritten_file_and_allows_the_same_files_under_another_root(faults_tree, finished_run,
                                                                                     tmp_path, capsys):
    moved = tmp_path / "moved"
    shutil.copytree(faults_tree, moved)
    run_dir = copy_run(finished_run, tmp_path)
    # Back to the end of epoch 1, so that the resumed run has an epoch to train.
    checkpoint.save_atomic(load_checkpoint(run_dir / "last.prev.pt"), run_dir / "last.pt")
    class_image(0, size=(30, 30)).save(moved / "val" / "a" / "a_0000.png")  # same name, other size
    cfg = make_cfg(moved, run_dir)
    assert exit_code(lambda: run(cfg, resume="auto")) == 2
    assert "data (validation split): the same number of files (9), but other names or sizes" in capsys.readouterr().err
    shutil.copy(faults_tree / "val" / "a" / "a_0000.png", moved / "val" / "a" / "a_0000.png")
    assert run(make_cfg(moved, run_dir), resume="auto") == 0  # the same files under another data.root
    assert load_checkpoint(run_dir / "last.pt")["step"] == 8


@pytest.mark.slow
@pytest.mark.parametrize("damage, expected", [
    ("no rng", "'rng' is missing"),
    ("missing weights", "the checkpoint's 'model' does not load"),
    ("unknown train_state key", "'train_state' has unknown keys ['surprise']"),
    ("rng without numpy", "'rng' lacks numpy"),
])
def test_resume_from_a_damaged_but_loadable_checkpoint_exits_2_with_one_line(faults_tree, finished_run, tmp_path,
                                                                            capsys, damage, expected):
    run_dir = copy_run(finished_run, tmp_path)
    ckpt = load_checkpoint(run_dir / "last.pt")
    if damage == "no rng":
        del ckpt["rng"]
    elif damage == "missing weights":
        del ckpt["model"][next(iter(ckpt["model"]))]
    elif damage == "unknown train_state key":
        ckpt["train_state"]["surprise"] = 1
    else:
        del ckpt["rng"]["numpy"]
    checkpoint.save_atomic(ckpt, run_dir / "last.pt")
    cfg = make_cfg(faults_tree, run_dir)
    assert exit_code(lambda: run(cfg, resume="auto")) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1


@pytest.mark.slow
def test_resume_of_a_folder_says_it_is_a_folder(faults_tree, finished_run, tmp_path, capsys):
    cfg = make_cfg(faults_tree, tmp_path / "run")
    assert exit_code(lambda: run(cfg, resume=str(finished_run))) == 2
    err = capsys.readouterr().err
    assert "is a folder, not a checkpoint file" in err and "does not exist" not in err


@pytest.mark.slow
def test_finetune_from_another_architecture_exits_2_unless_asked_and_warns_with_the_share(faults_tree, finished_run,
                                                                                          tmp_path, capsys, trainer_of):
    source = str(finished_run / "best.pt")  # a test_resnet
    cfg = make_cfg(faults_tree, tmp_path / "run", **{"model.name": "resnet10t"})
    assert exit_code(lambda: run(cfg, finetune=source)) == 2
    err = capsys.readouterr().err
    assert f"--finetune {source}: only " in err and "model.name=test_resnet" in err and "--finetune-partial" in err
    trainer_of(make_cfg(faults_tree, tmp_path / "run2", **{"model.name": "resnet10t"}), finetune=source,
               finetune_partial=True)
    log = (tmp_path / "run2" / "train.log").read_text()
    assert "WARNING --finetune: 0.0% of the model's parameters loaded from" in log


@pytest.mark.slow
def test_resume_and_finetune_together_are_a_usage_error(faults_tree, finished_run, tmp_path, capsys):
    cfg = make_cfg(faults_tree, tmp_path / "run")
    assert exit_code(lambda: run(cfg, resume="auto", finetune=str(finished_run / "best.pt"))) == 2
    assert "exclude each other" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- one run per run directory, a full disk, a failing run


@pytest.mark.slow
def test_a_second_run_into_a_run_directory_in_use_exits_2_naming_the_holder(faults_tree, tmp_path, capsys):
    """Two runs 2 s apart into one directory: the second's temp-file clean-up deleted the first's checkpoint
    mid-save and both wrote train.log. Now the second exits 2 before touching anything."""
    out, marker = tmp_path / "run", tmp_path / "paused"
    first = subprocess.Popen([sys.executable, str(REPO / "tests" / "paused_train.py"), str(marker), "after_save:1",
                              "--", "--config", "base", *tiny_overrides(faults_tree, out, **IN_PROCESS)],
                             env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(first, marker.exists, "the first run's first save")
        log_before = (out / "train.log").read_text()
        files_before = sorted(p.name for p in out.iterdir())
        cfg = make_cfg(faults_tree, out)
        assert exit_code(lambda: run(cfg)) == 2
        err = capsys.readouterr().err
        assert f"is in use by another run (pid {first.pid} on " in err and "Traceback" not in err
        assert (out / "train.log").read_text() == log_before
        assert sorted(p.name for p in out.iterdir()) == files_before
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    lock = open_run_dir(out)  # the kernel let go of the dead run's lock
    assert lock is not None
    lock.release()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["a file", "under a file", "not writable"])
def test_an_unusable_output_dir_exits_2_before_any_work_naming_path_and_reason(faults_tree, tmp_path, capsys,
                                                                             monkeypatch, kind):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a folder")
    out = {"a file": blocker, "under a file": blocker / "run", "not writable": tmp_path / "ro"}[kind]
    if kind == "not writable":  # a read-only mount (root ignores permission bits, so it is simulated)
        import imgcls.training.rundir as run_lock

        def read_only(*args, **kwargs):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))

        monkeypatch.setattr(run_lock.tempfile, "mkstemp", read_only)
    cfg = make_cfg(faults_tree, out)
    assert exit_code(lambda: run(cfg)) == 2
    err = capsys.readouterr().err
    reason = {"a file": "a file of that name is in the way", "under a file": "a part of the path is a file",
              "not writable": "Read-only file system"}[kind]
    assert f"'output.dir' = {out}: cannot be used as the run directory ({reason})" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_a_full_disk_during_a_save_says_so_and_keeps_metrics_and_summary_with_the_last_checkpoint(
        faults_tree, tmp_path, monkeypatch, trainer_of):
    out = tmp_path / "run"
    trainer = trainer_of(make_cfg(faults_tree, out))
    real_fdopen, saves = os.fdopen, []

    def disk_full():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def fdopen(fd, *args, **kwargs):  # checkpoint writes: the 3rd (last.pt at the end of epoch 2) fills the disk
        saves.append(fd)
        f = real_fdopen(fd, *args, **kwargs)
        return HalfWriter(f, disk_full) if len(saves) == 3 else f

    monkeypatch.setattr(checkpoint.os, "fdopen", fdopen)
    assert trainer.fit() == 1
    log = (out / "train.log").read_text()
    assert f"no space left on device in {out} (needed ~" in log and "last.pt keeps its previous state" in log
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["epochs_completed"], summary["steps_completed"]) == (1, 4)
    rows = (out / "metrics.csv").read_text().splitlines()
    assert len(rows) == 2 and rows[1].startswith("1,")
    assert load_checkpoint(out / "last.pt")["step"] == 4
    assert not list(out.glob(".*.tmp"))


@pytest.mark.slow
def test_a_run_that_fails_after_it_started_logging_says_why_in_train_log(tmp_path, capsys, monkeypatch):
    def broken(self):
        raise RuntimeError("validation broke")

    monkeypatch.setattr(Trainer, "validate", broken)
    root = make_tree(tmp_path / "data", {"a": (8, 2), "b": (8, 2)})
    out = tmp_path / "run"
    assert exit_code(lambda: run(make_cfg(root, out, **{"train.epochs": 1}))) == 1
    assert "error: RuntimeError: validation broke" in capsys.readouterr().err
    assert (out / "train.log").read_text().splitlines()[-1].endswith("ERROR error: RuntimeError: validation broke")


# ---------------------------------------------------------------- a diverged validation is never best


def test_a_nonfinite_validation_is_never_best_and_counts_as_a_bad_epoch():
    state = TrainState()
    diverged = {"top1": 33.3, "top5": 100.0, "loss": float("nan"), "mean_class_acc": 33.3, "num_samples": 6}
    assert not state.record_validation(0, diverged, "top1", 0.0, patience=None)
    assert state.best_value is None and state.best_metrics == {} and state.bad_epochs == 1
    assert state.record_validation(1, dict(diverged, loss=1.0), "top1", 0.0, patience=None)
    assert state.best_epoch == 2


@pytest.mark.slow
@pytest.mark.parametrize("metric", ["loss", "top1"])
def test_a_run_whose_first_validation_is_nan_keeps_best_pt_for_the_finite_epoch(faults_tree, tmp_path, monkeypatch,
                                                                               metric):
    """`optim.lr=1000000`: epoch 1 logged `loss nan ... best` and best.pt held `summary.best.loss: null`."""
    import imgcls.training.trainer as trainer

    calls = []

    def first_pass_diverged(*args, **kwargs):
        sums, unreadable = real_evaluate(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            sums.loss_sum.fill_(float("nan"))
        return sums, unreadable

    real_evaluate = trainer.evaluate
    monkeypatch.setattr(trainer, "evaluate", first_pass_diverged)
    out = tmp_path / "run"
    assert trainer.run(make_cfg(faults_tree, out, **{"early_stop.metric": metric})) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best_epoch"] == 2 and summary["best"]["loss"] is not None
    assert torch.load(out / "best.pt", weights_only=True)["epoch"] == 2
    log = (out / "train.log").read_text()
    assert "epoch 1: validation is not finite (loss nan): the model has diverged, so this epoch is never best" in log
    assert "loss nan" in log and "(9 samples)" in log
    assert not [line for line in log.splitlines() if "epoch 1/2" in line and line.endswith("best")]
