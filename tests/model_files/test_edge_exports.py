"""export.py --format executorch: the checks of executorch_checks.py in a pytest process of their own (as the
OpenVINO checks run: a native runtime's thread pool never lives in a worker of the suite that goes on to fork).
The --format litert checks (litert_checks.py) need the [litert] extra, which [all] leaves out: marker litert, run by
.ci/run's second part once it has added the extra (docs/edge.md)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO


def run_checks(name: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(REPO / "tests" / "model_files" / name)], cwd=REPO,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


@pytest.mark.slow
def test_the_executorch_checks_pass_in_a_process_of_their_own():
    run_checks("executorch_checks.py")


@pytest.mark.litert
def test_the_litert_checks_pass_in_a_process_of_their_own():
    run_checks("litert_checks.py")
