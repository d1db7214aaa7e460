"""The labelling round trip with a real Label Studio (marker `labelstudio`: left out of a plain run; .ci/run
installs the server into a virtual environment of its own and runs it): the server on 127.0.0.1 with its SQLite
store in a temp folder, a user and its token made at start, a project made through the API; `label pick`, `label
push --url` (the images served from local storage), annotations given through the API, `label pull --url`, and a
training run on the pulled CSV.

The server: $IMGCLS_LABEL_STUDIO (the `label-studio` executable), else `label-studio` on PATH, else the one
.ci/run installs under ${XDG_CACHE_HOME:-~/.cache}/imgcls-ci/label-studio."""
import csv
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import exit_code, make_cfg

pytestmark = pytest.mark.labelstudio

START_TIMEOUT_S = 300


def label_studio_executable() -> str:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    for candidate in (os.environ.get("IMGCLS_LABEL_STUDIO"), shutil.which("label-studio"),
                      str(cache / "imgcls-ci" / "label-studio" / "bin" / "label-studio")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail("no label-studio executable: set IMGCLS_LABEL_STUDIO, or run .ci/run, which installs one")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tmp_path):
    """(url, token, document root) of a Label Studio started for this test, stopped after it."""
    port, token = free_port(), secrets.token_hex(20)
    root = tmp_path / "root"
    root.mkdir()
    env = dict(os.environ, LABEL_STUDIO_LOCAL_FILES_SERVING_ENABLED="true",
               LABEL_STUDIO_LOCAL_FILES_DOCUMENT_ROOT=str(root), LATEST_VERSION_CHECK="false",
               COLLECT_ANALYTICS="false", DJANGO_DB="sqlite")
    log = open(tmp_path / "label-studio.log", "wb")
    proc = subprocess.Popen([label_studio_executable(), "start", "--no-browser", "--data-dir", str(tmp_path / "ls"),
                             "--internal-host", "127.0.0.1", "--port", str(port), "--username", "test@example.com",
                             "--password", secrets.token_hex(8), "--user-token", token, "--enable-legacy-api-token"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"label-studio ended (exit {proc.returncode}):\n"
                            f"{(tmp_path / 'label-studio.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("label-studio did not answer /health in time")
            time.sleep(0.5)
        yield url, token, root
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_pick_push_annotate_pull_and_train(server, finished_run, faults_tree, tmp_path, monkeypatch, capsys):
    from imgcls.cli import label
    from imgcls.labelling.label_studio import authorization, label_config, request
    from imgcls.training.trainer import run

    url, token, root = server
    shutil.copytree(faults_tree / "train", root / "pool")
    picks, labels, labelled = tmp_path / "picks.csv", tmp_path / "labels.csv", tmp_path / "labelled.csv"
    labelled.write_text("path,label\n" + "".join(f"root/pool/{c}/{c}_0000.png,{c}\n" for c in "abc"))
    assert exit_code(lambda: label.main(["pick", "--checkpoint", str(finished_run / "best.pt"), "--pool",
                                         str(root / "pool"), "--budget", "9", "--output", str(picks), "--exclude",
                                         str(labelled)])) == 0
    monkeypatch.setenv("LABEL_STUDIO_API_KEY", token)
    auth = authorization(url)
    project = request(url, "/api/projects", auth, {"title": "imgcls round trip", "label_config":
                                                   label_config(["a", "b", "c"])})["id"]
    assert exit_code(lambda: label.main(["push", "--input", str(picks), "--url", url, "--project", str(project),
                                         "--image-root", str(root)])) == 0
    tasks = request(url, f"/api/tasks?project={project}&page_size=100", auth)["tasks"]
    assert len(tasks) == 9 and all(t["total_predictions"] == 1 for t in tasks)
    request_image = urllib.request.Request(url + tasks[0]["data"]["image"], headers={"Authorization": auth})
    with urllib.request.urlopen(request_image, timeout=30) as served:  # the local storage serves the file
        assert served.read() == Path(tasks[0]["data"]["path"]).read_bytes()
    for i, item in enumerate(tasks):  # the annotator: the folder's class, and one task skipped
        truth = Path(item["data"]["path"]).parent.name
        result = [{"from_name": "label", "to_name": "image", "type": "choices", "value": {"choices": [truth]}}]
        request(url, f"/api/tasks/{item['id']}/annotations", auth,
                {"result": [] if i == 0 else result, "was_cancelled": i == 0})
    assert exit_code(lambda: label.main(["pull", "--url", url, "--project", str(project), "--output",
                                         str(labels), "--labelled", str(labelled), "--append"])) == 0
    said = capsys.readouterr().err
    assert "wrote 11 row(s)" in said and "8 new label(s); left out: 1 skipped" in said and token not in said
    with open(labels, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 11 and all(Path(tmp_path / r["path"]).parent.name == r["label"] for r in rows)
    val = tmp_path / "val.csv"
    val_images = sorted((faults_tree / "val").rglob("*.png"))
    val.write_text("path,label\n" + "".join(f"{p},{p.parent.name}\n" for p in val_images))
    cfg = make_cfg(tmp_path, tmp_path / "run", **{"data.format": "csv", "data.train_csv": str(labels),
                                                 "data.val_csv": str(val), "train.batch_size": 4, "train.epochs": 1})
    assert run(cfg) == 0 and (tmp_path / "run" / "best.pt").exists()
