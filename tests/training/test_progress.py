"""What a run shows with the tqdm bar on: the same step lines in train.log as without it, log records on
lines of their own above the bar, the epoch count and data wait on the bar, a validation bar, and a step
line plus TensorBoard step scalars at each epoch's last step when the epoch is shorter than the interval."""
from __future__ import annotations

import contextlib
import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest
from conftest import REPO, make_tree, tiny_overrides

from imgcls.config import load_config
from imgcls.training.trainer import run

TIMESTAMP = re.compile(r"^\d\d:\d\d:\d\d (INFO|WARNING|ERROR) ")


@pytest.fixture(scope="module")
def bar_run(tmp_path_factory):
    """2 epochs of 6 steps with the bar forced on and log_interval 50 (longer than an epoch)."""
    base = tmp_path_factory.mktemp("progress")
    data = make_tree(base / "data", {"a": (16, 6), "b": (16, 6), "c": (16, 6)})
    out = base / "run"
    cfg = load_config("base", tiny_overrides(data, out, **{"output.progress_bar": "true", "output.log_interval": 50}))
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        assert run(cfg) == 0
    return out, stderr.getvalue()


def step_lines(run_dir) -> list[str]:
    return re.findall(r"INFO (step \d+/\d+) ", (run_dir / "train.log").read_text())


@pytest.mark.slow
def test_short_epochs_log_their_last_step_in_train_log_with_the_bar_on(bar_run):
    out, _ = bar_run
    assert step_lines(out) == ["step 6/12", "step 12/12"]


@pytest.mark.slow
def test_short_epochs_get_step_scalars_in_tensorboard(bar_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = bar_run
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/data_wait_frac", "train/samples_per_s"):
        assert [e.step for e in events.Scalars(tag)] == [6, 12], tag


@pytest.mark.slow
def test_the_bar_carries_the_epoch_count_and_data_wait_and_log_lines_stand_alone(bar_run):
    out, stderr = bar_run
    assert "epoch 1/2:" in stderr and "epoch 2/2:" in stderr
    assert re.search(r"loss \d\.\d{4}, data wait \d+%", stderr)
    assert "epoch 1/2 validation:" in stderr and "epoch 2/2 validation:" in stderr
    # tqdm draws the bar as "\r<bar>" without a newline; a log record written straight to the stream would
    # continue the bar's line. Redirected through tqdm, the bar is cleared first, so the text after the
    # line's last "\r" is the record alone.
    records = [line.rsplit("\r", 1)[-1] for line in stderr.split("\n") if re.search(r" (INFO|WARNING) ", line)]
    assert any("INFO step 6/12" in r for r in records) and any("INFO epoch 2/2: validating" in r for r in records)
    assert all(TIMESTAMP.match(r) for r in records), [r for r in records if not TIMESTAMP.match(r)]
    # the console shows the records of train.log (which later readers in this process may append to), no more
    assert (out / "train.log").read_text().splitlines()[:len(records)] == records
    assert "INFO done: " in records[-1]


@pytest.mark.slow
def test_on_a_real_terminal_auto_shows_the_bar_and_train_log_keeps_the_step_lines(tmp_path):
    """`output.progress_bar: auto` with stderr on a pseudo-terminal, as a user's shell gives it."""
    data = make_tree(tmp_path / "data", {"a": (8, 2), "b": (8, 2)})
    out = tmp_path / "run"
    overrides = tiny_overrides(data, out, **{"output.progress_bar": "auto", "output.log_interval": 50,
                                             "train.epochs": 1, "output.tensorboard": "false"})
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24 x 100, as a window has
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), "--config", "base", *overrides], cwd=REPO,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave, env=env)
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    assert proc.wait(timeout=300) == 0
    terminal = b"".join(chunks).decode(errors="replace")
    assert re.search(r"epoch 1/1: +\d+%\|", terminal)  # the bar was drawn
    assert step_lines(out) == ["step 2/2"]  # 16 images, batch 8: the epoch's last step, logged
