"""The container, built and run as users run it (marker `container`; needs a running Docker daemon, which
.ci/run installs and starts): the training image and the slim serving image built on the stand-in bases
(docker/build-standin-base.sh: Debian's packages and PyPI, for machines without Docker Hub); the quickstart
for one epoch with --network none as uid 1000 on bind-mounted runs/ and datasets/ folders the host reads
afterwards; eval.py and infer.py on the result; `docker stop` during training saves last.pt and exits 143
and `train.py --resume` finishes the run; serve.py published on 127.0.0.1 only answers /health and
/predict and drains on `docker stop` (exit 0); the slim image holds no torch, is under 600 MB and serves
the same rows as the full image on the same ONNX exports (fp32, int8).

IMGCLS_CONTAINER_FIGURES=FILE writes the measured figures (build times, image sizes, served img/s) as JSON.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import requests
import torch
from conftest import REPO
from served_rows import assert_same_rows

from imgcls.benchmarking.serve_load import run_load

# the first test also builds the bases and images (minutes; a cold stand-in base, ~15 min): pytest.ini's 600 s
# per test is too short for it
pytestmark = [pytest.mark.container, pytest.mark.slow, pytest.mark.timeout(3600)]

TORCH_BASE = "imgcls-standin/pytorch:2.14.1-cuda13.0-cudnn9-runtime"
SLIM_BASE = "imgcls-standin/python:3.11-slim"
IMAGE = "imgcls:container-test"
SERVE_IMAGE = "imgcls-serve:container-test"
SLIM_LIMIT_BYTES = 600_000_000
APP_UID = 1000
PROB_TOLERANCE = 1e-5
LOAD_REQUESTS, LOAD_CLIENTS = 200, 4   # the served img/s figure: a bounded closed loop from the host
FIGURES: dict = {}


def docker(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check:
        assert result.returncode == 0, f"docker {' '.join(args)}: exit {result.returncode}\n{result.stderr[-3000:]}"
    return result


def timed_build(target: str, tag: str) -> float:
    start = time.perf_counter()
    docker("build", "--build-arg", f"BASE_IMAGE={TORCH_BASE}", "--build-arg", f"SERVE_BASE_IMAGE={SLIM_BASE}",
           "--target", target, "-t", tag, str(REPO), timeout=1800)
    return round(time.perf_counter() - start, 1)


@pytest.fixture(scope="module")
def images():
    """The stand-in bases (kept when their tags exist), then both images; each build is timed, and the
    second build of the same tree, from the cache, too."""
    if shutil.which("docker") is None or docker("info", check=False, timeout=60).returncode != 0:
        pytest.fail("no Docker daemon: apt-get install docker.io and start dockerd (.ci/run does both), or "
                    "leave out -m container (a plain pytest run does)")
    result = subprocess.run([str(REPO / "docker" / "build-standin-base.sh")], capture_output=True, text=True,
                            timeout=3600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    FIGURES["build_s"] = {"train": timed_build("train", IMAGE), "serve": timed_build("serve", SERVE_IMAGE)}
    FIGURES["cached_build_s"] = {"train": timed_build("train", IMAGE), "serve": timed_build("serve", SERVE_IMAGE)}
    FIGURES["image_bytes"] = {tag: int(docker("image", "inspect", "-f", "{{.Size}}", tag).stdout)
                              for tag in (IMAGE, SERVE_IMAGE)}
    yield
    out = os.environ.get("IMGCLS_CONTAINER_FIGURES")
    if out:
        Path(out).write_text(json.dumps(FIGURES, indent=2) + "\n")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, images):
    """Host folders bind-mounted as /app/runs and /app/datasets, owned by the image's uid 1000."""
    root = tmp_path_factory.mktemp("container")
    for name in ("runs", "datasets"):
        (root / name).mkdir()
        os.chown(root / name, APP_UID, APP_UID)
    return root


def mounts(workspace: Path) -> list[str]:
    return ["-v", f"{workspace / 'runs'}:/app/runs", "-v", f"{workspace / 'datasets'}:/app/datasets"]


def run_in_image(workspace: Path, *command: str, image: str = IMAGE,
                 timeout: float = 900) -> subprocess.CompletedProcess:
    """`docker run` without a network, as the image's user, the workspace mounted; its exit status."""
    return docker("run", "--rm", "--network", "none", "--shm-size", "1g", *mounts(workspace), image, *command,
                  timeout=timeout, check=False)


def start_container(workspace: Path, *command: str, image: str = IMAGE, publish: bool = False) -> str:
    name = f"imgcls-test-{uuid.uuid4().hex[:10]}"
    network = ["-p", "127.0.0.1::8000"] if publish else ["--network", "none"]
    docker("run", "-d", "--name", name, "--shm-size", "1g", *network, *mounts(workspace), image, *command)
    return name


def stop_and_wait(name: str) -> tuple[int, str]:
    """`docker stop` (SIGTERM, then SIGKILL after 60 s), the container's exit status and its log."""
    docker("stop", "-t", "60", name, timeout=120)
    code = int(docker("wait", name, timeout=120).stdout.strip())
    log = docker("logs", name, check=False).stderr + docker("logs", name, check=False).stdout
    docker("rm", name, check=False)
    return code, log


def wait_until(ready, what: str, name: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        state = docker("inspect", "-f", "{{.State.Running}}", name, check=False).stdout.strip()
        if state == "false":
            log = docker("logs", name, check=False)
            pytest.fail(f"{name} ended before {what}:\n{(log.stdout + log.stderr)[-3000:]}")
        time.sleep(0.5)
    log = docker("logs", name, check=False)
    docker("rm", "-f", name, check=False)
    pytest.fail(f"timed out waiting for {what}:\n{(log.stdout + log.stderr)[-3000:]}")


@pytest.fixture(scope="module")
def quickstart(workspace):
    """The quickstart, one epoch, in the image: no network, uid 1000, the runs/ folder on the host."""
    start = time.perf_counter()
    result = run_in_image(workspace, "train.py", "--config", "quickstart", "train.epochs=1")
    FIGURES["quickstart_epoch_s"] = round(time.perf_counter() - start, 1)
    assert result.returncode == 0, result.stderr[-3000:]
    return workspace / "runs" / "quickstart"


def test_quickstart_trains_as_uid_1000_without_network_into_the_hosts_folder(quickstart):
    best = quickstart / "best.pt"
    assert best.stat().st_uid == APP_UID
    checkpoint = torch.load(best, weights_only=True)   # the host reads what the container wrote
    assert len(checkpoint["classes"]) == 10 and checkpoint["calibration"]["temperature"] > 0
    summary = json.loads((quickstart / "summary.json").read_text())
    assert summary["epochs_completed"] == 1 and summary["best"]["num_samples"] == 355


def test_eval_and_infer_run_on_the_result(quickstart, workspace):
    result = run_in_image(workspace, "eval.py", "--checkpoint", "runs/quickstart/best.pt", "--json",
                          "runs/quickstart/eval.json")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((quickstart / "eval.json").read_text())
    assert report["num_samples"] == 355 and 0 <= report["top1"] <= 100
    folder = sorted((workspace / "datasets" / "digits" / "val").iterdir())[3]
    result = run_in_image(workspace, "infer.py", f"datasets/digits/val/{folder.name}", "--checkpoint",
                          "runs/quickstart/best.pt", "--output", "runs/quickstart/rows.json")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((quickstart / "rows.json").read_text())
    assert len(rows) == len(list(folder.iterdir())) and all(row["label"] in [str(d) for d in range(10)]
                                                             for row in rows)


def test_docker_stop_saves_last_pt_exits_143_and_resume_finishes(workspace, images):
    run = workspace / "runs" / "stopped"
    # the quickstart, cut to 2 epochs of 6 steps of 16 images (a minute) with last.pt every 2 steps
    settings = ["--config", "quickstart", "train.epochs=2", "train.batch_size=16", "data.limit_train_batches=6",
                "data.limit_val_batches=4", "output.dir=runs/stopped", "checkpoint.every_steps=2"]
    name = start_container(workspace, "train.py", *settings)
    wait_until(lambda: (run / "last.pt").exists(), "the first last.pt", name)
    code, log = stop_and_wait(name)
    assert code == 143, log[-3000:]
    assert torch.load(run / "last.pt", weights_only=True)["step"] > 0
    result = run_in_image(workspace, "train.py", "--resume", "runs/stopped/last.pt")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epochs_completed"] == 2


def served_port(name: str) -> int:
    """The host port docker published for the container's 8000, which must be bound to 127.0.0.1 only."""
    bindings = docker("port", name, "8000").stdout.split()
    assert bindings and all(b.startswith("127.0.0.1:") for b in bindings), bindings
    return int(bindings[0].rpartition(":")[2])


def start_server(workspace: Path, checkpoint: str, image: str, *extra: str) -> tuple[str, str]:
    name = start_container(workspace, "serve.py", "--checkpoint", checkpoint, "--host", "0.0.0.0", "--port", "8000",
                           *extra, image=image, publish=True)
    url = f"http://127.0.0.1:{served_port(name)}"

    def healthy() -> bool:
        try:
            return requests.get(f"{url}/health", timeout=5).status_code == 200
        except requests.ConnectionError:
            return False
    wait_until(healthy, "/health", name)
    return name, url


def digit_bodies(workspace: Path, count: int = 24) -> list[tuple[str, bytes]]:
    files = sorted((workspace / "datasets" / "digits" / "val").rglob("*.png"))
    return [(p.name, p.read_bytes()) for p in files[::max(1, len(files) // count)][:count]]


def test_serve_answers_from_the_host_on_127_0_0_1_and_drains_on_docker_stop(quickstart, workspace):
    name, url = start_server(workspace, "runs/quickstart/best.pt", IMAGE)
    health = requests.get(f"{url}/health", timeout=30).json()
    assert health["status"] == "ok" and health["num_classes"] == 10
    for file, body in digit_bodies(workspace, 4):
        row = requests.post(f"{url}/predict", files={"file": (file, body)}, timeout=60).json()
        assert row["path"] == file and row["label"] in health["classes"] and 0 < row["prob"] <= 1
    code, log = stop_and_wait(name)
    assert code == 0, log[-3000:]
    assert "SIGTERM" in log


@pytest.fixture(scope="module")
def onnx_exports(quickstart, workspace):
    """The quickstart model exported in the image as fp32 and static int8 ONNX (any batch size)."""
    paths = {"fp32": "runs/exports/model.onnx", "int8": "runs/exports/model_int8.onnx"}  # never in a run folder
    for kind, path in paths.items():
        quantize = ["--quantize", "int8", "--calibration-images", "64", "--min-agreement", "0"] \
            if kind == "int8" else []
        result = run_in_image(workspace, "export.py", "--checkpoint", "runs/quickstart/best.pt", "--format", "onnx",
                              "--dynamic-batch", *quantize, "--output", path)
        assert result.returncode == 0, result.stderr[-3000:]
    return paths


def test_slim_image_holds_no_torch_and_is_under_600_mb(images):
    result = docker("run", "--rm", "--network", "none", SERVE_IMAGE, "-c", "import torch", check=False)
    assert result.returncode == 1 and "No module named 'torch'" in result.stderr
    assert FIGURES["image_bytes"][SERVE_IMAGE] < SLIM_LIMIT_BYTES


@pytest.mark.parametrize("kind", ["fp32", "int8"])
def test_slim_image_serves_the_full_images_rows(onnx_exports, workspace, kind):
    """The same export served by both images, with --reject (the int8 file computes no multi-layer score and
    refuses it: --reject-below by energy): the same rows (calibrated prob, reject score); then the served img/s
    of each under the same bounded load from the host."""
    bodies = digit_bodies(workspace)
    rows, rates = {}, {}
    reject = ["--reject"] if kind == "fp32" else ["--reject-below", "2.0"]
    for image in (IMAGE, SERVE_IMAGE):
        name, url = start_server(workspace, onnx_exports[kind], image, *reject)
        try:
            rows[image] = [requests.post(f"{url}/predict", files={"file": (f, b)}, timeout=60).json()
                           for f, b in bodies]
            load = run_load(url, [b for _, b in bodies], LOAD_CLIENTS, LOAD_REQUESTS)
            rates[image] = load["img_per_s"]
        finally:
            code, log = stop_and_wait(name)
        assert code == 0, log[-3000:]
    assert all("score" in row for row in rows[IMAGE])
    assert_same_rows(rows[SERVE_IMAGE], rows[IMAGE], PROB_TOLERANCE)
    FIGURES.setdefault("served_img_per_s", {})[kind] = {"full": rates[IMAGE], "slim": rates[SERVE_IMAGE],
                                                        "requests": LOAD_REQUESTS, "clients": LOAD_CLIENTS}
