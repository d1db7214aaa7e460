"""export.py --format executorch: the checks of executorch_checks.py in a pytest process of their own (as the
OpenVINO checks run: a native runtime's thread pool never lives in a worker of the suite that goes on to fork).
The --format litert checks (litert_checks.py) need the [litert] extra, which [all] leaves out: they run where it is
installed (docs/edge.md)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO


@pytest.mark.slow
def test_the_executorch_checks_pass_in_a_process_of_their_own():
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(REPO / "tests" / "model_files" / "executorch_checks.py")], cwd=REPO,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
