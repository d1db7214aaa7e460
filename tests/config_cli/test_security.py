"""Hostile files: a checkpoint or .pt2 whose unpickling would run code, a YAML config with Python tags or
an alias bomb, a FIFO where a file is read.

Each is refused with a clear message (exit 2 from the entry scripts) and nothing in them runs: the
payload would create a marker file, which must never appear.
"""
from __future__ import annotations

import ast
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, Payload, exit_code, make_tree, source_files, tiny_overrides

from imgcls.config import ConfigError, load_config, parse_override
from imgcls.core.errors import CheckpointError
from imgcls.core.safe_load import load_checkpoint
from imgcls.training.trainer import run


def write_hostile(path: Path, marker: Path, form: str) -> Path:
    obj = {"model": {"w": torch.zeros(2)}, "config": Payload(marker), "classes": ["a", "b"]}
    if form == "zip":
        torch.save(obj, path)
    elif form == "legacy":
        torch.save(obj, path, _use_new_zipfile_serialization=False)
    else:
        path.write_bytes(pickle.dumps(obj))
    return path


@pytest.fixture
def marker(tmp_path) -> Path:
    path = tmp_path / "PWNED"
    yield path
    assert not path.exists(), "the hostile payload ran"


def test_the_payload_is_real(tmp_path):
    """Guard against a harmless fixture: loaded the unsafe way, it does create the marker."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()


@pytest.mark.parametrize("form", ["zip", "legacy", "raw_pickle"])
def test_load_checkpoint_refuses_a_pickle_that_would_run_code(tmp_path, marker, form):
    path = write_hostile(tmp_path / "hostile.pt", marker, form)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert str(path) in message
    if form != "raw_pickle":  # a bare pickle is not a torch file at all
        assert "was refused" in message and "system" in message and "could run code" in message
    assert "weights_only` set to `False`" not in message and "weights_only=False" not in message


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return make_tree(tmp_path_factory.mktemp("sec") / "data", {"a": (8, 2), "b": (8, 2)})


@pytest.mark.slow
@pytest.mark.parametrize("how", ["resume", "resume_auto", "finetune", "model_weights"])
def test_training_refuses_a_hostile_checkpoint_in_every_place_it_reads_one(data_root, tmp_path, marker, how, capsys):
    out = tmp_path / "run"
    out.mkdir()
    hostile = write_hostile(out / "last.pt" if how == "resume_auto" else tmp_path / "hostile.pt", marker, "zip")
    extra = {"model.weights": str(hostile)} if how == "model_weights" else {}
    cfg = load_config("base", tiny_overrides(data_root, out, **{"model.name": "test_resnet", **extra}))
    kwargs = {"resume": {"resume": str(hostile)}, "resume_auto": {"resume": "auto"},
              "finetune": {"finetune": str(hostile)}, "model_weights": {}}[how]
    assert exit_code(lambda: run(cfg, **kwargs)) == 2
    err = capsys.readouterr().err
    assert "refused" in err and "Traceback" not in err
    assert not (out / "best.pt").exists()


@pytest.mark.slow
def test_entry_scripts_refuse_a_hostile_checkpoint(data_root, tmp_path, marker):
    hostile = write_hostile(tmp_path / "hostile.pt", marker, "zip")
    image = next((data_root / "val" / "a").iterdir())
    commands = {
        "train.py": ["--config", "base", *tiny_overrides(data_root, tmp_path / "run", **{"model.name": "test_resnet"}),
                     "--resume", str(hostile)],
        "eval.py": ["--checkpoint", str(hostile), "--data", str(data_root)],
        "infer.py": [str(image), "--checkpoint", str(hostile)],
    }
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs = {name: subprocess.Popen([sys.executable, str(REPO / name), *args], cwd=tmp_path, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, args in commands.items() if (REPO / name).exists()}
    assert "train.py" in procs
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, (name, err[-2000:])
        assert "was refused" in err and "could run code" in err, (name, err[-2000:])
        assert "Traceback" not in err, name


YAML_PAYLOAD = "train:\n  epochs: !!python/object/apply:os.system ['touch {marker}']\n"


def test_a_yaml_config_with_python_tags_exits_2_and_runs_nothing(data_root, tmp_path, marker, monkeypatch, capsys):
    """In-process through train.py's main: refused while the config is read, before any work."""
    import train

    config = tmp_path / "hostile.yaml"
    config.write_text(YAML_PAYLOAD.format(marker=marker))
    monkeypatch.setattr(sys, "argv", ["train.py", "--config", str(config), f"data.root={data_root}",
                                      f"output.dir={tmp_path / 'run'}"])
    assert exit_code(train.main) == 2
    err = capsys.readouterr().err
    assert str(config) in err and "not plain YAML" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_an_override_with_python_tags_is_refused(marker):
    with pytest.raises(ConfigError):
        parse_override(f"train.epochs=!!python/object/apply:os.system ['touch {marker}']")


def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\ndata:\n  mean: *a8\n")  # 10^9 values from 1 KB
    with pytest.raises(ConfigError, match="expands to more than"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="expands to more than"):
        load_config("quickstart", ["data.mean=&a [*a]"])  # an alias of itself nests without end


# ---------------------------------------------------------------- FIFOs where a file is read


def test_fifos_named_as_config_checkpoint_classes_or_weights_say_so_without_reading(tmp_path):
    """Each of these was opened and read: a FIFO blocked for ever (--classes) or was called missing."""
    from imgcls.config import resolve_config_path
    from imgcls.core.errors import ModelError
    from imgcls.model_files.loading import read_classes_file
    from imgcls.models.factory import read_weights_file

    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="a named pipe \\(FIFO\\); it must name a regular YAML file"):
        resolve_config_path(str(fifo))
    with pytest.raises(CheckpointError, match="a named pipe \\(FIFO\\); a checkpoint is a regular file"):
        load_checkpoint(fifo)
    with pytest.raises(ConfigError, match="--classes .*a named pipe"):
        read_classes_file(fifo, 3)
    with pytest.raises(ModelError, match="'model.weights' = .*a named pipe"):
        read_weights_file(fifo)


# ---------------------------------------------------------------- a hostile .pt2


def rewrite_zip(source: Path, target: Path, replace: dict) -> None:
    import zipfile

    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            for suffix, change in replace.items():
                if info.filename.endswith(suffix):
                    data = change(data)
            dst.writestr(info.filename, data)


@pytest.fixture(scope="module")
def plain_pt2(tmp_path_factory) -> Path:
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()).eval()
    path = tmp_path_factory.mktemp("pt2") / "plain.pt2"
    torch.export.save(torch.export.export(model, (torch.zeros(1, 3, 16, 16),)), str(path),
                      extra_files={"imgcls.json": '{"classes": ["a", "b", "c"]}'})
    return path


@pytest.mark.parametrize("how", ["use_pickle", "sample_inputs"])
def test_a_pt2_that_would_unpickle_is_refused_before_anything_in_it_runs(plain_pt2, tmp_path, marker, how):
    """A weight marked use_pickle (or sample inputs a plain load refuses) ran its payload in infer.py."""
    import json

    from imgcls.model_files.loading import load_model_file

    payload = pickle.dumps(Payload(marker))

    def pickled_weight(data: bytes) -> bytes:
        config = json.loads(data)
        config["config"]["0.weight"]["use_pickle"] = True
        return json.dumps(config).encode()

    evil = tmp_path / "evil.pt2"
    if how == "use_pickle":
        rewrite_zip(plain_pt2, evil, {"model_weights_config.json": pickled_weight, "data/weights/weight_0":
                                      lambda _: payload})
    else:
        rewrite_zip(plain_pt2, evil, {"data/sample_inputs/model.pt": lambda _: payload})
    with pytest.raises(CheckpointError, match="refused before loading, nothing in it was run"):
        load_model_file(evil)


# ---------------------------------------------------------------- the code itself


def python_files() -> list[Path]:
    return source_files()


def calls(tree: ast.AST, module: str, name: str):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == module:
            yield node


def test_every_torch_load_is_weights_only_and_yaml_is_safe_load_only():
    files = python_files()
    assert any(p.name == "checkpoints.py" for p in files)
    offenders = []
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in calls(tree, "torch", "load"):
            kw = {k.arg: k.value for k in node.keywords}
            value = kw.get("weights_only")
            if not (isinstance(value, ast.Constant) and value.value is True):
                offenders.append(f"{path}:{node.lineno} torch.load without weights_only=True")
        for name in ("load", "unsafe_load", "full_load", "load_all"):
            for node in calls(tree, "yaml", name):
                offenders.append(f"{path}:{node.lineno} yaml.{name}")
        if "tests" not in path.relative_to(REPO).parts:
            for name in ("load", "loads"):
                for node in calls(tree, "pickle", name):
                    offenders.append(f"{path}:{node.lineno} pickle.{name}")
        if "weights_only=False" in path.read_text() and path.name != Path(__file__).name:
            offenders.append(f"{path}: weights_only=False")
    assert offenders == []


def test_torch_is_at_a_release_without_the_weights_only_bypasses():
    """CVE-2025-32434 / CVE-2026-24747: weights_only=True could be bypassed before torch 2.10."""
    def version(text: str) -> tuple:
        return tuple(int(part) for part in text.split("+")[0].split(".")[:2])

    assert version(torch.__version__) >= (2, 10)
    pins = [line for line in (REPO / "requirements.txt").read_text().splitlines() if line.startswith("torch")]
    torch_pin = [p for p in pins if p.split("=")[0].split(">")[0].strip() == "torch"]
    assert torch_pin, "requirements.txt must name torch"
    assert version(torch_pin[0].split("=")[-1].split(">")[-1].strip()) >= (2, 10), torch_pin


# ---------------------------------------------------------------- credentials in a tracking URI

SECRET = "s3cr3t-value"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once it is closed: connection refused
SECRET_URIS = [f"http://user:{SECRET}@tracking.example.org:5000", f"http://tracking.example.org:5000/?token={SECRET}",
               f"https://tracking.example.org/?x=1&api_key={SECRET}", f"postgresql://db.example.org/mlflow?sslpassword={SECRET}"]


@pytest.mark.parametrize("uri", SECRET_URIS)
def test_a_tracking_uri_with_credentials_is_refused_without_repeating_them(uri, tmp_path, capsys):
    from imgcls.tracking.replay import main as replay

    with pytest.raises(ConfigError, match="tracking.uri") as refused:
        load_config("base", ["tracking.backend=mlflow", f"tracking.uri={uri}"])
    assert SECRET not in str(refused.value) and "***" in str(refused.value)
    (tmp_path / "tracking_backlog.jsonl").write_text('{"op": "end", "status": "FINISHED", "run_id": "abc"}\n')
    assert replay([str(tmp_path), "--uri", uri]) == 2
    err = capsys.readouterr().err
    assert "credentials" in err or "secret" in err
    assert SECRET not in err


def test_log_lines_naming_the_store_mask_its_credentials(tmp_path, monkeypatch):
    """MLFLOW_TRACKING_URI (the user's environment, never saved) may hold credentials: neither the client's own
    request log nor the tracking warnings repeat them."""
    import io
    import logging

    from imgcls.tracking.tracker import Backlog, MlflowStore, Sender

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://user:{SECRET}@127.0.0.1:{free_port()}/?token={SECRET}")
    log_file = io.StringIO()  # train.log's handler, on the root logger
    handler = logging.StreamHandler(log_file)
    logging.getLogger().addHandler(handler)
    try:
        sender = Sender(MlflowStore(None), Backlog(tmp_path / "tracking_backlog.jsonl"), attempts=1)
        sender.submit({"op": "start", "run_id": None, "run_key": "k", "experiment": "e", "run_name": "r", "tags": {}})
        sender.close(timeout_s=30)
        logging.getLogger("urllib3.connectionpool").warning(
            "Retrying after connection broken: http://user:%s@127.0.0.1/?token=%s/api/2.0", SECRET, SECRET)
    finally:
        logging.getLogger().removeHandler(handler)
    text = log_file.getvalue()
    assert "could not reach the tracking store" in text and "Retrying" in text
    assert SECRET not in text and "user:" not in text and "***" in text


@pytest.mark.slow
def test_train_log_never_holds_the_stores_credentials(data_root, tmp_path):
    from conftest import run_script

    out = tmp_path / "run"
    done = run_script("train.py", "--config", "base", *tiny_overrides(data_root, out, **{"model.name": "test_resnet",
                      "train.epochs": 1}), "tracking.backend=mlflow", cwd=tmp_path, timeout=300,
                      env={"MLFLOW_TRACKING_URI": f"http://user:{SECRET}@127.0.0.1:{free_port()}/?token={SECRET}"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "could not reach the tracking store" in (out / "train.log").read_text()
    for text in ((out / "train.log").read_text(), done.stderr, done.stdout, (out / "config.yaml").read_text()):
        assert SECRET not in text
