"""Hostile inputs found by an adversarial sweep: links and special files in the data tree, a run directory
two runs share or that cannot be used, resume on other data or from a damaged state, a full disk, config
values that no range test catches (NaN), loader workers on a failing exit, and the small things users hit.

Training runs are in-process (no loader workers) unless a test needs real processes.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import IN_PROCESS, REPO, HalfWriter, exit_code, make_cfg, class_image, make_tree, run_script, tiny_overrides, wait_for
from tasks.single_label_rows import format_predictions_table
from core.config import ConfigError, load_config, read_yaml
from core.safe_load import load_checkpoint
from data.file_list import FileListDataset, build_inference_loader, expand_inputs
from data.listing.folder import scan_split
from data.transforms import EvalTransform
from rundir import atomic_files as checkpoint
from rundir.resume import resolve_resume
from rundir.run_lock import open_run_dir
from training.schedule import plan_run
from training_run.trainer import Trainer, run

def copy_run(finished_run: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    return run_dir


# ---------------------------------------------------------------- links and special files in the tree

SCAN = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from data.listing.folder import scan_split
index = scan_split(sys.argv[1])
print(json.dumps({"counts": index.class_counts(), "paths": index.paths, "labels": index.labels,
                  "skipped": getattr(index, "skipped", [])}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("links", [("self",), ("up",), ("self", "up"), ("outside",)])
def test_links_in_a_class_folder_neither_repeat_nor_relabel_images(tmp_path, links):
    """`ln -s . a/self` counted class a 40 times over, `ln -s .. a/up` labelled b's files as a, and both
    together never finished. Each real folder is read once, never one outside the class folder; a link to
    a single file outside the class folder is left out and listed too (issue 28)."""
    root = make_tree(tmp_path / "data", {"a": 3, "b": 2}, splits=("train",))
    train = root / "train"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    class_image(1).save(elsewhere / "stranger.png")
    targets = {"self": ".", "up": "..", "outside": str(elsewhere)}
    for name in links:
        os.symlink(targets[name], train / "a" / name)
    os.symlink(elsewhere / "stranger.png", train / "b" / "linked.png")
    # In a subprocess: the unfixed scan never ends on ("self", "up").
    done = subprocess.run([sys.executable, "-c", SCAN, str(train)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert found["counts"] == [3, 2]
    assert any(entry.startswith(str(train / "b" / "linked.png")) for entry in found["skipped"])
    for path, label in zip(found["paths"], found["labels"]):
        assert Path(path).relative_to(train).parts[0] == "ab"[label]
        assert "/self/" not in path and "/up/" not in path and "/outside/" not in path
    for name in links:
        assert any(entry.startswith(str(train / "a" / name)) for entry in found["skipped"]), found["skipped"]
        assert str(train / "a" / name) in done.stderr  # the log says what was left out


def test_a_fifo_named_jpg_is_skipped_and_listed_in_scans_and_infer_inputs(tmp_path, caplog):
    root = make_tree(tmp_path / "data", {"a": 2, "b": 2}, splits=("val",))
    fifo = root / "val" / "a" / "pipe.jpg"
    os.mkfifo(fifo)
    with caplog.at_level(logging.WARNING):
        index = scan_split(root / "val")
        inputs = expand_inputs([str(root / "val")])
    assert str(fifo) not in index.paths and str(fifo) not in inputs and len(inputs) == 4
    assert f"{fifo} (a FIFO)" in index.skipped
    assert f"{fifo} (a FIFO)" in caplog.text
    # Named on the command line it is tried, and fails at once instead of waiting for a writer.
    item = FileListDataset([str(fifo)], EvalTransform(16, 0.875, "bilinear"), 16)[0]
    assert item[1] is False and "not a regular file (a FIFO)" in item[3]


@pytest.mark.slow
def test_a_run_with_a_fifo_in_the_validation_split_finishes_and_names_it(faults_tree, tmp_path):
    """The FIFO used to block validation for ever (and infer.py too)."""
    root = tmp_path / "data"
    shutil.copytree(faults_tree, root)
    fifo = root / "val" / "a" / "pipe.jpg"
    os.mkfifo(fifo)
    out = tmp_path / "run"
    done = run_script("train.py", "--config", "base", *tiny_overrides(root, out, **(IN_PROCESS | {
        "train.epochs": 1, "data.num_workers": 2})), timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{fifo} (a FIFO)" in (out / "train.log").read_text()
    assert json.loads((out / "summary.json").read_text())["best"]["num_samples"] == 9
    inferred = run_script("infer.py", str(root / "val"), str(fifo), "--checkpoint", str(out / "best.pt"),
                          "--num-workers", "0", timeout=240)
    assert inferred.returncode == 0, inferred.stderr[-3000:]
    assert "not a regular file (a FIFO)" in inferred.stdout


# ---------------------------------------------------------------- resume on other data

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


# ---------------------------------------------------------------- one run per run directory

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
        import rundir.run_lock as run_lock

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


# ---------------------------------------------------------------- damaged but loadable checkpoints

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
def test_resume_auto_from_last_prev_pt_warns_naming_the_file_and_its_step(finished_run, tmp_path, caplog):
    run_dir = copy_run(finished_run, tmp_path)
    (run_dir / "last.pt").unlink()
    with caplog.at_level(logging.WARNING):
        assert resolve_resume("auto", run_dir)["step"] == 4
    warning = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert any("last.pt" in m and "missing" in m and "last.prev.pt (epoch 1, step 4)" in m for m in warning), warning


@pytest.mark.slow
def test_resume_of_a_folder_says_it_is_a_folder(faults_tree, finished_run, tmp_path, capsys):
    cfg = make_cfg(faults_tree, tmp_path / "run")
    assert exit_code(lambda: run(cfg, resume=str(finished_run))) == 2
    err = capsys.readouterr().err
    assert "is a folder, not a checkpoint file" in err and "does not exist" not in err


# ---------------------------------------------------------------- --finetune from another architecture

@pytest.mark.slow
def test_finetune_from_another_architecture_exits_2_unless_asked_and_warns_with_the_share(faults_tree, finished_run,
                                                                                          tmp_path, capsys):
    source = str(finished_run / "best.pt")  # a test_resnet
    cfg = make_cfg(faults_tree, tmp_path / "run", **{"model.name": "resnet10t"})
    assert exit_code(lambda: run(cfg, finetune=source)) == 2
    err = capsys.readouterr().err
    assert f"--finetune {source}: only " in err and "model.name=test_resnet" in err and "--finetune-partial" in err
    trainer = Trainer(make_cfg(faults_tree, tmp_path / "run2", **{"model.name": "resnet10t"}), finetune=source,
                      finetune_partial=True)
    try:
        trainer.setup()
    finally:
        trainer.close()
    assert "WARNING --finetune: 0.0% of the model's parameters loaded from" in (tmp_path / "run2" / "train.log").read_text()


@pytest.mark.slow
def test_resume_and_finetune_together_are_a_usage_error(faults_tree, finished_run, tmp_path, capsys):
    cfg = make_cfg(faults_tree, tmp_path / "run")
    assert exit_code(lambda: run(cfg, resume="auto", finetune=str(finished_run / "best.pt"))) == 2
    assert "exclude each other" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- a full disk, a failing run's workers

@pytest.mark.slow
def test_a_full_disk_during_a_save_says_so_and_keeps_metrics_and_summary_with_the_last_checkpoint(
        faults_tree, tmp_path, monkeypatch):
    out = tmp_path / "run"
    trainer = Trainer(make_cfg(faults_tree, out))
    trainer.setup()
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
def test_a_failing_run_with_loader_workers_exits_at_once_without_a_worker_traceback(tmp_path):
    """Every file of a class junk (re-draws give up): the workers were left to interpreter exit, which
    waited out their 60 s SIGTERM grace and printed 'DataLoader worker ... killed by signal: Alarm clock'."""
    root = make_tree(tmp_path / "data", {"a": (8, 2), "b": (8, 2)})
    for path in (root / "train" / "b").iterdir():
        path.write_bytes(b"junk")
    out = tmp_path / "run"
    done = run_script("train.py", "--config", "base", *tiny_overrides(root, out, **(IN_PROCESS | {
        "data.num_workers": 2, "data.max_bad_fraction": 1.0})), timeout=240)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "20 files of class 'b' in a row could not be read" in done.stderr
    assert "killed by signal" not in done.stderr and "Alarm clock" not in done.stderr
    assert "Traceback" not in done.stderr  # the worker's traceback is not the message


@pytest.mark.slow
def test_a_validation_of_zero_samples_is_an_error_not_a_best(tmp_path, capsys):
    root = make_tree(tmp_path / "data", {"a": (8, 2), "b": (8, 2)})
    for path in (root / "val").rglob("*.png"):
        path.write_bytes(b"")
    out = tmp_path / "run"
    cfg = make_cfg(root, out, **{"data.max_bad_fraction": 1.0, "train.epochs": 1})
    assert exit_code(lambda: run(cfg)) == 1
    assert "validation evaluated no image" in capsys.readouterr().err
    assert not (out / "best.pt").exists()


@pytest.mark.slow
def test_a_run_that_fails_after_it_started_logging_says_why_in_train_log(tmp_path, capsys, monkeypatch):
    from training_run.trainer import Trainer

    def broken(self):
        raise RuntimeError("validation broke")

    monkeypatch.setattr(Trainer, "validate", broken)
    root = make_tree(tmp_path / "data", {"a": (8, 2), "b": (8, 2)})
    out = tmp_path / "run"
    assert exit_code(lambda: run(make_cfg(root, out, **{"train.epochs": 1}))) == 1
    assert "error: RuntimeError: validation broke" in capsys.readouterr().err
    assert (out / "train.log").read_text().splitlines()[-1].endswith("ERROR error: RuntimeError: validation broke")


# ---------------------------------------------------------------- config values

@pytest.mark.parametrize("override", [
    "data.max_bad_fraction=.nan", "optim.lr=.nan", "optim.lr=.inf", "optim.momentum=.nan",
    "train.clip_grad_norm=.nan", "optim.weight_decay=.inf", "data.mean=[.nan,0,0]", "schedule.warmup_epochs=.inf",
    "data.crop_pct=.nan", "data.crop_pct=1e-300", "optim.lr=1e308", "train.seed=99999999999999999999999",
    "data.std=[.inf,1,1]", "train.label_smoothing=.nan", "data.hflip=.nan", "schedule.min_lr=.nan",
    "early_stop.min_delta=.nan", "data.img_size=100000", "train.epochs=99999999999", "data.ratio=[1e-300,1]",
])
def test_nan_inf_and_extreme_config_values_are_refused_naming_the_key(override):
    with pytest.raises(ConfigError) as err:
        load_config("quickstart", [override])
    assert f"'{override.split('=')[0]}'" in str(err.value)


@pytest.mark.slow
def test_a_nan_value_exits_2_through_train_py_before_any_work(tmp_path):
    done = run_script("train.py", "--config", "quickstart", "optim.lr=.nan", f"output.dir={tmp_path / 'run'}")
    assert done.returncode == 2 and "'optim.lr' = nan" in done.stderr and "finite" in done.stderr
    assert not (tmp_path / "run").exists()


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\ndata:\n  mean: *a8\n")  # 10^9 values from 1 KB
    with pytest.raises(ConfigError, match="expands to more than"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="expands to more than"):
        load_config("quickstart", ["data.mean=&a [*a]"])  # an alias of itself nests without end


def test_a_yaml_typo_is_not_called_a_tag(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("train:\n  epochs: [3\n")
    with pytest.raises(ConfigError) as err:
        read_yaml(path)
    assert "is not valid YAML" in str(err.value) and "tags" not in str(err.value)


def test_accum_steps_larger_than_the_epoch_is_clamped_and_the_true_effective_batch_planned(caplog):
    cfg = load_config("quickstart", ["train.accum_steps=11", "train.batch_size=2", "optim.base_batch_size=2"])
    with caplog.at_level(logging.WARNING):
        plan = plan_run(cfg, 2, batches_in_split=4, world_size=1)
    assert (plan.accum_steps, plan.effective_batch, plan.steps_per_epoch) == (4, 8, 1)
    assert "train.accum_steps=11 is more than the 4 batches of an epoch" in caplog.text


@pytest.mark.slow
def test_a_split_with_one_class_exits_2(tmp_path, capsys):
    root = make_tree(tmp_path / "data", {"only": (8, 2)})
    cfg = make_cfg(root, tmp_path / "run")
    assert exit_code(lambda: run(cfg)) == 2
    assert "needs at least two classes" in capsys.readouterr().err


# ---------------------------------------------------------------- eval.py / infer.py outputs

@pytest.mark.slow
def test_output_files_that_are_folders_are_refused_before_any_work(tmp_path, capsys):
    import eval as eval_script
    import infer as infer_script

    folder = tmp_path / "preds.csv"
    folder.mkdir()
    missing_ckpt = str(tmp_path / "no.pt")  # checked later: the output check comes first
    assert exit_code(lambda: infer_script.main([str(tmp_path), "--checkpoint", missing_ckpt,
                                                "--output", str(folder)])) == 2
    assert f"--output {folder}: is a folder" in capsys.readouterr().err
    assert exit_code(lambda: eval_script.main(["--checkpoint", missing_ckpt, "--json", str(tmp_path)])) == 2
    assert f"--json {tmp_path}: is a folder" in capsys.readouterr().err


def test_infer_quotes_names_with_newlines_and_clamps_the_batch_to_the_inputs(tmp_path):
    rows = [{"path": "odd\nname.jpg", "label": "a", "prob": 0.5, "error": None},
            {"path": "plain.jpg", "label": None, "prob": None, "error": "empty file"}]
    table = format_predictions_table(rows).splitlines()
    assert len(table) == 3 and table[1].startswith("'odd\\nname.jpg'")
    paths = []
    for i in range(3):
        class_image(i).save(tmp_path / f"{i}.png")
        paths.append(str(tmp_path / f"{i}.png"))
    loader = build_inference_loader(FileListDataset(paths, EvalTransform(16, 0.875, "bilinear"), 16), 4096, 0, False)
    images, valid, indices, _ = next(iter(loader))
    assert images.shape[0] == 3 and valid.tolist() == [True] * 3
