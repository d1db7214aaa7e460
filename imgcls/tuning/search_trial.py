"""One trial of a search: train.py (or torchrun train.py) in a child process training into the trial's
directory, watched through the run's own metrics.csv. After each epoch's row the study decides whether to
prune; a pruning decision stops the child as a SIGTERM does (last.pt saved, exit 143), so the trial's run is
train.py's run, cut short. Every start is `--resume auto`: a trial interrupted earlier continues from its
last.pt (bitwise, as train.py resumes), a new one starts afresh."""
from __future__ import annotations

import csv
import io
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often metrics.csv is read while the trial trains
PR_SET_PDEATHSIG = 1


@dataclass
class TrialOutcome:
    exit_code: int
    pruned_epoch: Optional[int] = None  # the epoch after which the study pruned the trial
    signum: Optional[int] = None  # a stop signal the study received while the trial ran
    seconds: float = 0.0


@dataclass
class StopRequest:
    """A stop signal the study process received (SIGTERM, SIGINT, SIGUSR1), passed on to a running trial."""
    signum: Optional[int] = None
    child: Optional[subprocess.Popen] = field(default=None, repr=False)

    def handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            log.warning("received %s: the running trial saves its last.pt and stops; the same command continues "
                        "the study", signal.Signals(signum).name)
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)


def epoch_values(path: Path, column: str) -> list[tuple[int, float]]:
    """(epoch, value) of each complete metrics.csv row that has `column` (an epoch without validation has
    none); a row being written (no newline yet) is left for the next read."""
    try:
        text = path.read_text()
    except OSError:
        return []
    text = text[: text.rfind("\n") + 1]
    rows = []
    for row in csv.DictReader(io.StringIO(text)):
        value, epoch = row.get(column), row.get("epoch")
        if value not in (None, "") and epoch:
            rows.append((int(epoch), float(value)))
    return rows


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the study process dies (SIGKILL too), so an orphaned trial saves
    its last.pt and lets its directory go instead of training on unseen."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def forget_unsaved_rows(run_dir: Path) -> None:
    """A trial without last.pt starts afresh: metrics.csv rows of an earlier start are not its epochs."""
    if not any((run_dir / name).exists() for name in ("last.pt", "last.prev.pt")):
        (run_dir / "metrics.csv").unlink(missing_ok=True)


def run_trial(command: list[str], run_dir: Path, column: str, on_epoch: Callable[[int, float], bool],
              stop: StopRequest, env: Optional[dict] = None) -> TrialOutcome:
    """Run `command` (which trains into `run_dir`) to its end; `on_epoch(epoch, value)` is called once per new
    validated epoch, in order, until it answers True (prune): then the child is stopped with SIGTERM."""
    run_dir.mkdir(parents=True, exist_ok=True)
    forget_unsaved_rows(run_dir)
    started = time.perf_counter()
    outcome = TrialOutcome(exit_code=0)
    with (run_dir / "output.log").open("a") as output:
        child = subprocess.Popen(command, env={**os.environ, **(env or {})}, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        stop.child = child
        if stop.signum is not None:  # a signal came between the trials' start and here
            child.send_signal(signal.SIGTERM)
        try:
            seen: set[int] = set()
            while True:
                code = child.poll()
                if outcome.pruned_epoch is None and stop.signum is None:
                    outcome.pruned_epoch = _report_new(run_dir / "metrics.csv", column, seen, on_epoch)
                    if outcome.pruned_epoch is not None and code is None:
                        child.send_signal(signal.SIGTERM)
                if code is not None:
                    break
                time.sleep(POLL_S)
        finally:
            stop.child = None
            if child.poll() is None:  # an error in the study itself: the trial must not train on alone
                child.send_signal(signal.SIGTERM)
                child.wait()
    outcome.exit_code = child.returncode
    outcome.signum = stop.signum
    outcome.seconds = time.perf_counter() - started
    return outcome


def _report_new(path: Path, column: str, seen: set[int], on_epoch) -> Optional[int]:
    """Hand the epochs not seen yet to `on_epoch`; the epoch it pruned after, or None."""
    for epoch, value in epoch_values(path, column):
        if epoch in seen:
            continue
        seen.add(epoch)
        if on_epoch(epoch, value):
            return epoch
    return None
