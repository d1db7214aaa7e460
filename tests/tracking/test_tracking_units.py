"""The tracking room's pieces without a store: the tracking.* keys and URIs (exit 2 before any work), the
metrics.csv points, the once-a-minute warning, and the sender's never-blocking queue and backlog."""
from __future__ import annotations

import json
import time

import pytest

from imgcls.config import ConfigError, load_config
from imgcls.tracking.runs import config_params, fingerprint_digest, metrics_csv_points
from imgcls.tracking.settings import tracking_uri_problem
from imgcls.tracking.tracker import Backlog, RateLimitedWarning, Sender, read_backlog


@pytest.mark.parametrize("uri", [None, "runs/mlruns", "/abs/mlruns", "file:///tmp/mlruns", "sqlite:///mlflow.db",
                                 "sqlite:////tmp/x.db", "http://127.0.0.1:5000", "https://mlflow.example.com"])
def test_usable_tracking_uris_are_accepted(uri):
    cfg = load_config("base", ["tracking.backend=mlflow"] + ([f"tracking.uri={uri}"] if uri else []))
    assert cfg.tracking.uri == uri


@pytest.mark.parametrize("uri, reason", [
    ("ftp://host/x", "unknown scheme 'ftp'"), ("javascript:alert(1)", "unknown scheme"),
    ("http://", "no host"), ("http://host:99999", "malformed"), ("http://user:secret@host:5000", "credentials"),
    ("sqlite://relative.db", "sqlite:///"), ("runs/a b", "white space"), ("http://host:0", "port 0")])
def test_broken_or_hostile_uris_are_config_errors(uri, reason):
    assert reason in tracking_uri_problem(uri)
    with pytest.raises(ConfigError, match="tracking.uri"):
        load_config("base", ["tracking.backend=mlflow", f"tracking.uri={uri}"])


def test_other_tracking_keys_are_checked():
    with pytest.raises(ConfigError, match="tracking.backend"):
        load_config("base", ["tracking.backend=wandb"])
    with pytest.raises(ConfigError, match="tracking.log_checkpoints"):
        load_config("base", ["tracking.log_checkpoints=true"])
    with pytest.raises(ConfigError, match="tracking.run_name"):
        load_config("base", ["tracking.run_name=" + "x" * 251])
    assert load_config("base", ["tracking.log_checkpoints=best"]).tracking.log_checkpoints == "best"
    assert load_config("quickstart").source_name == "quickstart"


def test_train_with_a_bad_uri_exits_2_before_any_work(tmp_path):
    from conftest import run_script

    out = tmp_path / "run"
    done = run_script("train.py", "--config", "quickstart", f"output.dir={out}", "tracking.backend=mlflow",
                      "tracking.uri=gopher://host/x", timeout=120)
    assert done.returncode == 2
    assert "tracking.uri" in done.stderr and "unknown scheme 'gopher'" in done.stderr
    assert not out.exists() and "loading torch" not in done.stderr


def test_metrics_csv_points_are_the_rows_after_a_step(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("epoch,step,lr,train_loss,val_top1,val_mAP\n1,4,0.1,1.5,33.3333,\n2,8,0,1.25,50,\n")
    assert metrics_csv_points(path, -1) == [(4, {"epoch": 1.0, "lr": 0.1, "train_loss": 1.5, "val_top1": 33.3333}),
                                            (8, {"epoch": 2.0, "lr": 0.0, "train_loss": 1.25, "val_top1": 50.0})]
    assert [step for step, _ in metrics_csv_points(path, 4)] == [8]
    assert metrics_csv_points(tmp_path / "missing.csv", -1) == []


def test_config_params_are_dotted_keys():
    params = config_params(load_config("quickstart").to_dict())
    assert params["model.name"] == "resnet18" and params["data.scale"] == "[0.7, 1.0]"
    assert params["tracking.backend"] == "none" and params["train.epochs"] == "12"
    assert fingerprint_digest({"train": {"digest": "a"}}) == fingerprint_digest({"train": {"digest": "a"}})
    assert fingerprint_digest(None) is None


def test_the_warning_comes_at_most_once_a_minute(caplog):
    now = [0.0]
    warning = RateLimitedWarning(60.0, clock=lambda: now[0])
    shown = []
    for t in (0, 1, 30, 59, 61, 62, 125):
        now[0] = t
        shown.append(warning.warn("store down"))
    assert shown == [True, False, False, False, True, False, True]
    assert "3 more such warning(s) held back" in caplog.records[1].getMessage()


class SlowFailingStore:
    """A store that hangs `delay` seconds on every call and then fails, as a black-holed server does."""

    def __init__(self, delay: float, fail: bool = True):
        self.delay, self.fail, self.run_id, self.calls = delay, fail, None, 0

    def apply(self, record):
        self.calls += 1
        time.sleep(self.delay)
        if self.fail:
            raise ConnectionError("connection refused")
        if record["op"] == "start":
            self.run_id = "abc"


def test_submit_never_waits_for_the_store_and_failures_go_to_the_backlog(tmp_path):
    backlog = Backlog(tmp_path / "tracking_backlog.jsonl")
    store = SlowFailingStore(0.2)
    sender = Sender(store, backlog, queue_size=4, attempts=2, retry_wait_s=0.01, down_for_s=60)
    started = time.perf_counter()
    sender.submit({"op": "start", "run_id": None, "experiment": "e", "run_name": "r", "tags": {}})
    for step in range(20):
        sender.submit({"op": "metrics", "step": step, "timestamp": 0, "metrics": {"loss": float(step)}})
    assert time.perf_counter() - started < 0.15  # 20 submits while one call alone takes 0.2 s
    sender.close(timeout_s=5)
    records = read_backlog(backlog.path)
    # every record is kept, in the backlog: the run was never created, so none carries a run id
    assert [r["op"] for r in records].count("start") == 1
    assert sorted(r["step"] for r in records if r["op"] == "metrics") == list(range(20))
    assert all(r.get("run_id") is None for r in records)
    assert store.calls == 2  # the start was tried twice; after it failed nothing more was tried


def test_a_hanging_store_at_close_leaves_the_rest_in_the_backlog(tmp_path):
    backlog = Backlog(tmp_path / "tracking_backlog.jsonl")
    store = SlowFailingStore(3.0, fail=False)
    sender = Sender(store, backlog)
    for step in range(3):
        sender.submit({"op": "metrics", "step": step, "timestamp": 0, "metrics": {"loss": 1.0}})
    started = time.perf_counter()
    sender.close(timeout_s=0.5)
    assert time.perf_counter() - started < 2.0
    assert sorted(r["step"] for r in read_backlog(backlog.path)) == [0, 1, 2]


def test_a_cut_short_backlog_line_is_left_out(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_text(json.dumps({"op": "metrics", "step": 1, "metrics": {}}) + "\n{\"op\": \"metr")
    assert [r["step"] for r in read_backlog(path)] == [1]


def test_the_client_is_needed_to_log_but_not_to_read_a_tracked_config(monkeypatch):
    import imgcls.config as config
    import imgcls.tracking.tracker as store_location

    cfg = load_config("base", ["tracking.backend=mlflow"])
    monkeypatch.setattr(store_location, "tracking_client_installed", lambda: False)
    config.validate(cfg)  # eval.py / infer.py of a tracked run's checkpoint: no MLflow needed
    with pytest.raises(ConfigError, match="pip install mlflow"):
        store_location.check_tracking_client(cfg.tracking)
    store_location.check_tracking_client(load_config("base").tracking)  # backend none


# ---------------------------------------------------------------- a store to replay into, and one that is down

@pytest.fixture
def folder_store(tmp_path, monkeypatch):
    """A URI factory for MLflow folder stores (no database set-up: a fresh store costs nothing)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return lambda name="store": (tmp_path / name).as_uri()


def unreachable_uri() -> str:
    from mlflow_server import free_port

    return f"http://127.0.0.1:{free_port()}"  # nothing listens there: connection refused


def tracked_job(run_dir, uri, run_id=None, run_key="k1", steps=(), status="FINISHED", reopen=False):
    """One job's tracking as train.py does it: start, params, a point per step, end."""
    from imgcls.tracking.tracker import MlflowTracker

    tracker = MlflowTracker(uri, run_dir, "exp", "run", run_id, {"imgcls.command": "train.py"}, run_key=run_key,
                            reopen=reopen, close_timeout_s=5)
    tracker.log_params({"optim.lr": "0.1"})
    for step in steps:
        tracker.log_metrics({"loss": float(step)}, step)
    tracker.close(status)
    return tracker


def replay_cli(run_dir, uri, capsys) -> tuple[int, str]:
    from imgcls.tracking.replay import main

    code = main([str(run_dir), "--uri", uri])
    out = capsys.readouterr()
    return code, out.out + out.err


def history(uri: str, run_id: str, key: str = "loss") -> list[int]:
    from mlflow.tracking import MlflowClient

    return sorted(m.step for m in MlflowClient(uri).get_metric_history(run_id, key))


def runs_of(uri: str, experiment: str = "exp") -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id]) if found else []


def test_a_run_resumed_while_the_store_is_down_is_replayed_into_its_run(tmp_path, folder_store, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    store = folder_store()
    run_id = tracked_job(run_dir, store, steps=[1, 2], status="KILLED").run_id  # stopped by SIGTERM
    assert run_id and not (run_dir / "tracking_backlog.jsonl").exists()
    down = tracked_job(run_dir, unreachable_uri(), run_id=run_id, steps=[3, 4], reopen=True)  # resumed, store down
    assert down.run_id == run_id  # what its checkpoints go on naming
    records = read_backlog(run_dir / "tracking_backlog.jsonl")
    assert {r["run_id"] for r in records} == {run_id} and {r["run_key"] for r in records} == {"k1"}
    code, out = replay_cli(run_dir, store, capsys)
    assert code == 0, out
    from mlflow.tracking import MlflowClient

    assert MlflowClient(store).get_run(run_id).info.status == "FINISHED"
    assert history(store, run_id) == [1, 2, 3, 4]
    assert [r.info.run_id for r in runs_of(store)] == [run_id]


def test_a_changed_uri_on_resume_opens_a_run_in_the_new_store(tmp_path, folder_store, capsys):
    from imgcls.tracking.tracker import PREVIOUS_RUN_TAG

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    old_id = tracked_job(run_dir, folder_store("old"), steps=[1, 2], status="KILLED").run_id
    new = tracked_job(run_dir, folder_store("new"), run_id=old_id, steps=[3, 4], reopen=True)  # store up
    assert new.run_id and new.run_id != old_id and not (run_dir / "tracking_backlog.jsonl").exists()
    (only,) = runs_of(folder_store("new"))
    assert only.info.status == "FINISHED" and only.data.tags[PREVIOUS_RUN_TAG] == old_id
    assert history(folder_store("new"), new.run_id) == [3, 4]
    # the same with the new store down at the resume: the replay puts the records into a new run there
    tracked_job(run_dir, unreachable_uri(), run_id=old_id, run_key="k2", steps=[5], reopen=True)
    code, out = replay_cli(run_dir, folder_store("third"), capsys)
    assert code == 0, out
    (made,) = runs_of(folder_store("third"))
    assert made.data.tags[PREVIOUS_RUN_TAG] == old_id and history(folder_store("third"), made.info.run_id) == [5]


def test_replay_twice_is_one_run_and_a_bad_line_stops_it_before_anything_is_sent(tmp_path, folder_store, capsys):
    from imgcls.tracking.runs import read_run_record, write_run_record

    run_dir, store = tmp_path / "run", folder_store()
    run_dir.mkdir()
    write_run_record(run_dir, "k9", None)  # what train.py writes when tracking starts
    tracked_job(run_dir, unreachable_uri(), run_key="k9", steps=[1, 2, 3])  # never created
    path = run_dir / "tracking_backlog.jsonl"
    good = path.read_text().splitlines()
    bad = json.dumps({"op": "metrics", "step": "x", "timestamp": 0, "metrics": {"loss": 1.0}, "run_key": "k9"})
    path.write_text("\n".join(good[:2] + [bad] + good[2:]) + "\n")
    code, out = replay_cli(run_dir, store, capsys)
    assert code == 2 and "line 3" in out and "'step'" in out and "store" not in out.split("line 3")[1][:80]
    assert runs_of(store) == []  # nothing was sent
    path.write_text("\n".join(good) + "\n")  # the line fixed (deleted)
    assert replay_cli(run_dir, store, capsys)[0] == 0
    path.write_text("\n".join(good) + "\n")  # the same backlog replayed again
    code, out = replay_cli(run_dir, store, capsys)
    assert code == 0, out
    (run,) = runs_of(store)
    assert history(store, run.info.run_id) == [1, 2, 3] and run.info.status == "FINISHED"
    assert read_run_record(run_dir) == {"run_key": "k9", "run_id": run.info.run_id}


def test_replay_uploads_only_files_of_the_run_directory_and_says_what_it_left_out(tmp_path, folder_store, capsys):
    from mlflow.tracking import MlflowClient

    from imgcls.tracking.tracker import MlflowTracker

    run_dir, store = tmp_path / "run", folder_store()
    run_dir.mkdir()
    (run_dir / "summary.json").write_text("{}")
    outside = tmp_path / "private.txt"
    outside.write_text("not for the store")
    tracker = MlflowTracker(unreachable_uri(), run_dir, "exp", "run", run_key="k3", close_timeout_s=5)
    tracker.log_artifact(run_dir / "summary.json")
    tracker.log_artifact(outside)
    tracker.log_artifact(run_dir / "gone.csv")
    tracker.close()
    code, out = replay_cli(run_dir, store, capsys)
    assert code == 1 and "private.txt lies outside" in out and "gone.csv is gone" in out
    assert "2 of 5 record(s) were not sent" in out
    (run,) = runs_of(store)
    assert [a.path for a in MlflowClient(store).list_artifacts(run.info.run_id)] == ["summary.json"]
    kept = read_backlog(run_dir / "tracking_backlog.jsonl")
    assert [r["op"] for r in kept] == ["start", "artifact", "artifact"]  # what is left, with its run's start


def test_a_start_record_of_a_failed_store_keeps_the_run_it_names(tmp_path):
    backlog = Backlog(tmp_path / "tracking_backlog.jsonl")
    sender = Sender(SlowFailingStore(0.0), backlog, attempts=1, retry_wait_s=0.01)
    sender.submit({"op": "start", "run_id": "abc", "run_key": "k", "experiment": "e", "run_name": "r", "tags": {}})
    sender.submit({"op": "metrics", "step": 1, "timestamp": 0, "metrics": {"loss": 1.0}, "run_key": "k"})
    sender.close(timeout_s=5)
    assert [r["run_id"] for r in read_backlog(backlog.path)] == ["abc", "abc"]


# ---------------------------------------------------------------- eval.py's tracking

def tracked_checkpoint(path, uri="http://tracking.example.org:5000"):
    """A best.pt of a tracked run as train.py writes it (the parts eval.py's tracking reads)."""
    import torch

    torch.save({"tracking_run_id": "abc123", "step": 7, "model": {},
                "config": {"tracking": {"backend": "mlflow", "uri": uri, "experiment": "theirs"}}}, path)
    return path


class RecordingTracker:
    all_sent = True

    def __init__(self, calls, *args, **kwargs):
        calls.append((args, kwargs))
        self.metrics = []

    def log_params(self, params):
        pass

    def log_metrics(self, metrics, step):
        self.metrics.append((step, metrics))

    def log_artifact(self, path, artifact_path=None):
        pass

    def close(self):
        pass


def test_eval_never_logs_to_a_store_that_only_the_checkpoint_names(tmp_path, monkeypatch, caplog):
    import logging

    import imgcls.tracking.runs as evaluation

    ckpt = tracked_checkpoint(tmp_path / "best.pt")
    calls = []
    monkeypatch.setattr(evaluation, "open_tracker", lambda *a, **k: RecordingTracker(calls, *a, **k))
    caplog.set_level(logging.INFO)
    evaluation.log_evaluation(str(ckpt), ["train.device=cpu"], {"top1": 50.0}, [])
    assert calls == [] and "pass tracking.backend=mlflow" in caplog.text
    # asked for on the command line: the user's store (here MLflow's own resolution), never the checkpoint's
    evaluation.log_evaluation(str(ckpt), ["tracking.backend=mlflow"], {"top1": 50.0}, [])
    ((args, kwargs),) = calls
    assert args[0].uri is None and args[0].experiment is None and args[4] == "abc123" and kwargs["attach_only"]
    assert "eval/ figures added to run abc123" in caplog.text


def test_eval_with_an_unreachable_store_says_the_figures_were_not_added(tmp_path, caplog):
    import logging

    from imgcls.tracking.runs import log_evaluation

    ckpt = tracked_checkpoint(tmp_path / "best.pt")
    caplog.set_level(logging.INFO)
    log_evaluation(str(ckpt), ["tracking.backend=mlflow", f"tracking.uri={unreachable_uri()}"], {"top1": 50.0}, [])
    assert "figures added" not in caplog.text and "did not reach run abc123" in caplog.text
    records = read_backlog(tmp_path / "tracking_backlog.jsonl")
    assert [r["op"] for r in records] == ["start", "metrics"] and records[1]["metrics"] == {"eval/top1": 50.0}


# ---------------------------------------------------------------- where a local store may write

@pytest.mark.parametrize("where", ["data root", "CSV folder", "shards", "teacher", "sqlite in data"])
def test_a_local_store_inside_an_input_is_refused(tmp_path, where):
    from imgcls.tracking.tracker import check_store_apart

    data = tmp_path / "data"
    (data / "train" / "cat").mkdir(parents=True)
    lists, shards, teacher = tmp_path / "lists", tmp_path / "shards", tmp_path / "teacher"
    for folder in (lists, shards, teacher):
        folder.mkdir()
    (lists / "train.csv").write_text("path,label\n")
    (teacher / "config.json").write_text("{}")
    keys = {"data root": ["data.root=" + str(data)],
            "CSV folder": ["data.format=csv", f"data.train_csv={lists / 'train.csv'}", "data.val_fraction=0.2"],
            "shards": ["data.format=webdataset", f"data.train_shards={shards}/train-{{000..003}}.tar",
                       f"data.val_shards={shards}/val-000.tar", f"data.classes={lists / 'train.csv'}"],
            "teacher": [f"distill.teacher=local-dir:{teacher}", "data.root=" + str(data)],
            "sqlite in data": ["data.root=" + str(data)]}[where]
    store = {"data root": (data / "train").as_uri(), "CSV folder": str(lists / "mlruns"),
             "shards": str(shards / "mlruns"), "teacher": str(teacher / "mlruns"),
             "sqlite in data": f"sqlite:///{data}/mlflow.db"}[where]
    cfg = load_config("base", keys + ["tracking.backend=mlflow", f"tracking.uri={store}"])
    with pytest.raises(ConfigError, match="tracking.uri"):
        check_store_apart(cfg)
    check_store_apart(load_config("base", keys + ["tracking.backend=mlflow", f"tracking.uri={tmp_path / 'mlruns'}"]))


@pytest.mark.slow
def test_train_with_a_store_inside_the_data_exits_2_and_leaves_the_data_alone(tmp_path):
    from conftest import make_tree, run_script, tiny_overrides

    data = make_tree(tmp_path / "data", {"a": (4, 2), "b": (4, 2)})
    before = sorted(data.rglob("*"))
    out = tmp_path / "run"
    done = run_script("train.py", "--config", "base", *tiny_overrides(data, out), "tracking.backend=mlflow",
                      f"tracking.uri={(data / 'train').as_uri()}", env={"MLFLOW_ALLOW_FILE_STORE": "true"},
                      cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "'tracking.uri' (a folder store)" in done.stderr and "overlaps the data root" in done.stderr
    assert sorted(data.rglob("*")) == before and not (out / "last.pt").exists()


def test_a_folder_store_the_installed_mlflow_refuses_is_exit_2(monkeypatch):
    import imgcls.tracking.tracker as config

    cfg = load_config("base", ["tracking.backend=mlflow", "tracking.uri=runs/mlruns"])
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.setattr(config, "folder_store_allowed", lambda: False)  # MLflow 3's file store: maintenance mode
    with pytest.raises(ConfigError, match="sqlite:///mlflow.db.*MLFLOW_ALLOW_FILE_STORE=true"):
        config.check_tracking_client(cfg.tracking)
    monkeypatch.setattr(config, "folder_store_allowed", lambda: True)
    config.check_tracking_client(cfg.tracking)
    config.check_tracking_client(load_config("base", ["tracking.backend=mlflow", "tracking.uri=sqlite:///m.db"]).tracking)


def test_the_installed_mlflow_refuses_a_folder_store_unless_allowed(monkeypatch):
    import mlflow.store.tracking.file_store as file_store

    from imgcls.tracking.tracker import folder_store_allowed

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    refused = "MLFLOW_ALLOW_FILE_STORE" in open(file_store.__file__).read()
    assert folder_store_allowed() is not refused
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert folder_store_allowed()


# ---------------------------------------------------------------- a resumed run's identity

def test_a_resumed_job_keeps_the_runs_command_key_and_experiment(tmp_path, monkeypatch):
    import imgcls.tracking.runs as training
    from imgcls.config import config_from_dict
    from imgcls.tracking.runs import read_run_record

    calls = []
    monkeypatch.setattr(training, "open_tracker", lambda *a, **k: RecordingTracker(calls, *a, **k))
    monkeypatch.setattr("sys.argv", ["train.py", "--resume", "auto", "--config", "quickstart"])
    cfg = load_config("quickstart", ["tracking.backend=mlflow"])
    training.open_training_tracking(cfg, tmp_path, True, 1, "cpu", None, None, None, None)
    key = read_run_record(tmp_path)["run_key"]
    training.open_training_tracking(cfg, tmp_path, True, 1, "cpu", None, {"step": 5, "tracking_run_id": "r1"},
                                    None, None)
    (_, first), (args, resumed) = calls
    tags = args[5]
    assert "imgcls.command" not in tags and tags["imgcls.resume_command"].startswith("train.py --resume auto")
    assert tags["imgcls.resumed_at_step"] == 5 and resumed["run_key"] == first["run_key"] == key
    assert resumed["reopen"] and args[4] == "r1"
    # the experiment: a run resumed without --config (and tracking turned on then) stays in its config's
    assert config_from_dict(cfg.to_dict()).tracking.experiment == "quickstart"


def test_a_backlog_written_before_run_keys_goes_into_the_run_its_start_names(tmp_path):
    from imgcls.tracking.replay import run_groups

    old = [{"op": "start", "run_id": "r1", "session": "s1", "experiment": "e"},
           {"op": "metrics", "run_id": None, "session": "s1", "step": 1, "timestamp": 0, "metrics": {}},
           {"op": "metrics", "run_id": "r2", "session": "s2", "step": 1, "timestamp": 0, "metrics": {}},
           {"op": "start", "run_id": None, "session": "s3", "experiment": "e"},
           {"op": "end", "run_id": None, "session": "s3", "status": "FINISHED"}]
    groups = run_groups(list(enumerate(old, 1)))
    assert {key: [n for n, _ in items] for key, items in groups.items()} == {"r1": [1, 2], "r2": [3],
                                                                           "session:s3": [4, 5]}


def test_a_record_the_store_refuses_is_named_by_its_line_not_blamed_on_the_store(tmp_path, folder_store, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    records = [{"op": "start", "run_id": None, "run_key": "k5", "experiment": "exp", "run_name": "r", "tags": {}},
               {"op": "metrics", "run_id": None, "run_key": "k5", "step": 1, "timestamp": 0, "metrics": {"loss%": 1.0}}]
    (run_dir / "tracking_backlog.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    code, out = replay_cli(run_dir, folder_store(), capsys)
    assert code == 1 and "refused the record at line 2 (metrics)" in out and "failed" not in out
    assert (run_dir / "tracking_backlog.jsonl").exists()
