"""torchrun launchers for the multi-node tests: two launchers on 127.0.0.1 as two nodes of one c10d
rendezvous, and the one-node run of the same world size they must equal. The flags here are the ones
deploy/slurm/train.sbatch and deploy/kubernetes/pytorchjob.yaml pass (tests/faults/test_multinode.py checks
that they stay the same)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from conftest import REPO

# what torchrun forwards to the workers: its default four, and Slurm's warning before the time limit
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
# how long torchrun waits for its processes to save and exit after passing a signal on (30 s by default)
SHUTDOWN_TIMEOUT_S = 100
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
TIMEOUT = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_flags(nnodes: int, nproc: int, endpoint: str, run_id: str, max_restarts: int) -> list[str]:
    """torchrun's flags for one node of a c10d rendezvous (the names the deploy files use). No --node-rank:
    the c10d rendezvous numbers the nodes itself (torchrun ignores the flag there, and says so)."""
    return ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
            "--max-restarts", str(max_restarts), "--signals-to-handle", SIGNALS_TO_HANDLE,
            "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]


def torchrun(flags: list[str], train_args: list[str], script: list[str] | None = None,
             env: dict | None = None) -> subprocess.Popen:
    """One launcher in its own process group, its output (and its workers') in a file: workers that outlive a
    launcher that died would hold a pipe open, and a test reading it would wait for them."""
    command = [sys.executable, "-m", "torch.distributed.run", *flags, *(script or [str(REPO / "train.py")]),
               *train_args]
    output = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(command, cwd=REPO, env=dict(ENV, **(env or {})), stdout=output,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    proc.output = output
    return proc


def output_of(proc: subprocess.Popen) -> str:
    proc.output.seek(0)
    return proc.output.read()


def finish(procs: list[subprocess.Popen], timeout: float = TIMEOUT) -> list[tuple[int, str]]:
    """(exit status, output) of each launcher; all of them are killed (with their workers) on a timeout."""
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
        return [(proc.returncode, output_of(proc)) for proc in procs]
    finally:
        for proc in procs:
            kill_group(proc)


def kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def two_nodes(train_args_of_node, run_id: str, max_restarts: int = 0) -> list[tuple[int, str]]:
    """Two launchers as two nodes (one process each) on a fresh 127.0.0.1 port; `train_args_of_node(n)`
    gives the n-th launcher's train.py arguments (which of them becomes global rank 0 is the rendezvous's
    choice)."""
    endpoint = f"127.0.0.1:{free_port()}"
    procs = [torchrun(node_flags(2, 1, endpoint, run_id, max_restarts), train_args_of_node(node)) for node in (0, 1)]
    return finish(procs)


def one_node(train_args: list[str], nproc: int = 2, max_restarts: int = 0, script: list[str] | None = None,
             run_id: str = "one-node") -> subprocess.Popen:
    flags = node_flags(1, nproc, f"127.0.0.1:{free_port()}", run_id, max_restarts)
    return torchrun(flags, train_args, script=script)


def files_of(run_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
