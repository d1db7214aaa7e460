"""train.py that halts at a chosen point so a test can SIGKILL it there (used by tests/test_resume.py).

python tests/paused_train.py MARKER validate:N -- TRAIN ARGS   halt inside the N-th validation pass
python tests/paused_train.py MARKER save:N -- TRAIN ARGS       halt halfway through writing the N-th last.pt
python tests/paused_train.py MARKER after_save:N -- TRAIN ARGS halt just after the N-th last.pt is in place
                                                                  (in an epoch end's background write: the whole
                                                                  process stops there, SIGSTOP)
python tests/paused_train.py MARKER wait_signal:N -- TRAIN ARGS after the N-th last.pt, wait for a signal
                                                                  (SIGTERM / SIGINT), then carry on
python tests/paused_train.py MARKER val_signal:N -- TRAIN ARGS  in the N-th validation pass, the first file read
                                                                  waits for a signal (SIGTERM / SIGINT)
python tests/paused_train.py MARKER block_read:N -- TRAIN ARGS  in the N-th validation pass, every file read
                                                                  blocks (on a FIFO, as a hung file system
                                                                  would); then a signal must still stop the run

Killed between two saves, a run leaves the same files whatever instant it dies at, so these points
(plus one inside a save) cover every kill moment.

At the halt it writes MARKER and sleeps; the test kills it. Everything else is the real train.py. A worker
group that torchrun restarted (TORCHELASTIC_RESTART_COUNT > 0) or a job that Slurm requeued
(SLURM_RESTART_COUNT > 0) does not halt: it is the continuation the test checks.
"""
import os
import signal
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def halt(marker: str) -> None:
    Path(marker).write_text(str(os.getpid()))
    if threading.current_thread() is not threading.main_thread():
        # in a background checkpoint write (an epoch end's): the whole run stops here, not just the writer
        os.kill(os.getpid(), signal.SIGSTOP)
    while True:
        time.sleep(60)


def pause_in_validation(marker: str, n: int) -> None:
    import imgcls.training.trainer as trainer
    from imgcls.compute.distributed import StopSignal

    real_evaluate = trainer.evaluate
    calls = {"n": 0}

    def evaluate(model, loader, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            next(iter(loader))  # validation has started: the first batch is loaded
            halt(marker)
        return real_evaluate(model, loader, *args, **kwargs)

    trainer.evaluate = evaluate


def wait_for_signal_after_save(marker: str, n: int) -> None:
    import imgcls.training.trainer as trainer
    from imgcls.compute.distributed import StopSignal

    real_handle = StopSignal._handle
    got = []

    def handle(self, signum, frame):
        got.append(signum)
        real_handle(self, signum, frame)

    StopSignal._handle = handle

    def wait(_marker):
        Path(marker).write_text(str(os.getpid()))
        while not got:
            time.sleep(0.01)

    pause_after_save(marker, n, at_pause=wait)


def pause_after_save(marker: str, n: int, at_pause=halt) -> None:
    import imgcls.training.checkpoints as checkpoint
    import imgcls.training.checkpoints as checkpointer

    real_save = checkpoint.save_atomic
    calls = {"n": 0}

    def save_atomic(obj, path, keep_previous=False):
        real_save(obj, path, keep_previous)
        if Path(path).name == "last.pt":
            calls["n"] += 1
            if calls["n"] == n:
                at_pause(marker)

    checkpoint.save_atomic = save_atomic
    checkpointer.save_atomic = save_atomic


def pause_in_save(marker: str, n: int) -> None:
    from conftest import HalfWriter

    import imgcls.training.checkpoints as checkpoint

    real_save = checkpoint.save_atomic
    real_fdopen = os.fdopen
    calls = {"n": 0}

    def save_atomic(obj, path, keep_previous=False):
        if Path(path).name == "last.pt":
            calls["n"] += 1
            if calls["n"] == n:
                checkpoint.os.fdopen = lambda fd, mode="r", *a, **k: HalfWriter(real_fdopen(fd, mode, *a, **k),
                                                                                 lambda: halt(marker))
        return real_save(obj, path, keep_previous)

    checkpoint.save_atomic = save_atomic
    import imgcls.training.checkpoints as checkpointer

    checkpointer.save_atomic = save_atomic


def block_reads_in_validation(marker: str, n: int) -> None:
    """From the N-th validation pass on, every validation item opens a FIFO that nobody writes (in the loader
    workers, which fork after this patch): the read blocks until the process is ended. The FIFO appears when
    the N-th epoch's training starts, before the validation workers (started during its last step) read;
    MARKER is written when the pass starts in the main process, which then waits on those reads."""
    import imgcls.data.datasets as datasets
    import imgcls.training.trainer as trainer
    from imgcls.compute.distributed import StopSignal

    fifo = Path(marker).with_name(Path(marker).name + ".fifo")
    real_getitem = datasets.EvalDataset.__getitem__
    real_train_epoch, real_evaluate = trainer.Trainer.train_epoch, trainer.evaluate
    calls = {"epochs": 0, "passes": 0}

    def getitem(self, i):
        if fifo.exists():
            with open(fifo, "rb") as f:  # blocks: no writer ever opens it
                f.read()
        return real_getitem(self, i)

    def train_epoch(self, *args, **kwargs):
        calls["epochs"] += 1
        if calls["epochs"] == n:
            os.mkfifo(fifo)
        return real_train_epoch(self, *args, **kwargs)

    def evaluate(*args, **kwargs):
        calls["passes"] += 1
        if calls["passes"] == n:
            Path(marker).write_text(str(os.getpid()))
        return real_evaluate(*args, **kwargs)

    datasets.EvalDataset.__getitem__ = getitem
    trainer.Trainer.train_epoch = train_epoch
    trainer.evaluate = evaluate


def wait_for_signal_in_validation(marker: str, n: int) -> None:
    """The first file read of the N-th validation pass (in this process: run with data.num_workers=0) writes
    MARKER and waits until the process has received a stop signal; then validation goes on."""
    import imgcls.data.datasets as datasets
    import imgcls.training.trainer as trainer
    from imgcls.compute.distributed import StopSignal

    real_handle, real_getitem, real_evaluate = StopSignal._handle, datasets.EvalDataset.__getitem__, trainer.evaluate
    got, calls = [], {"n": 0, "waited": False}

    def handle(self, signum, frame):
        got.append(signum)
        real_handle(self, signum, frame)

    def getitem(self, i):
        if calls["n"] == n and not calls["waited"]:
            calls["waited"] = True
            Path(marker).write_text(str(os.getpid()))
            while not got:
                time.sleep(0.01)
        return real_getitem(self, i)

    def evaluate(model, loader, *args, **kwargs):
        calls["n"] += 1
        return real_evaluate(model, loader, *args, **kwargs)

    StopSignal._handle = handle
    datasets.EvalDataset.__getitem__ = getitem
    trainer.evaluate = evaluate


if __name__ == "__main__":
    marker, point = sys.argv[1], sys.argv[2]
    assert sys.argv[3] == "--"
    kind, n = point.split(":")
    # a group torchrun restarted, or a job Slurm requeued, runs on to the end
    restarted = any(os.environ.get(name, "0") not in ("", "0")
                    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))
    if not restarted:
        {"validate": pause_in_validation, "save": pause_in_save, "after_save": pause_after_save,
         "wait_signal": wait_for_signal_after_save, "block_read": block_reads_in_validation,
         "val_signal": wait_for_signal_in_validation}[kind](marker, int(n))
    sys.argv = [str(REPO / "train.py"), *sys.argv[4:]]
    import train
    from imgcls.cli import run_main

    run_main(train.main)
