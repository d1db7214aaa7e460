"""The slim serving image's contents without Docker: its requirements agree with requirements.txt, and the
files its Dockerfile stage copies run serve.py on an ONNX export with torch and torchvision unimportable,
answering the torch path's rows (and its embeddings, and the neighbours of an embed.py index) over HTTP and
exiting 0 on SIGTERM."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import requests
from conftest import REPO, train_tiny, wait_for

import imgcls.cli.embed as embed_script
import imgcls.cli.export as export_script

SERVE_REQUIREMENTS = REPO / "docker" / "requirements-serve.txt"
# the third-party modules this project's code imports, and the package that installs each (simplejpeg is left
# out: data/images.py takes it where installed and decodes with Pillow otherwise)
PACKAGE_OF = {"yaml": "pyyaml", "PIL": "pillow", "numpy": "numpy", "onnxruntime": "onnxruntime", "fastapi": "fastapi",
              "uvicorn": "uvicorn", "multipart": "python-multipart", "python_multipart": "python-multipart",
              "faiss": "faiss-cpu", "tifffile": "tifffile", "sklearn": "scikit-learn",
              "timm": "timm", "safetensors": "safetensors", "tqdm": "tqdm", "webdataset": "webdataset"}
NO_TORCH = ("import runpy, sys; sys.modules.update(torch=None, torchvision=None); "
            "sys.argv = ['serve.py', *sys.argv[1:]]; runpy.run_path('serve.py', run_name='__main__')")


def requirement_lines(path: Path) -> dict[str, str]:
    """package name (lower case) -> its requirement, comments dropped."""
    lines = {}
    for line in path.read_text().splitlines():
        requirement = line.split("#")[0].strip()
        if requirement:
            lines[re.split(r"[<>=!~ ;\[]", requirement)[0].lower()] = requirement
    return lines


def test_serve_requirements_have_the_bounds_of_requirements_txt():
    slim, full = requirement_lines(SERVE_REQUIREMENTS), requirement_lines(REPO / "requirements.txt")
    assert set(slim) == {"onnxruntime", "pillow", "numpy", "pyyaml", "fastapi", "uvicorn", "python-multipart",
                         "faiss-cpu"}
    assert {name: full[name] for name in slim} == slim
    assert not {"torch", "torchvision"} & set(slim)


def serve_stage_copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY in the Dockerfile's `serve` stage."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    stage = text.split(" AS serve")[1].split("\nFROM ")[0]
    copies = []
    for line in stage.splitlines():
        if line.startswith("COPY "):
            words = [w for w in shlex.split(line)[1:] if not w.startswith("--")]
            copies.append((words[:-1], words[-1]))
    return copies


def copy_serve_image_files(target: Path) -> None:
    for sources, destination in serve_stage_copies():
        if destination.startswith("/"):
            continue  # the requirements file
        for source in sources:
            origin, folder = REPO / source, target / destination
            if origin.is_dir():
                shutil.copytree(origin, folder, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                assert destination.endswith("/"), destination  # a file is copied into a named folder
                folder.mkdir(parents=True, exist_ok=True)
                shutil.copy(origin, folder)


def test_the_serve_stage_copies_the_shared_rows_preprocessing_and_checks_and_they_need_no_torch(tmp_path):
    """The slim server has no copies of its own: the stage copies the imgcls package, and the ONNX-only server,
    the tasks' rows, data/eval_preprocessing.py and model_files/stored_metadata.py import with torch unimportable
    (the rows modules are imported when a row is made)."""
    copy_serve_image_files(tmp_path)
    shared = ["imgcls.tasks.rows", "imgcls.data.eval_preprocessing", "imgcls.model_files.stored_metadata"]
    assert all((tmp_path / (name.replace(".", "/") + ".py")).is_file() for name in shared)
    assert not (tmp_path / "imgcls" / "serving" / "rows.py").exists()  # no copy of the tasks' rows of its own
    assert not (tmp_path / "train.py").exists()
    code = ("import importlib, sys; sys.modules.update(torch=None, torchvision=None)\n"
            f"for name in {['imgcls.serving.slim', *shared]!r}: importlib.import_module(name)\n"
            f"print(sorted(n for n in {sorted(PACKAGE_OF)!r} if sys.modules.get(n) is not None))")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=""))
    assert result.returncode == 0, result.stderr[-2000:]
    # what the copied code imports is installed in the image (PyYAML was missing once the config was read)
    imported = eval(result.stdout.strip().splitlines()[-1])
    assert {PACKAGE_OF[name] for name in imported} <= set(requirement_lines(SERVE_REQUIREMENTS)), imported


@pytest.mark.slow
def test_the_serve_stages_files_serve_an_export_without_torch(tmp_path):
    from imgcls.serving.model import ServedModel

    _, checkpoint = train_tiny(tmp_path / "train", {name: (8, 4) for name in ("a", "b", "c")})
    model = tmp_path / "model.onnx"
    assert export_script.main(["--checkpoint", str(checkpoint), "--format", "onnx", "--dynamic-batch", "--output",
                               str(model), "--embedding"]) == 0
    index = tmp_path / "vectors"
    assert embed_script.main([str(tmp_path / "train" / "data" / "val"), "--checkpoint", str(model), "--output",
                              str(index), "--num-workers", "0"]) == 0
    app = tmp_path / "app"
    app.mkdir()
    copy_serve_image_files(app)
    assert not (app / "train.py").exists() and (app / "imgcls" / "serving" / "slim.py").exists()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", NO_TORCH, "--checkpoint", str(model), "--port", "0",
                                 "--max-batch", "4", "--index", str(index)], cwd=app, stdout=log, stderr=log, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=""))
        try:
            wait_for(proc, lambda: "listening on" in log_path.read_text(), "the server listening", timeout=120)
            port = int(re.search(r"listening on http://127\.0\.0\.1:(\d+)", log_path.read_text()).group(1))
            url = f"http://127.0.0.1:{port}"
            assert requests.get(f"{url}/health", timeout=30).json()["runtime"] == "onnxruntime"
            files = sorted((tmp_path / "train" / "data" / "val").rglob("*.png"))
            torch_model = ServedModel.load(str(model), 5, 4, "cpu")
            for path in files[:6]:
                got = requests.post(f"{url}/predict", data=path.read_bytes(), timeout=60).json()
                want = torch_model.classify([torch_model.decode(path.read_bytes())], [None])[0]
                assert got["label"] == want["label"] and got["prob"] == pytest.approx(want["prob"], abs=1e-5)
            nearest = requests.post(f"{url}/similar?k=2", data=files[0].read_bytes(), timeout=60).json()["neighbours"]
            assert nearest[0]["path"] == str(files[0]) and nearest[0]["score"] == pytest.approx(1, abs=1e-5)
            vector = requests.post(f"{url}/embed", data=files[1].read_bytes(), timeout=60).json()["embedding"]
            want = torch_model.embed([torch_model.decode(files[1].read_bytes())])[0]
            assert float(np.dot(vector, want)) >= 0.999
            bad = requests.post(f"{url}/predict", data=b"not an image", timeout=60)
            assert bad.status_code == 400 and bad.json()["error"] == "not_an_image"
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            code = proc.wait(timeout=60)
    assert code == 0, log_path.read_text()[-3000:]
    assert "torch" not in log_path.read_text().replace("no torch", "")
