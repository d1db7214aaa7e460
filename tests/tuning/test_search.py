"""tune.py --search: the space refused before any work (exit 2, naming the key), a study that prunes on the
validation metric and writes trials.csv, best.yaml and the plots, and a study killed (SIGKILL) during a trial
that the same command finishes with exactly the asked trials, the interrupted one resumed from its last.pt to
the weights train.py gives the same config and seed."""
from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, make_tree, run_script, tiny_overrides, wait_for

from imgcls.config import load_config
from imgcls.core.errors import ConfigError
from imgcls.tuning.search import load_space

SPACE_ERRORS = {  # SPACE.yaml text -> what the message must name
    "optim.lrr: {low: 0.01, high: 0.1}": "optim.lrr",
    "optim.lr: {low: 0.1, high: 0.01}": "low 0.1 must be below high 0.01",
    "optim.lr: {low: 0.0, high: 0.1}": "optim.lr' = 0.0 gives no valid config",
    "optim.lr: {low: 0.0, high: 0.1, log: true}": "log: true needs low > 0",
    "optim.lr: {low: 0.001, high: 0.1, log: true, step: 0.001}": "log or step, not both",
    "optim.lr: {low: 0.01, high: 0.1, scale: log}": "unknown field(s) scale",
    "optim.lr: 0.1": "a fixed value belongs in the config",
    "train.epochs: {low: 1.5, high: 3}": "takes whole numbers",
    "train.epochs: {low: 1, high: 4, step: 2}": "not a multiple of step",
    "train.amp: [none, fp8]": "'train.amp' = 'fp8' gives no valid config",
    "train.amp: {low: 0, high: 1}": "takes no number",
    "model.name: []": "the list of choices is empty",
    "train.label_smoothing: [0.1, 0.1]": "a choice is repeated",
    "output.dir: [a, b]": "cannot be searched",
}


@pytest.mark.parametrize("text,named", SPACE_ERRORS.items())
def test_space_mistakes_are_refused_naming_the_key(tmp_path, text, named):
    space = tmp_path / "space.yaml"
    space.write_text(text + "\n")
    with pytest.raises(ConfigError, match="--search") as info:
        load_space(str(space), "base", [])
    assert named in str(info.value)


def test_the_space_is_checked_against_the_config_with_its_overrides(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("model.unfreeze_epoch: [1, 2]\noptim.lr: {low: 0.001, high: 1.0, log: true}\n"
                     "data.scale: [[0.08, 1.0], [0.5, 1.0]]\ntrain.epochs: {low: 2, high: 6, step: 2}\n")
    with pytest.raises(ConfigError, match="model.unfreeze_epoch"):  # needs model.freeze=backbone
        load_space(str(space), "base", [])
    dims = load_space(str(space), "base", ["model.freeze=backbone"])
    assert [(d.key, d.integer, d.log) for d in dims] == [("model.unfreeze_epoch", False, False),
                                                          ("optim.lr", False, True), ("data.scale", False, False),
                                                          ("train.epochs", True, False)]


def test_a_bad_space_exits_2_before_any_work(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("optim.lr: {low: 0.01, high: 0.1}\ntrain.label_smothing: [0.0, 0.1]\n")
    study = tmp_path / "study"
    result = run_script("tune.py", "--config", "base", "--search", str(space), "--trials", "2", "--study",
                        str(study), f"data.root={tmp_path}")
    assert result.returncode == 2, result.stderr
    assert "unknown config key 'train.label_smothing'; did you mean 'train.label_smoothing'" in result.stderr
    assert not study.exists()
    result = run_script("tune.py", "--config", "base", "--search", str(space), "--study", str(study))
    assert result.returncode == 2 and "--search needs --trials N" in result.stderr


def search_overrides(data: Path, **extra) -> list[str]:
    """The tiny training of conftest, without an output.dir (each trial gets its own)."""
    values = {"optim.lr_scaling": "none", "schedule.warmup_epochs": 0, "output.tensorboard": "false", **extra}
    return [o for o in tiny_overrides(data, Path("unused"), **values) if not o.startswith("output.dir=")]


def study_trials(study: Path):
    import optuna

    return optuna.load_study(study_name="search", storage=f"sqlite:///{study / 'study.db'}").get_trials()


def read_rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_a_study_prunes_on_the_validation_metric_and_writes_its_results(tmp_path):
    """Three enqueued trials (Optuna's enqueue_trial, as a user would seed a study with known settings): two that
    learn, then one at an LR of 1e-7 that does not; after the first two finished, the median pruner stops the
    third after epoch 1, on the validation loss (the declared metric here, lower is better)."""
    import optuna

    data = make_tree(tmp_path / "data", {"a": (12, 4), "b": (12, 4), "c": (12, 4)})
    space, study = tmp_path / "space.yaml", tmp_path / "study"
    space.write_text("optim.lr: [0.05, 1.0e-7]\ntrain.label_smoothing: {low: 0.0, high: 0.2}\n")
    study.mkdir()
    seeded = optuna.create_study(study_name="search", storage=f"sqlite:///{study / 'study.db'}", direction="minimize")
    for lr, smoothing in ((0.05, 0.1), (0.05, 0.0), (1e-7, 0.0)):
        seeded.enqueue_trial({"optim.lr": lr, "train.label_smoothing": smoothing})
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = search_overrides(data, **{"early_stop.metric": "loss", "tracking.backend": "mlflow",
                                          "tracking.uri": store, "tracking.experiment": "search"})
    result = run_script("tune.py", "--config", "base", "--search", str(space), "--trials", "3", "--study",
                        str(study), *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_rows(study / "trials.csv")
    assert [(r["number"], r["state"], r["optim.lr"]) for r in rows] == [("0", "COMPLETE", "0.05"),
                                                                        ("1", "COMPLETE", "0.05"),
                                                                        ("2", "PRUNED", "1e-07")]
    assert all(float(r["wall_time_s"]) > 0 for r in rows)
    assert "pruned by the median pruner after epoch 1" in (study / "trials" / "2" / "PRUNED").read_text()
    assert [r["epoch"] for r in read_rows(study / "trials" / "2" / "metrics.csv")] == ["1"]
    assert not (study / "trials" / "0" / "PRUNED").exists()
    # the value of a trial is its best.pt's validation loss
    best = min(rows[:2], key=lambda r: float(r["value"]))
    assert "best trial " + best["number"] in result.stderr and "2 complete" in result.stderr
    for name in ("history.png", "slice.png", "importances.png"):
        assert (study / name).stat().st_size > 1000, name
    # --keep best: only the best trial keeps its checkpoints
    kept = [n for n in "012" if (study / "trials" / n / "last.pt").exists()]
    assert kept == [best["number"]]
    assert (study / "trials" / "2" / "metrics.csv").exists() and (study / "trials" / "2" / "train.log").exists()
    # best.yaml: the best trial's config as train.py resolved it, in a new output.dir
    trial_cfg = load_config(str(study / "trials" / best["number"] / "config.yaml")).to_dict()
    best_cfg = load_config(str(study / "best.yaml")).to_dict()
    assert best_cfg["output"].pop("dir") == str(study / "best")
    trial_cfg["output"].pop("dir")
    assert best_cfg == trial_cfg
    assert_trials_nested_under_the_study_run(store, rows)


def assert_trials_nested_under_the_study_run(store: str, rows: list[dict]) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("search").experiment_id])
    parent = next(r for r in runs if r.info.run_name == "search-study")
    children = sorted(r.info.run_name for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id)
    assert children == ["0", "1", "2"] and len(runs) == 4
    assert parent.info.status == "FINISHED"
    history = client.get_metric_history(parent.info.run_id, "search/pruned")
    assert sorted((m.step, m.value) for m in history) == [(0, 0.0), (1, 0.0), (2, 1.0)]
    values = {m.step: m.value for m in client.get_metric_history(parent.info.run_id, "search/value")}
    assert values == pytest.approx({int(r["number"]): float(r["value"]) for r in rows}, rel=1e-5)
    assert {"trials.csv", "best.yaml", "history.png"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}


@pytest.mark.slow
def test_a_study_killed_during_a_trial_continues_to_exactly_the_asked_trials(tmp_path):
    """SIGKILL to tune.py and its trial (the process group, as a node failure) while trial 1 trains; the same
    command again resumes trial 1 from its last.pt (not a new trial), ends with 2 complete trials, and trial 1's
    weights equal train.py's for the same config, values and seed."""
    data = make_tree(tmp_path / "data", {"a": (8, 4), "b": (8, 4), "c": (8, 4)})
    space, study = tmp_path / "space.yaml", tmp_path / "study"
    space.write_text("optim.lr: {low: 0.01, high: 0.1, log: true}\n")
    overrides = search_overrides(data, **{"checkpoint.every_steps": 1})
    command = [sys.executable, str(REPO / "tune.py"), "--config", "base", "--search", str(space), "--trials", "2",
               "--study", str(study), "--keep", "all", *overrides]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    wait_for(proc, (study / "trials" / "1" / "last.pt").exists, "trial 1's first last.pt")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert [t.state.name for t in study_trials(study)] == ["COMPLETE", "RUNNING"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trial 1 was interrupted; continuing it from its last.pt" in done.stderr
    trials = study_trials(study)
    assert [(t.number, t.state.name) for t in trials] == [(0, "COMPLETE"), (1, "COMPLETE")]
    assert "--resume auto: resuming from" in (study / "trials" / "1" / "output.log").read_text()
    assert [r["epoch"] for r in read_rows(study / "trials" / "1" / "metrics.csv")] == ["1", "2"]
    assert len(read_rows(study / "trials.csv")) == 2
    # the same config and seed through train.py, uninterrupted
    reference = tmp_path / "reference"
    result = run_script("train.py", "--config", "base", *overrides, f"optim.lr={trials[1].params['optim.lr']!r}",
                        f"output.dir={reference}")
    assert result.returncode == 0, result.stderr[-3000:]
    a = torch.load(reference / "last.pt", map_location="cpu", weights_only=True)
    b = torch.load(study / "trials" / "1" / "last.pt", map_location="cpu", weights_only=True)
    assert (a["epoch"], a["step"]) == (b["epoch"], b["step"]) == (2, 6)
    different = [k for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])]
    assert not different, f"the resumed trial's weights differ from train.py's in {different[:5]}"


def test_a_continued_study_draws_new_values_not_the_first_ones_again(tmp_path):
    """The sampler is seeded by train.seed; a study continued by a new process must not draw the values of its
    first trials again (a seed restarted at each run would)."""
    from imgcls.tuning.search import SearchPlan, open_study, suggest

    space = tmp_path / "space.yaml"
    space.write_text("optim.lr: {low: 0.001, high: 1.0, log: true}\n")
    plan = SearchPlan(config="base", overrides=[], dims=load_space(str(space), "base", []), trials=2,
                      study_dir=tmp_path, metric="top1", higher_is_better=True, epochs=2, seed=0)
    drawn = []
    for _ in range(2):  # two processes, one trial each
        study = open_study(plan)
        trial = study.ask()
        drawn.append(suggest(trial, plan.dims)["optim.lr"])
        study.tell(trial, 50.0)
    assert drawn[0] != drawn[1]
    plan.overrides = ["train.label_smoothing=0.1"]
    with pytest.raises(ConfigError, match="holds a study of another search"):
        open_study(plan)


@pytest.mark.slow
def test_a_trial_runs_under_torchrun_with_nproc_per_node(tmp_path):
    data = make_tree(tmp_path / "data", {"a": (8, 4), "b": (8, 4)})
    space, study = tmp_path / "space.yaml", tmp_path / "study"
    space.write_text("train.label_smoothing: [0.1]\n")
    result = run_script("tune.py", "--config", "base", "--search", str(space), "--trials", "1", "--study", str(study),
                        "--nproc-per-node", "2", *search_overrides(data, **{"train.epochs": 1, "train.batch_size": 4}))
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["state"] for r in read_rows(study / "trials.csv")] == ["COMPLETE"]
    assert "2 process(es)" in (study / "trials" / "0" / "train.log").read_text()


def test_a_trial_stopped_by_a_signal_stays_running_and_is_continued_not_replaced(tmp_path, monkeypatch):
    """The trial's run saved and exited 143 (a SIGTERM): the study stops with 143 and leaves the trial RUNNING;
    the next run takes it up with the same command (--resume auto), reports only its new epochs, and counts it
    once. (The runs are stand-ins here: the slow tests train for real.)"""
    import json

    import imgcls.tuning.search as search_study
    from imgcls.tuning.search import TrialOutcome

    commands = []

    def run_trial(command, run_dir, column, on_epoch, stop, env=None):
        commands.append(command)
        run_dir.mkdir(parents=True, exist_ok=True)
        assert not on_epoch(1, 50.0)
        if len(commands) == 1:
            return TrialOutcome(exit_code=143, seconds=1.0)
        assert not on_epoch(2, 60.0)
        (run_dir / "summary.json").write_text(json.dumps({"best": {"top1": 60.0}}))
        return TrialOutcome(exit_code=0, seconds=2.0)

    monkeypatch.setattr(search_study, "run_trial", run_trial)
    space = tmp_path / "space.yaml"
    space.write_text("optim.lr: {low: 0.001, high: 1.0, log: true}\n")
    plan = search_study.SearchPlan(config="base", overrides=[], dims=load_space(str(space), "base", []), trials=1,
                                   study_dir=tmp_path / "study", metric="top1", higher_is_better=True, epochs=2,
                                   seed=0, keep="all", launcher=("train.py",))
    assert search_study.run_search(plan) == 143
    assert [t.state.name for t in study_trials(plan.study_dir)] == ["RUNNING"]
    assert search_study.run_search(plan) == 0
    (trial,) = study_trials(plan.study_dir)
    assert (trial.state.name, trial.value, trial.intermediate_values) == ("COMPLETE", 60.0, {1: 50.0, 2: 60.0})
    assert trial.user_attrs["wall_s"] == 3.0
    assert commands[0] == commands[1] and commands[0][-2:] == ["--resume", "auto"]
    assert f"output.dir={plan.study_dir / 'trials' / '0'}" in commands[0]


def stand_in_trials(monkeypatch):
    """Trials that finish at once with a value (the slow tests train for real)."""
    import json

    import imgcls.tuning.search as search_study
    from imgcls.tuning.search import TrialOutcome

    def run_trial(command, run_dir, column, on_epoch, stop, env=None):
        run_dir.mkdir(parents=True, exist_ok=True)
        assert not on_epoch(1, 50.0)
        (run_dir / "summary.json").write_text(json.dumps({"best": {"top1": 50.0}}))
        return TrialOutcome(exit_code=0, seconds=1.0)

    monkeypatch.setattr(search_study, "run_trial", run_trial)


def tune_run(monkeypatch, *argv) -> int:
    from conftest import exit_code

    import tune

    monkeypatch.setattr(sys, "argv", ["tune.py", *argv])
    return exit_code(tune.main)


def test_a_study_continued_after_its_config_file_changed_is_refused(tmp_path, monkeypatch, capsys):
    stand_in_trials(monkeypatch)
    data = make_tree(tmp_path / "data", {"a": (2, 2), "b": (2, 2)})
    config, space, study = tmp_path / "my.yaml", tmp_path / "space.yaml", tmp_path / "E"
    config.write_text("train:\n  label_smoothing: 0.0\n")
    space.write_text("optim.lr: {low: 0.001, high: 1.0, log: true}\n")
    command = ["--config", str(config), "--search", str(space), "--study", str(study), *search_overrides(data)]
    assert tune_run(monkeypatch, *command, "--trials", "1") == 0
    best = (study / "best.yaml").read_text()
    config.write_text("train:\n  label_smoothing: 0.3\n")
    capsys.readouterr()
    assert tune_run(monkeypatch, *command, "--trials", "2") == 2
    assert "train.label_smoothing: 0.0 -> 0.3" in capsys.readouterr().err
    assert len(study_trials(study)) == 1 and (study / "best.yaml").read_text() == best


def test_a_study_folder_holding_its_inputs_or_inside_the_data_is_refused(tmp_path, capsys, monkeypatch):
    data = make_tree(tmp_path / "data", {"a": (2, 2), "b": (2, 2)})
    space = tmp_path / "space.yaml"
    space.write_text("optim.lr: {low: 0.001, high: 1.0, log: true}\n")
    for name in ("N1", "N2", "N3"):
        (tmp_path / name).mkdir()
    (tmp_path / "N1" / "best.yaml").write_text("train:\n  label_smoothing: 0.1\n")
    (tmp_path / "N2" / "best.yaml").write_text(space.read_text())
    (tmp_path / "N3" / "trials.csv").write_text(space.read_text())
    os.symlink(tmp_path / "N1", tmp_path / "link")
    cases = [(tmp_path / "N1" / "best.yaml", space, tmp_path / "N1", "--config file"),
             (tmp_path / "N1" / "best.yaml", space, tmp_path / "link", "--config file"),
             (tmp_path / "N1" / "best.yaml", space, f"{tmp_path}/N2/../N1", "--config file"),
             ("base", tmp_path / "N2" / "best.yaml", tmp_path / "N2", "--search space"),
             ("base", tmp_path / "N3" / "trials.csv", tmp_path / "N3", "--search space"),
             ("base", space, data / "train" / "a" / "st", "data folder"),
             ("base", space, f"{data}/val/../train/b/st", "data folder")]
    before = {p: p.read_text() for p in tmp_path.glob("N*/*")}
    for config, search, study, role in cases:
        capsys.readouterr()
        assert tune_run(monkeypatch, "--config", str(config), "--search", str(search), "--study", str(study),
                        "--trials", "1", *search_overrides(data)) == 2
        assert role in capsys.readouterr().err
    assert {p: p.read_text() for p in tmp_path.glob("N*/*")} == before
    assert not (data / "train" / "a" / "st").exists() and not (data / "train" / "b" / "st").exists()
    for flag, name in (("--plot", "sweep.png"), ("--json", "sweep.json")):  # the batch-size sweep's outputs too
        capsys.readouterr()
        assert tune_run(monkeypatch, "--config", "base", "--batch-sizes", "2", "--steps", "2", flag,
                        str(data / "train" / "a" / name), *search_overrides(data)) == 2
        assert "data folder" in capsys.readouterr().err and not (data / "train" / "a" / name).exists()


SPACE_FILE_ERRORS = {  # SPACE.yaml text -> what the message must name
    "optim.lr: {low: 0.001, high: 1.0}\noptim.lr: {low: 0.1, high: 0.5}\n": "'optim.lr' is given twice",
    "optim.lr: {low: 0.001, low: 0.1, high: 0.5}\n": "'low' is given twice",
    "train.seed: [" + ", ".join(map(str, range(101))) + "]\n": "101 choices, more than 100",
    "train.seed: [" + ", ".join(map(str, range(10 ** 6))) + "]\n": "a space names a few keys",
}


@pytest.mark.parametrize("text", SPACE_FILE_ERRORS)
def test_a_repeated_key_or_a_space_of_too_many_choices_is_refused_at_once(tmp_path, text):
    space = tmp_path / "space.yaml"
    space.write_text(text)
    with pytest.raises(ConfigError, match="--search") as info:
        load_space(str(space), "base", [])
    assert SPACE_FILE_ERRORS[text] in str(info.value)
def test_slice_plot_tick_labels_do_not_overlap_on_a_log_axis():
    """Issue 64: a log axis spanning a decade or two (an LR in [0.01, 0.3]) got its minor ticks labelled too
    (2x10^-2, 3x10^-2, ...), overlapping in the slice plot's narrow panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna

    from imgcls.tuning.search import draw_plot

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))

    def objective(trial):
        trial.suggest_float("optim.weight_decay", 1e-6, 1e-2, log=True)
        trial.suggest_int("train.batch_size", 16, 256, log=True)
        trial.suggest_float("train.label_smoothing", 0.0, 0.2)
        return -abs(trial.suggest_float("optim.lr", 0.01, 0.3, log=True) - 0.05)

    study.optimize(objective, n_trials=8)
    figure = draw_plot("slice.png", study, "top1")
    figure.canvas.draw()  # as savefig does: the ticks the locators give now
    renderer = figure.canvas.get_renderer()
    log_axes = 0
    for ax in figure.axes:
        low, high = sorted(ax.get_xlim())
        labels = [t.label1 for t in ax.xaxis.get_major_ticks()
                  if t.label1.get_visible() and t.label1.get_text() and low <= t.get_loc() <= high]
        boxes = [label.get_window_extent(renderer) for label in labels]
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), \
            [label.get_text() for label in labels]
        if ax.get_xscale() == "log":
            log_axes += 1
            assert len(labels) >= 2, [label.get_text() for label in labels]   # still a readable scale
            assert not any(t.label1.get_visible() and t.label1.get_text() for t in ax.xaxis.get_minor_ticks()
                           if low <= t.get_loc() <= high)
    assert log_axes == 3
    plt.close(figure)
