"""A real `mlflow server` for the tracking tests: SQLite backend, artifacts served from a folder, on
127.0.0.1 at a free port. It runs in its own process group under a watchdog shell that ends the group when
the test process goes away, so it never outlives the tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

STARTUP_S = 420  # a loaded 2-core machine needs minutes for the server's imports and database set-up


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    def __init__(self, folder: Path, port: int | None = None):
        self.folder, self.port = folder, port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "MlflowServer":
        mlflow = Path(sys.executable).with_name("mlflow")
        server = (f"'{mlflow}' server --backend-store-uri 'sqlite:///{self.folder}/mlflow.db' --artifacts-destination "
                  f"'{self.folder}/artifacts' --host 127.0.0.1 --port {self.port} --workers 1")
        watchdog = (f"{server} & while kill -0 {os.getpid()} 2>/dev/null && kill -0 $! 2>/dev/null; do sleep 1; "
                    f"done; kill -KILL 0")
        log = (self.folder / "server.log").open("a")
        # MLflow 3's server also starts job consumers (huey, for its GenAI jobs) that poll all the time: 10
        # processes and 7 CPU-s per 30 s on an idle server, against 2 and under 1 without; tracking never uses them
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        self.proc = subprocess.Popen(["bash", "-c", watchdog], cwd=self.folder, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"mlflow server ended: {(self.folder / 'server.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=5) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1)
        self.kill()
        pytest.fail("mlflow server did not answer within its start-up time")

    def kill(self) -> None:
        """SIGKILL the server and its workers (as a crashed host would go)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
