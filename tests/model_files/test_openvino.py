"""export.py --format openvino: the checks of openvino_checks.py in a pytest process of their own (OpenVINO's
runtime never loads in a worker of the suite: a worker that had loaded it crashed with SIGSEGV at a later
fork), and SIGTERM during an int8 export."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from conftest import REPO, train_tiny, wait_for


@pytest.mark.slow
def test_the_openvino_checks_pass_in_a_process_of_their_own():
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           str(REPO / "tests" / "model_files" / "openvino_checks.py")], cwd=REPO,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


@pytest.mark.slow
def test_sigterm_mid_int8_export_exits_143_and_leaves_nothing(tmp_path):
    _, checkpoint = train_tiny(tmp_path / "run", {name: (8, 6) for name in ("a", "b", "c")},
                               **{"data.img_size": 32})
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(REPO / "export.py"), "--checkpoint", str(checkpoint), "--format",
                             "openvino", "--quantize", "int8", "--output", str(out / "ir")], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    # the fp32 IR staged (OpenVINO loaded): the signal lands in the int8 step, not in the import
    wait_for(proc, lambda: out.is_dir() and any(out.rglob("model.xml")), "the staged fp32 IR")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert list(out.iterdir()) == []


