"""train.threads (the CPU thread policy) and train.val_interval (validation every N epochs)."""
import csv
import json

import pytest
import torch

from conftest import make_tree, tiny_overrides
from core.config import load_config
from core.host import choose_threads, prefer_passive_omp_wait
from engine.schedule import validation_due
from engine.trainer import Trainer, run


@pytest.mark.parametrize("setting, cpus, env, expected", [
    ("auto", 2, {}, 2),                       # every usable core (their idle waits sleep)
    ("auto", 8, {"OMP_NUM_THREADS": "3"}, 3),  # torchrun (or the user) set it: kept
    ("auto", 8, {"OMP_NUM_THREADS": ""}, 8),   # empty: ignored
    (5, 2, {"OMP_NUM_THREADS": "1"}, 5),       # an explicit train.threads wins over everything
])
def test_thread_choice(setting, cpus, env, expected):
    threads, source = choose_threads(setting, cpus, env)
    assert threads == expected and source


def test_the_run_applies_and_logs_its_thread_count(tmp_path, tiny_tree, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    cfg = load_config("base", tiny_overrides(tiny_tree, tmp_path / "run", **{"train.threads": 1}))
    try:
        Trainer(cfg).setup()
        assert torch.get_num_threads() == 1
        assert "1 CPU thread(s) (train.threads)" in (tmp_path / "run" / "train.log").read_text()
    finally:
        torch.set_num_threads(before)


def test_threads_must_be_positive_or_auto():
    with pytest.raises(Exception, match="train.threads"):
        load_config("base", ["train.threads=0"])
    with pytest.raises(Exception, match="train.threads"):
        load_config("base", ["train.threads=many"])


def test_validation_due_every_interval_and_after_the_last_epoch():
    assert [e for e in range(1, 8) if validation_due(e, 7, 3)] == [3, 6, 7]
    assert [e for e in range(1, 4) if validation_due(e, 3, 1)] == [1, 2, 3]


def test_val_interval_validates_every_nth_epoch_and_early_stopping_counts_validations(tmp_path):
    data = make_tree(tmp_path / "data", {"a": (8, 3), "b": (8, 3)})
    out = tmp_path / "run"
    # lr 0 never improves after the first validation: patience 1 stops at the second validation (epoch 4)
    cfg = load_config("base", tiny_overrides(data, out, **{"train.epochs": 6, "train.val_interval": 2,
                                                          "optim.lr": 1e-12, "schedule.warmup_epochs": 0,
                                                          "early_stop.patience": 1, "early_stop.min_delta": 100}))
    assert run(cfg) == 0
    with (out / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows] == ["1", "2", "3", "4"]
    assert [bool(r["val_top1"]) for r in rows] == [False, True, False, True]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best_epoch"] == 2 and summary["stopped_early"] and summary["epochs_completed"] == 4
    assert torch.load(out / "best.pt", weights_only=True)["epoch"] == 2


def test_openmp_threads_sleep_by_default_but_a_users_policy_stays():
    env = {}
    prefer_passive_omp_wait(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    prefer_passive_omp_wait(env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_entry_scripts_set_the_wait_policy_before_torch_loads(tmp_path):
    import subprocess
    import sys

    from conftest import REPO

    probe = ("import os, sys; sys.argv = ['train.py', '--help']; from commands.cli import run_main; "
             "import atexit; atexit.register(lambda: print('policy', os.environ.get('OMP_WAIT_POLICY'), "
             "'torch' in sys.modules)); import train; run_main(train.main)")
    env = {k: v for k, v in __import__('os').environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, env=env).stdout
    assert "policy PASSIVE False" in out


def test_evaluation_takes_the_thread_count_validation_ran_with(monkeypatch):
    from core.host import usable_cpus
    from engine.device import eval_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert eval_threads("auto", 1) == 1
    assert eval_threads("auto", 10_000) == usable_cpus()   # never more than this machine has
    assert eval_threads("auto", None) == "auto"             # a checkpoint from before the record
    assert eval_threads(3, 1) == 3                          # an explicit setting wins
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert eval_threads("auto", 1) == "auto"                # and so does the environment
