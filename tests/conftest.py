"""Shared test helpers: small image-folder trees generated on the fly, and running the entry scripts."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

REPO = Path(__file__).resolve().parent.parent
# A small, fast model for tests that train; nothing is downloaded (pretrained tests write local-dir: folders).
TEST_MODEL = "resnet10t"
def source_files(root: Path = REPO, tests: bool = True) -> list[Path]:
    """The project's Python files: the package, the top-level entry shims, docs/'s examples and (`tests`) the
    test suite; never a working copy's leftovers (`pip install .` leaves build/lib/; venvs, runs/, datasets/).
    Every test that reads the code walks this list."""
    files = [*sorted((root / "imgcls").rglob("*.py")), *sorted(root.glob("*.py")),
             *sorted((root / "docs").glob("*.py"))]
    return files + (sorted((root / "tests").rglob("*.py")) if tests else [])


# The preprocessing a test's pretrained folder declares (none of it is our default)
PRETRAINED_PREPROCESSING = {"mean": [0.5, 0.4, 0.3], "std": [0.2, 0.25, 0.3], "interpolation": "bicubic",
                            "crop_pct": 0.9}


def write_pretrained_folder(folder: Path, architecture: str = "test_resnet", num_classes: int = 5, seed: int = 0,
                            label_names=None) -> dict:
    """A timm model folder (config.json + model.safetensors, written by timm's save_for_hf) that
    `local-dir:FOLDER` names, with PRETRAINED_PREPROCESSING in its pretrained_cfg and non-trivial BatchNorm
    statistics; returns its state_dict."""
    import timm
    import torch
    from timm.models import save_for_hf

    torch.manual_seed(seed)
    model = timm.create_model(architecture, num_classes=num_classes)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)
    model.pretrained_cfg = dict(model.pretrained_cfg, **PRETRAINED_PREPROCESSING)
    save_for_hf(model, str(folder), safe_serialization=True,
                model_config={"label_names": label_names} if label_names else None)
    return {k: v.clone() for k, v in model.state_dict().items()}


class HalfWriter:
    """Wraps a file opened for a checkpoint save: the first write puts half its bytes on disk, flushes them,
    then calls `then()` (which halts the process or raises), as a crash or a full disk mid-write would."""

    def __init__(self, f, then):
        self.f = f
        self.then = then

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def write(self, data):
        view = memoryview(data)
        self.f.write(view[: len(view) // 2])
        self.f.flush()
        self.then()


# ---------------------------------------------------------------- what a plain `pytest` runs, and Ctrl-C

# Tests that need more than Python (Docker, Slurm, a Label Studio server): left out unless `-m` names their marker
# (`-m container`, `-m "container or slurm"`); `.ci/run` runs them in a second pytest invocation. Named in `-m`,
# the expression alone decides.
OPT_IN_MARKERS = ("container", "slurm", "labelstudio", "litert")


def pytest_collection_modifyitems(config, items):
    asked = config.getoption("markexpr") or ""
    left_out = [marker for marker in OPT_IN_MARKERS if marker not in asked]
    dropped = [item for item in items if any(item.get_closest_marker(m) for m in left_out)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if item not in dropped]


def pytest_configure(config):
    """An xdist worker leads a process group of its own, with the processes its tests start: Ctrl-C in a
    terminal (SIGINT to the foreground group) then reaches the controller alone. Reaching a worker, it was
    taken as the stop signal of the training run a test had in-process (which saves and returns 130), so the
    test failed and the worker went on to the next one."""
    if hasattr(config, "workerinput"):
        try:
            os.setpgid(0, 0)
        except OSError:  # a session leader already leads its group
            pass


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (read from /proc), children first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(0), []):
            found.append(child)
            queue.append(child)
    return found


def pytest_keyboard_interrupt(excinfo):
    """Ctrl-C ends every process the run started, at once: the xdist workers (each its own process group),
    and whatever their tests started, in their groups or in sessions of their own (a training run a test
    pauses). Without this, the workers were asked to stop by a SIGINT to themselves, which an in-process
    training run takes as its own stop signal."""
    own_group = os.getpgid(0)
    for pid in descendants(os.getpid()):
        try:
            group = os.getpgid(pid)
            if group != own_group:
                os.killpg(group, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Payload:
    """Unpickling this calls os.system, which creates the marker file (what a hostile pickle would do,
    harmlessly): tests of files that must never be unpickled check the marker never appears."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def class_image(label: int, size=(24, 24), rng=None) -> Image.Image:
    """An RGB image whose colour pattern depends on the class, plus noise: learnable in a few steps."""
    rng = rng or np.random.default_rng(label)
    w, h = size
    base = np.zeros((h, w, 3), dtype=np.float64)
    base[..., label % 3] = 200
    if label >= 3:
        base[: h // 2, :, (label + 1) % 3] = 180
    noise = rng.normal(0, 20, size=(h, w, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


def make_tree(root: Path, counts: dict, splits=("train", "val"), size=(24, 24), ext=".png", seed=0) -> Path:
    """root/<split>/<class>/<i>.png; `counts` maps class name -> images per split (int or (train, val))."""
    rng = np.random.default_rng(seed)
    for label, (name, n) in enumerate(sorted(counts.items())):
        per_split = n if isinstance(n, (tuple, list)) else (n,) * len(splits)
        for split, k in zip(splits, per_split):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(k):
                class_image(label, size, rng).save(folder / f"{name}_{i:04d}{ext}")
    return root


@pytest.fixture
def tiny_tree(tmp_path) -> Path:
    """3 classes, 16 train / 6 val images each, 24x24 PNGs."""
    return make_tree(tmp_path / "data", {"a": (16, 6), "b": (16, 6), "c": (16, 6)})


@pytest.fixture(scope="session")
def three_class_jpegs(tmp_path_factory) -> Path:
    """3 classes x 4 train / 2 val JPEGs, 16 px: data for the tests that read a tree and train nothing."""
    return make_tree(tmp_path_factory.mktemp("jpegs") / "tree", {"a": (4, 2), "b": (4, 2), "c": (4, 2)},
                     size=(16, 16), ext=".jpg")


@pytest.fixture(autouse=True)
def root_logging_restored():
    """In-process runs set up their own log handlers (train.log, and stderr as captured for that test): each
    test ends with the root logger as it found it, so a later test never logs into a closed capture."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


@pytest.fixture(autouse=True)
def fresh_cpu_policy():
    """Tests that call run_main in-process may leave OpenMP's wait in os.environ (which later subprocesses
    would read as the user's) and the start load in `imgcls.compute.cpu_tuning`: each test starts without them."""
    import imgcls.compute.cpu_tuning as cpu_tuning

    saved = {key: os.environ.get(key) for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    started = cpu_tuning.process_start()
    yield
    cpu_tuning._process_start = started  # what an in-process run_main chose stays with its test
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def tiny_overrides(data_root: Path, out_dir: Path, **extra) -> list[str]:
    """Overrides that make a training run take seconds on a CPU."""
    values = {
        "data.root": str(data_root), "output.dir": str(out_dir), "model.name": TEST_MODEL,
        "data.img_size": 16, "data.num_workers": 0, "train.batch_size": 8, "train.epochs": 2,
        "train.amp": "none", "train.device": "cpu", "schedule.warmup_epochs": 0.5, "optim.lr": 0.05,
        "output.log_interval": 2, "output.progress_bar": "off",
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def wait_for(proc: subprocess.Popen, ready, what: str, timeout: float = 240) -> None:
    """Poll until `ready()` while `proc` (started in its own session) runs; fail with its output if it ends
    first, and kill its process group if the wait times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            stream = proc.stderr or proc.stdout
            output = stream.read()[-3000:] if stream else ""
            pytest.fail(f"the run ended (exit {proc.returncode}) before {what}:\n{output}")
        if ready():
            return
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"timed out waiting for {what}")


def run_script(script: str, *args: str, cwd: Path | None = None, timeout: int = 300, env=None) -> subprocess.CompletedProcess:
    """Run an entry script (train.py, eval.py, ...) in a subprocess and capture its output."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    full_env.update(env or {})
    return subprocess.run([sys.executable, str(REPO / script), *args], cwd=cwd or REPO, capture_output=True,
                          text=True, timeout=timeout, env=full_env)


def export_in_process(checkpoint: Path, out: Path, fmt: str, *options: str) -> str:
    """export.py --format `fmt` in this process (no second start-up of torch and the format's runtime); the lines
    it printed."""
    import contextlib
    import io

    import export

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert export.main(["--checkpoint", str(checkpoint), "--format", fmt, "--output", str(out), *options]) == 0
    return printed.getvalue()


def train_tiny(base: Path, counts: dict, **extra) -> tuple[Path, Path]:
    """One tiny training run on a generated tree under `base` (1 epoch unless `extra` says otherwise), for a
    module-scoped fixture: (data root, best.pt)."""
    data = make_tree(base / "data", counts)
    run_dir = base / "run"
    result = run_script("train.py", "--config", "base", *tiny_overrides(data, run_dir, **{"train.epochs": 1, **extra}))
    assert result.returncode == 0, result.stderr[-2000:]
    return data, run_dir / "best.pt"


# ---------------------------------------------------------------- in-process runs and exit codes

# Training runs in-process (no loader workers), so faults can be injected with monkeypatch
IN_PROCESS = {"model.name": "test_resnet", "output.tensorboard": "false", "output.log_interval": 100}


def make_cfg(data_root: Path, out: Path, **extra):
    from imgcls.config import load_config

    return load_config("base", tiny_overrides(data_root, out, **(IN_PROCESS | extra)))


def exit_code(fn) -> int:
    """The exit status of `fn` run as an entry script's main (cli.run_main's mapping)."""
    from imgcls.cli import run_main

    with pytest.raises(SystemExit) as info:
        run_main(fn)
    return info.value.code


def run_train_in_process(monkeypatch, capsys, *argv) -> tuple[int, str]:
    """train.py's main through the same exit-code mapping, without a subprocess."""
    import train
    from imgcls.cli import run_main

    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    with pytest.raises(SystemExit) as exit_info:  # its log handlers go at teardown (root_logging_restored)
        run_main(train.main)
    return exit_info.value.code, capsys.readouterr().err




@pytest.fixture
def trainer_of():
    """Builds Trainers over runs (`imgcls.training.trainer.open_trainer`), whose resources are released at the
    test's end: `trainer = trainer_of(cfg, resume=..., finetune=...)`."""
    import contextlib

    from imgcls.training.trainer import open_trainer

    with contextlib.ExitStack() as stack:
        yield lambda cfg, **kwargs: stack.enter_context(open_trainer(cfg, **kwargs))


@pytest.fixture(scope="session")
def faults_tree(tmp_path_factory) -> Path:
    """36 training images, batch 8: 4 optimizer steps per epoch."""
    return make_tree(tmp_path_factory.mktemp("faults") / "data", {"a": (12, 3), "b": (12, 3), "c": (12, 3)})


@pytest.fixture(scope="session")
def finished_run(faults_tree, tmp_path_factory) -> Path:
    """A 2-epoch in-process run on `faults_tree`: last.pt (step 8), last.prev.pt (step 4), best.pt. Tests
    read it or copy it; none changes it."""
    from imgcls.training.trainer import run

    out = tmp_path_factory.mktemp("finished") / "run"
    assert run(make_cfg(faults_tree, out)) == 0
    return out
