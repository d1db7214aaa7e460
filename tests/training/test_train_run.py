"""End-to-end CPU runs of train.py: every run-directory artifact, loadable checkpoints, early stopping, dry run."""
import csv
import json
import re

import pytest
import timm
import torch
from conftest import TEST_MODEL, make_tree, run_script, tiny_overrides

from imgcls.config import Config, load_config
from imgcls.training.schedule import lr_factor

SUMMARY_BEST_KEYS = {"top1", "top5", "loss", "mean_class_acc", "num_samples"}


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return make_tree(tmp_path_factory.mktemp("data"), {"a": (16, 6), "b": (16, 6), "c": (16, 6)})


@pytest.fixture(scope="module")
def finished_run(data_root, tmp_path_factory):
    """One 2-epoch run: 48 training images, batch 8 -> 6 steps per epoch, 18 validation images."""
    run_dir = tmp_path_factory.mktemp("runs") / "run"
    result = run_script("train.py", "--config", "base", *tiny_overrides(data_root, run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result


def read_metrics_csv(run_dir):
    with (run_dir / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_run_writes_every_artifact(finished_run):
    run_dir, _ = finished_run
    for name in ("config.yaml", "last.pt", "best.pt", "summary.json", "metrics.csv", "train.log"):
        assert (run_dir / name).is_file(), name
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    # saves go through temp files that are renamed into place: none may be left behind
    leftovers = [p.name for p in run_dir.rglob("*") if p.name.endswith(".tmp") or
                 (p.name.startswith(".") and p.is_file())]
    assert leftovers == []


@pytest.mark.slow
def test_summary_holds_the_interface_keys(finished_run):
    run_dir, _ = finished_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epochs_completed"] == 2
    assert summary["stopped_early"] is False
    assert summary["best_epoch"] in (1, 2)
    assert set(summary["best"]) >= SUMMARY_BEST_KEYS
    assert summary["best"]["num_samples"] == 18
    assert 0 <= summary["best"]["top1"] <= 100 and summary["best"]["top5"] == pytest.approx(100.0)  # 3 classes
    assert summary["train_samples_per_s"] > 0
    assert summary["skipped_files"] == [] or summary["skipped_files"] == 0
    rows = read_metrics_csv(run_dir)
    best_row = rows[summary["best_epoch"] - 1]
    assert float(best_row["val_top1"]) == pytest.approx(summary["best"]["top1"], abs=1e-3)


@pytest.mark.slow
def test_metrics_csv_has_one_row_per_epoch(finished_run):
    run_dir, _ = finished_run
    rows = read_metrics_csv(run_dir)
    assert [int(r["epoch"]) for r in rows] == [1, 2]
    assert [int(r["step"]) for r in rows] == [6, 12]
    assert all(int(r["val_num_samples"]) == 18 for r in rows)
    assert all(float(r["train_loss"]) > 0 for r in rows)


@pytest.mark.slow
def test_metrics_csv_has_unix_line_endings(finished_run):
    run_dir, _ = finished_run
    assert b"\r" not in (run_dir / "metrics.csv").read_bytes()


@pytest.mark.slow
def test_without_a_terminal_the_log_has_step_and_validation_lines_and_ends_with_a_summary_line(finished_run):
    run_dir, result = finished_run
    log = (run_dir / "train.log").read_text().splitlines()
    assert re.findall(r"INFO step (\d+)/12 ", "\n".join(log)) == ["2", "4", "6", "8", "10", "12"]  # log_interval 2
    assert sum("INFO epoch 1/2: validating (3 batches)" in line for line in log) == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    last = log[-1]
    assert last == result.stderr.splitlines()[-1]  # the console's last line too
    assert (f"INFO done: 2 epoch(s), best epoch {summary['best_epoch']}: top1 {summary['best']['top1']:.2f} "
            f"({run_dir / 'best.pt'}) | summary {run_dir / 'summary.json'} | wall time ") in last
    wall = re.search(r"wall time (\d+)m(\d\d)s \(process; (\d+)m(\d\d)s from set-up\) \| (\d+) img/s$", last)
    assert wall and int(wall.group(5)) == round(summary["train_samples_per_s"])
    process_s, setup_s = (int(wall.group(i)) * 60 + int(wall.group(i + 1)) for i in (1, 3))
    assert process_s >= setup_s  # the process's time includes its imports


@pytest.mark.slow
def test_resolved_config_is_saved_and_reloads(finished_run, data_root):
    run_dir, _ = finished_run
    saved = load_config(str(run_dir / "config.yaml"))
    assert saved == load_config("base", tiny_overrides(data_root, run_dir))
    assert saved.model.name == TEST_MODEL and saved.data.img_size == 16
    assert saved.optim.momentum == Config().optim.momentum   # defaults are written out too


@pytest.mark.slow
def test_tensorboard_events_read_by_tensorboard(finished_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = finished_run
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/samples_per_s", "train/data_wait_frac",
            "val/top1", "val/top5", "val/loss", "val/mean_class_acc"} <= tags
    assert [e.step for e in events.Scalars("val/top1")] == [6, 12]
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6, 8, 10, 12]   # log_interval 2
    # the logged LR is the one each step ran with: 3 warmup steps, then cosine over the other 9 of 12
    peak = 0.05 * 8 / 256
    logged = [(e.step, e.value) for e in events.Scalars("train/lr")]
    assert [v for _, v in logged] == pytest.approx([peak * lr_factor(s - 1, 3, 12) for s, _ in logged], rel=1e-5)


@pytest.mark.slow
def test_startup_line_states_batch_steps_warmup_and_lr(finished_run):
    run_dir, result = finished_run
    # batch 8 x accum 1; 48 images -> 6 steps/epoch, 12 in all; 0.5 warmup epochs -> 3 steps;
    # peak lr 0.05 x 8 / 256 (linear scaling)
    line = next(l for l in (run_dir / "train.log").read_text().splitlines() if "effective batch" in l)
    assert re.search(r"effective batch 8\b", line)
    assert re.search(r"steps/epoch 6\b", line)
    assert re.search(r"total steps 12\b", line)
    assert re.search(r"warmup steps 3\b", line)
    peak = float(re.search(r"peak lr ([0-9.e+-]+)", line).group(1))
    assert peak == pytest.approx(0.05 * 8 / 256, rel=1e-4)
    assert "effective batch" in result.stderr


@pytest.mark.slow
def test_checkpoints_load_safely_and_into_fresh_models(finished_run):
    run_dir, _ = finished_run
    best = torch.load(run_dir / "best.pt", weights_only=True, map_location="cpu")
    assert best["classes"] == ["a", "b", "c"]
    assert best["config"]["model"]["name"] == TEST_MODEL
    assert best["preprocessing"]["img_size"] == 16
    assert {"resize", "mean", "std", "interpolation"} <= set(best["preprocessing"])
    assert best["epoch"] in (1, 2) and best["step"] == 6 * best["epoch"]
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in best["model"])

    model = timm.create_model(TEST_MODEL, num_classes=3)
    model.load_state_dict(best["model"], strict=True)
    # the way timm's validate.py loads a checkpoint
    fresh = timm.create_model(TEST_MODEL, num_classes=3)
    timm.models.load_checkpoint(fresh, str(run_dir / "best.pt"), strict=True)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name

    last = torch.load(run_dir / "last.pt", weights_only=True, map_location="cpu")
    assert last["epoch"] == 2 and last["step"] == 12
    assert {"optimizer", "scheduler", "scaler", "rng", "train_state"} <= set(last)
    timm.create_model(TEST_MODEL, num_classes=3).load_state_dict(last["model"], strict=True)


@pytest.mark.slow
def test_early_stopping_and_a_limited_dry_run(data_root, tmp_path):
    run_dir = tmp_path / "run"
    # top1 can never beat the first epoch by 1000 points: epoch 2 does not improve and patience is 1.
    # limit_train_batches: each epoch trains only 2 batches (2 optimizer steps) of the 6.
    result = run_script("train.py", "--config", "base", *tiny_overrides(data_root, run_dir, **{
        "train.epochs": 5, "optim.lr": 1e-6, "early_stop.patience": 1, "early_stop.min_delta": 1000,
        "data.limit_train_batches": 2}))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_early"] is True
    assert summary["epochs_completed"] == 2
    assert summary["best_epoch"] == 1
    rows = read_metrics_csv(run_dir)
    assert [int(r["epoch"]) for r in rows] == [1, 2]
    assert [int(r["step"]) for r in rows] == [2, 4]           # only the limited batches were trained
    assert torch.load(run_dir / "last.pt", weights_only=True)["step"] == 4
    assert torch.load(run_dir / "best.pt", weights_only=True)["epoch"] == 1
    assert "early stopping" in (run_dir / "train.log").read_text()
    line = next(l for l in (run_dir / "train.log").read_text().splitlines() if "effective batch" in l)
    assert re.search(r"steps/epoch 2\b", line) and re.search(r"total steps 10\b", line)


def test_an_output_dir_inside_a_scanned_data_folder_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    """Its plots would be listed as images of the class the next time (curves.png as a class-0 image)."""
    from conftest import run_train_in_process

    data = make_tree(tmp_path / "data", {"a": (2, 2), "b": (2, 2)})
    (tmp_path / "pool").mkdir()
    for name in ("a", "b"):  # one class-folder tree, split by data.val_fraction
        for image in (data / "train" / name).iterdir():
            (tmp_path / "pool" / name).mkdir(exist_ok=True)
            image.rename(tmp_path / "pool" / name / image.name)
    cases = [(data, data / "train" / "a" / "run", []), (data, f"{data}/val/../train/run", []),
             (tmp_path / "pool", tmp_path / "pool" / "b" / "run", ["data.val_fraction=0.5"])]
    for root, run_dir, extra in cases:
        code, err = run_train_in_process(monkeypatch, capsys, "--config", "base",
                                         *tiny_overrides(root, run_dir, **{"train.epochs": 1}), *extra)
        assert code == 2 and "lies inside the data folder" in err, err[-2000:]
    assert sorted(p.name for p in (data / "train").rglob("*") if p.is_dir()) == ["a", "b"]
    assert sorted(p.name for p in (tmp_path / "pool").rglob("*") if p.is_dir()) == ["a", "b"]
    from imgcls.data.settings import check_outside_data

    check_outside_data(load_config("base", tiny_overrides(data, tmp_path)), "output.dir", data / "runs")  # beside
