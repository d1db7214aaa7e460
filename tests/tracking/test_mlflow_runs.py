"""Tracking against a real MLflow: a local SQLite store (MLflow's own resolution through MLFLOW_TRACKING_URI),
and an `mlflow server` with a SQLite backend on 127.0.0.1 (tests/tracking/mlflow_server.py).

- a run fills one MLflow run: the config as dotted params, the tags, the step curves, every metrics.csv column
  at the rows' steps, the best, the files; eval.py adds eval/ figures and pictures to it; --finetune opens a
  new run tagged with its parent;
- SIGKILL and --resume: one run, whose metric history equals metrics.csv row for row, no step twice;
- the server killed mid-run: weights bitwise equal to a run without tracking, exit 0, and the backlog
  replays into the server afterwards;
- a 2-process DDP run is one run.
"""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, make_tree, run_script, wait_for
from kill_and_resume import (ENV, STEPS_PER_EPOCH, TIMEOUT, TOTAL_STEPS, assert_same_result, paused, run_to_end, start,
                             train_cmd)
from mlflow_server import MlflowServer

from imgcls.tracking.runs import config_params

pytestmark = pytest.mark.slow
mlflow = pytest.importorskip("mlflow")  # requirements-dev.txt installs it; CI runs these
from mlflow.tracking import MlflowClient  # noqa: E402

STEPS = list(range(1, TOTAL_STEPS + 1))


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return make_tree(tmp_path_factory.mktemp("tracking") / "data", {"a": (12, 4), "b": (12, 4), "c": (12, 4)})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = MlflowServer(tmp_path_factory.mktemp("mlflow_server")).start()
    yield running
    running.kill()


def tracked(uri: str | None, experiment: str, *extra: str) -> list[str]:
    return ["tracking.backend=mlflow", f"tracking.experiment={experiment}", *([f"tracking.uri={uri}"] if uri else []),
            *extra]


def csv_rows(run_dir: Path) -> list[dict]:
    with (run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def assert_history_is_metrics_csv(client: MlflowClient, run_id: str, run_dir: Path) -> None:
    """Every metrics.csv column is a metric of that name with one point per row (at the row's step, the
    row's value), and the step curve has each optimizer step once."""
    rows = csv_rows(run_dir)
    for column in rows[0]:
        if column == "step":
            continue
        expected = [(int(r["step"]), float(r[column])) for r in rows if r[column] != ""]
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, column))
        assert got == expected, (column, got, expected)
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == STEPS


def run_id_of(run_dir: Path, name: str = "last.pt") -> str:
    run_id = torch.load(run_dir / name, map_location="cpu", weights_only=True).get("tracking_run_id")
    assert run_id, f"{name} names no tracking run"
    return run_id


def test_local_store_run_eval_and_finetune(data_root, tmp_path):
    store = f"sqlite:///{tmp_path}/mlflow.db"
    env = {"MLFLOW_TRACKING_URI": store}  # tracking.uri null: MLflow's own resolution
    run = tmp_path / "digits-run"
    done = subprocess.run(train_cmd(data_root, run, *tracked(None, "local", "tracking.log_checkpoints=best")),
                          env={**ENV, **env}, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(store)
    run_id = run_id_of(run)
    assert run_id_of(run, "best.pt") == run_id
    info = client.get_run(run_id)
    assert info.info.status == "FINISHED" and info.info.run_name == "digits-run"
    assert client.get_experiment(info.info.experiment_id).name == "local"
    import yaml
    assert info.data.params == config_params(yaml.safe_load((run / "config.yaml").read_text()))
    tags = info.data.tags
    assert tags["imgcls.world_size"] == "1" and tags["imgcls.device"] == "cpu"
    assert tags["imgcls.torch_version"] == torch.__version__ and len(tags["imgcls.data_fingerprint"]) == 16
    assert "train.py" in tags["imgcls.command"] and f"output.dir={run}" in tags["imgcls.command"]
    if (REPO / ".git").exists():
        assert tags["mlflow.source.git.commit"].split("-")[0] == subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert_history_is_metrics_csv(client, run_id, run)
    for key in ("train/lr", "train/grad_norm", "train/samples_per_s"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == STEPS
    best = json.loads((run / "summary.json").read_text())["best"]
    assert info.data.metrics["best/top1"] == pytest.approx(best["top1"])
    files = {a.path for a in client.list_artifacts(run_id)} | {a.path for a in client.list_artifacts(run_id, "checkpoints")}
    assert {"config.yaml", "summary.json", "metrics.csv", "checkpoints/best.pt"} <= files
    assert not (run / "tracking_backlog.jsonl").exists()

    # eval.py of best.pt, asked to: its figures and pictures go into the same run, under eval/
    report = tmp_path / "eval.json"
    done = run_script("eval.py", "--checkpoint", str(run / "best.pt"), "--json", str(report), "--reliability",
                      str(tmp_path / "rel.png"), "tracking.backend=mlflow", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = client.get_run(run_id).data.metrics
    assert metrics["eval/top1"] == pytest.approx(json.loads(report.read_text())["top1"])
    assert metrics["eval/num_samples"] == json.loads(report.read_text())["num_samples"]
    eval_files = {a.path for a in client.list_artifacts(run_id, "eval")}
    assert {"eval/eval.json", "eval/eval_confusion.png", "eval/rel.png"} <= eval_files
    assert len(client.search_runs([info.info.experiment_id])) == 1

    # --finetune: a new run, tagged with the run of the checkpoint it starts from
    tuned = tmp_path / "tuned"
    done = subprocess.run(train_cmd(data_root, tuned, "--finetune", str(run / "best.pt"), "train.epochs=1",
                                    *tracked(None, "local")),
                          env={**ENV, **env}, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    child = client.get_run(run_id_of(tuned))
    assert child.info.run_id != run_id and child.data.tags["imgcls.parent_run_id"] == run_id
    assert child.data.tags["mlflow.parentRunId"] == run_id


def wait_until(ready, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def logged_steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_sigkill_and_resume_is_one_run_equal_to_metrics_csv(data_root, server, tmp_path):
    run, marker = tmp_path / "run", tmp_path / "paused"
    client = MlflowClient(server.uri)
    # halted in epoch 2 just after step 5's last.pt (the 6th save); the step points it sent before are kept
    proc = start(train_cmd(data_root, run, *tracked(server.uri, "resume"),
                           script=paused(marker, f"after_save:{STEPS_PER_EPOCH + 2}")))
    wait_for(proc, marker.exists, "the pause point")
    run_id = run_id_of(run)
    wait_until(lambda: STEPS_PER_EPOCH + 1 in logged_steps(client, run_id, "train/loss"), "step 5 in the store")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=TIMEOUT)
    assert client.get_run(run_id).info.status == "RUNNING"  # a killed job ends nothing

    done = run_to_end(train_cmd(data_root, run, "--resume", "auto", *tracked(server.uri, "resume")))
    assert "resumed at epoch 2, batch 1, optimizer step 5" in done.stderr
    assert run_id_of(run) == run_id
    experiment = client.get_experiment_by_name("resume")
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert_history_is_metrics_csv(client, run_id, run)


def test_server_killed_mid_run_training_unchanged_and_backlog_replays(data_root, server, tmp_path):
    reference = tmp_path / "reference"
    run_to_end(train_cmd(data_root, reference))
    run = tmp_path / "run"
    proc = subprocess.Popen(train_cmd(data_root, run, *tracked(server.uri, "server-gone")), env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    client = MlflowClient(server.uri)

    def sent_step_two() -> bool:
        return (run / "last.pt").exists() and 2 in logged_steps(client, run_id_of(run), "train/loss")

    wait_for(proc, sent_step_two, "step 2 in the store")
    run_id = run_id_of(run)
    server.kill()
    killed = time.monotonic()
    _, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, err[-3000:]
    assert_same_result(run, reference)  # bitwise the weights of the run without tracking
    warnings = err.count("could not reach the tracking store")
    assert 1 <= warnings <= 1 + (time.monotonic() - killed) // 60  # once a minute at most
    backlog = run / "tracking_backlog.jsonl"
    assert backlog.exists() and run_id_of(run) == run_id

    server.start()  # the same database and artifact folder, the same port
    done = subprocess.run([sys.executable, "-m", "imgcls.tracking.replay", str(run)], cwd=REPO, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not backlog.exists() and list(run.glob("tracking_backlog.replayed-*.jsonl"))
    assert client.get_run(run_id).info.status == "FINISHED"
    assert_history_is_metrics_csv(client, run_id, run)
    assert {"config.yaml", "summary.json", "metrics.csv"} <= {a.path for a in client.list_artifacts(run_id)}
    experiment = client.get_experiment_by_name("server-gone")
    assert len(client.search_runs([experiment.experiment_id])) == 1


def test_a_run_stopped_and_resumed_while_the_store_is_down_replays_into_its_run(data_root, tmp_path):
    from mlflow_server import free_port

    store = f"sqlite:///{tmp_path}/mlflow.db"
    run, marker = tmp_path / "run", tmp_path / "paused"
    # SIGTERM after last.pt holds step 6: the run stops there, ends its tracking run KILLED, exits 143
    proc = start(train_cmd(data_root, run, *tracked(store, "down"),
                           script=paused(marker, f"wait_signal:{STEPS_PER_EPOCH + 2}")))
    wait_for(proc, marker.exists, "the pause point")
    os.killpg(proc.pid, signal.SIGTERM)
    err = proc.communicate(timeout=TIMEOUT)[1]
    assert proc.returncode == 143, err[-3000:]
    run_id = run_id_of(run)
    client = MlflowClient(store)
    assert client.get_run(run_id).info.status == "KILLED"

    # resumed while the store is down (here: nothing listens at the URI), to the end
    run_to_end(train_cmd(data_root, run, "--resume", "auto", *tracked(f"http://127.0.0.1:{free_port()}", "down")))
    assert (run / "tracking_backlog.jsonl").exists() and run_id_of(run) == run_id
    done = subprocess.run([sys.executable, "-m", "imgcls.tracking.replay", str(run), "--uri", store], cwd=REPO,
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    info = client.get_run(run_id)
    assert info.info.status == "FINISHED" and info.data.tags["imgcls.resumed_at_step"] == str(STEPS_PER_EPOCH + 2)
    assert "--resume auto" in info.data.tags["imgcls.resume_command"]
    assert "--resume" not in info.data.tags["imgcls.command"]  # the command that started the run
    assert_history_is_metrics_csv(client, run_id, run)
    assert {"config.yaml", "summary.json", "metrics.csv"} <= {a.path for a in client.list_artifacts(run_id)}
    assert [r.info.run_id for r in client.search_runs([info.info.experiment_id])] == [run_id]


def test_unreachable_store_at_start_trains_and_replays_into_a_new_run(data_root, tmp_path):
    from mlflow_server import free_port

    port = free_port()  # nothing listens there
    run = tmp_path / "run"
    done = run_to_end(train_cmd(data_root, run, *tracked(f"http://127.0.0.1:{port}", "late")))
    assert "could not reach the tracking store" in done.stderr
    saved = torch.load(run / "last.pt", map_location="cpu", weights_only=True)
    assert saved["step"] == TOTAL_STEPS and "tracking_run_id" not in saved
    store = f"sqlite:///{tmp_path}/late.db"
    replayed = subprocess.run([sys.executable, "-m", "imgcls.tracking.replay", str(run), "--uri", store], cwd=tmp_path,
                              env={**ENV, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=TIMEOUT)
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("late").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert_history_is_metrics_csv(client, runs[0].info.run_id, run)


def test_two_process_ddp_run_is_one_run(data_root, tmp_path):
    store = f"sqlite:///{tmp_path}/ddp.db"
    run = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(REPO / "train.py"), *train_cmd(data_root, run, *tracked(store, "ddp"))[2:],
               "data.num_workers=0"]
    done = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=TIMEOUT * 2)
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("ddp").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id_of(run)]
    assert runs[0].data.tags["imgcls.world_size"] == "2"
    rows = csv_rows(run)
    for column in ("val_top1", "val_loss", "train_loss", "lr"):
        got = sorted((m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, column))
        assert got == [(int(r["step"]), float(r[column])) for r in rows]


def test_tune_opens_a_run_of_its_own(data_root, tmp_path):
    from conftest import tiny_overrides

    store = f"sqlite:///{tmp_path}/tune.db"
    report, plot = tmp_path / "tune.json", tmp_path / "tune.png"
    done = run_script("tune.py", "--config", "base", *tiny_overrides(data_root, tmp_path / "unused"),
                      "--batch-sizes", "4,8", "--steps", "3", "--json", str(report), "--plot", str(plot),
                      *tracked(store, "tune"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("tune").experiment_id])
    assert len(runs) == 1 and runs[0].info.run_name.startswith("tune-sweep-")
    rows = json.loads(report.read_text())["rows"]
    history = client.get_metric_history(runs[0].info.run_id, "sweep/img_per_s")
    assert sorted((m.step, m.value) for m in history) == [(r["effective_batch"], r["img_per_s"]) for r in rows]
    assert {"tune.json", "tune.png"} <= {a.path for a in client.list_artifacts(runs[0].info.run_id)}
