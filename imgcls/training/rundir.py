"""The run directory before any work: created, proven writable, and locked for one run at a time.

Rank 0 takes an exclusive POSIX record lock (`fcntl.lockf`) on `<output.dir>/.lock` and holds it until the
run ends, then removes the file (the kernel drops the lock when the process dies, so a killed run leaves an
unlocked file, never a stale lock). A record lock belongs to the process, not to the open file: the loader
workers forked from the run inherit the descriptor but not the lock, so a `kill -9` of the run frees the
directory at once, even while orphaned workers live on (an `flock` was shared with them and held until the
last one noticed). Record locks do not exclude the same process, so a second lock of one directory inside
one process is refused by a table of the directories this process holds. A second run into the same
directory exits 2 naming the holder. On a file system without locks the run warns and goes on unlocked.

A multi-node resume reads the checkpoint on every node: each must see the very file rank 0 sees, or the
ranks would start from different states (or some from none). The first process of every node describes the
files it would resume from (size and SHA-256 of the content, or absent); a node whose view differs from rank
0's stops the run (exit 2) with a message naming the path there.

The command that continues a stopped run, printed so that it works as it stands: `train.py --resume PATH`
takes the rest (the resolved config) from the checkpoint.

How a worker group that torchrun restarted (`--max-restarts`) continues its run by itself: from the run
directory's last.pt, as `--resume auto` would, without anyone typing it, and only from a last.pt this run
(the same torchrun run id) wrote. A first start is left as it is: a leftover last.pt of another run is still
refused by `claim_run_dir`.

How a run continues, and what a run directory may hold: `--resume` (which checkpoint, whether it is a
state this run can continue: config, classes, world size, data), `--finetune` (a new schedule from a
checkpoint's weights), and claiming `output.dir` for a new run."""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import logging
import os
import shlex
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

import imgcls.compute.distributed as dist_utils
from imgcls.compute.distributed import LaunchInfo, host_name
from imgcls.config import Config, config_differences
from imgcls.core.errors import CheckpointError, ConfigError
from imgcls.core.files import check_outputs_apart
from imgcls.core.safe_load import load_checkpoint
from imgcls.data.listing import fingerprint_differences
from imgcls.models.factory import load_matching_weights
from imgcls.training.state import EpochCounters, TrainState

log = logging.getLogger(__name__)


LOCK_NAME = ".lock"


_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


_HELD: set = set()  # (st_dev, st_ino) of the lock files this process holds


class RunDirLock:
    """An exclusive lock on a run directory; `release` (or the end of the process) lets it go."""

    def __init__(self, fd: int, path: Path, key: tuple):
        self.fd: Optional[int] = fd
        self.path = path
        self.key = key

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                # Removed while still locked: a run that opened the file meanwhile finds, once it has the
                # lock, that the name no longer leads to it, and starts over (`_lock_file`).
                self.path.unlink(missing_ok=True)
                fcntl.lockf(fd, fcntl.LOCK_UN)
            finally:
                _HELD.discard(self.key)
                os.close(fd)

    def __del__(self):
        try:
            self.release()
        except Exception:  # at interpreter exit the process's end drops the lock anyway
            pass


def _reason(err: OSError) -> str:
    if isinstance(err, FileExistsError):
        return "a file of that name is in the way"
    if isinstance(err, NotADirectoryError):
        return "a part of the path is a file"
    return err.strerror or type(err).__name__


def open_run_dir(run_dir: Path) -> Optional[RunDirLock]:
    """Create `run_dir`, check that files can be written there, and lock it. ConfigError (exit 2) naming the
    path and the reason when it cannot be used or another run holds it; None where locks are unsupported."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=run_dir)
        os.close(fd)
        os.unlink(probe)
        return _lock_file(run_dir)
    except OSError as err:
        raise ConfigError(f"'output.dir' = {run_dir}: cannot be used as the run directory ({_reason(err)}); "
                          f"pass an output.dir this user can write") from err


def _lock_file(run_dir: Path) -> Optional[RunDirLock]:
    path = run_dir / LOCK_NAME
    while True:
        try:  # this process holds it: a record lock would be granted again, and closing a second descriptor
            st = os.stat(path)  # of the file would drop the lock held through the first
            if (st.st_dev, st.st_ino) in _HELD:
                raise ConfigError(f"'output.dir' = {run_dir} is in use by another run "
                                  f"({path.read_text(errors='replace').strip()}); wait for it to end, stop it, "
                                  f"or pass another output.dir")
        except FileNotFoundError:
            pass
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        key = (os.fstat(fd).st_dev, os.fstat(fd).st_ino)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except (BlockingIOError, PermissionError):
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(f"'output.dir' = {run_dir} is in use by another run ({holder}); wait for it to "
                              f"end, stop it, or pass another output.dir") from None
        except OSError as err:
            os.close(fd)
            if err.errno not in _NO_LOCKS:
                raise
            log.warning("cannot lock %s (%s): this file system has no locks, so make sure no other run writes "
                        "to this output.dir", run_dir, err.strerror)
            return None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder removed the file as it ended: lock the one that is there now
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
             .encode())
    _HELD.add(key)
    return RunDirLock(fd, path, key)


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 512, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "its pid is not recorded yet"


CHUNK = 1 << 20


def resume_files(resume: Optional[str], run_dir: Path) -> list[Path]:
    """The files `--resume` may read: the named checkpoint, or for `auto` last.pt and its previous state."""
    if not resume:
        return []
    if resume == "auto":
        return [run_dir / "last.pt", run_dir / "last.prev.pt"]
    return [Path(resume)]


def file_view(path: Path) -> Optional[tuple[int, str]]:
    """(size in bytes, SHA-256 of the content) of `path`, None when it is not there."""
    try:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
        return path.stat().st_size, digest.hexdigest()
    except FileNotFoundError:
        return None


def describe_view(hostname: str, files: list[Path]) -> dict:
    """This rank's view: its host, and for each file (by name) its path here and `file_view`."""
    return {"host": hostname, "files": {path.name: (str(path), file_view(path)) for path in files}}


def view_differences(views: list[Optional[dict]]) -> list[str]:
    """One line per rank and file that it sees otherwise than rank 0 (every rank's `describe_view`, None for
    a rank that left it to its node's first process)."""
    def seen(view) -> str:
        return "absent" if view is None else f"{view[0]} bytes, sha256 {view[1][:12]}"

    reference, lines = views[0], []
    for rank, view in enumerate(views[1:], start=1):
        for name, (path, here) in (view or {"files": {}})["files"].items():
            path0, there = reference["files"].get(name, ("", None))
            if here != there:
                lines.append(f"rank {rank} on {view['host']} sees {path}: {seen(here)}; rank 0 on "
                             f"{reference['host']} sees {path0}: {seen(there)}")
    return lines


def check_same_view(views: list[Optional[dict]]) -> None:
    lines = view_differences(views)
    if lines:
        raise ConfigError("--resume: the ranks do not see the same checkpoint, so they would not continue one "
                          "state:\n  " + "\n  ".join(lines) + "\nKeep output.dir (and a --resume path) on a "
                          "file system every node shares, at the same path on every node")


def check_shared_checkpoint(resume: Optional[str], run_dir: Path, dist) -> None:
    """Under DDP with `--resume` (or a restart's auto resume): every node sees rank 0's checkpoint files, or
    every rank stops with the same ConfigError. The first process of each node reads the files for its node
    (rank 0 is one of them). Call on all ranks at the same point."""
    if not dist.enabled or not resume:
        return
    view = describe_view(host_name(), resume_files(resume, run_dir)) if dist.local_rank == 0 or dist.is_main else None
    check_same_view(dist_utils.all_gather_objects(view))

def continue_command(last_pt: Path, world_size: int = 1, script: Optional[str] = None) -> str:
    """The entry script as this process was started (torchrun with the same process count under DDP) with
    `--resume last_pt`."""
    script = script or sys.argv[0] or "train.py"
    launcher = f"torchrun --nproc_per_node {world_size}" if world_size > 1 else "python"
    return f"{launcher} {shlex.quote(script)} --resume {shlex.quote(str(last_pt))}"


# the checkpoint key that records which torchrun run wrote it
RUN_ID_KEY = "elastic_run_id"


@dataclass(frozen=True)
class ResumePlan:
    resume: Optional[str]       # what the run resumes from: --resume as typed, or "auto" after a restart
    must_own: bool = False      # the checkpoint must have been written by this torchrun run


def plan_resume(resume: Optional[str], run_dir: Path, launch: LaunchInfo) -> ResumePlan:
    """`resume` as typed on a first start; after a torchelastic restart the run directory's last.pt (or
    last.prev.pt) when there is one, else what the first start resumed from (nothing: a new run)."""
    if not launch.restarted or resume == "auto":
        if launch.restarted:
            log.info("torchelastic restart %d of run %s: --resume auto continues from %s",
                     launch.restart_count, launch.run_id, run_dir / "last.pt")
        return ResumePlan(resume)
    saved = [run_dir / name for name in ("last.pt", "last.prev.pt") if (run_dir / name).exists()]
    if not saved:
        log.info("torchelastic restart %d of run %s: no last.pt in %s yet, starting %s", launch.restart_count,
                 launch.run_id, run_dir, f"from {resume} again" if resume else "the run afresh")
        return ResumePlan(resume)
    log.warning("torchelastic restart %d of run %s: continuing from %s (a restarted group resumes by itself; "
                "no --resume needed)", launch.restart_count, launch.run_id, saved[0])
    return ResumePlan("auto", must_own=True)


def check_own_checkpoint(ckpt: Optional[dict], run_dir: Path, launch: LaunchInfo) -> None:
    """After a restart, refuse (exit 2) a last.pt that another run wrote: a first start that refused it
    (it holds another run) must not take it up on torchrun's retry."""
    if ckpt is None:
        return
    written_by = ckpt.get(RUN_ID_KEY)
    if written_by != launch.run_id:
        raise ConfigError(f"output.dir {run_dir} holds last.pt of another run (torchrun run id "
                          f"{written_by or 'none recorded'}; this is run {launch.run_id}, restart "
                          f"{launch.restart_count}), which a restarted group does not take up by itself. "
                          f"Continue that run with --resume auto, or start this one in a new output.dir=...")


def run_id_fields(launch: LaunchInfo) -> dict:
    """What last.pt records of the launch: the torchrun run id, when there is one."""
    return {RUN_ID_KEY: launch.run_id} if launch.run_id else {}


def data_source_differences(saved: Optional[dict], current: Optional[dict]) -> list[str]:
    """What --resume refuses about the data itself: another held-out split, other CSV lists. A checkpoint
    without a record (older ones) is compared by its config only."""
    if not saved or not current:
        return []
    diffs = []
    split_a, split_b = saved.get("split"), current.get("split")
    if split_a != split_b:
        def sizes(split):
            return f"{len(split['train'])} train / {len(split['val'])} val files" if split else "no split"
        diffs.append(f"data split (data.val_fraction): other files on each side ({sizes(split_a)} -> "
                     f"{sizes(split_b)}); the held-out files must stay held out")
    for key, name in (("train_csv_sha256", "data.train_csv"), ("val_csv_sha256", "data.val_csv")):
        if saved.get(key) != current.get(key):
            diffs.append(f"{name}: its files and labels differ from the list the checkpoint was trained on")
    for key, name in (("train_shards", "data.train_shards (shard names)"), ("train_samples", "training samples"),
                      ("loader_workers", "data.num_workers (a shard stream is split across loader workers)")):
        if saved.get(key) != current.get(key):
            diffs.append(f"{name}: {saved.get(key)!r} -> {current.get(key)!r}")
    return diffs


# what a last.pt must hold, with the type of each part
TRAINING_STATE_TYPES = {"model": dict, "optimizer": dict, "scheduler": dict, "scaler": dict, "rng": dict,
                        "train_state": dict, "epoch": int, "step": int, "batch_in_epoch": int}


def training_state_problems(ckpt: dict, ema: bool) -> list[str]:
    """What is missing or malformed in a last.pt's training state (an empty list for a sound one)."""
    problems = [f"'{key}' is missing" if key not in ckpt else f"'{key}' is not a {kind.__name__}"
                for key, kind in TRAINING_STATE_TYPES.items()
                if not isinstance(ckpt.get(key), kind) or isinstance(ckpt.get(key), bool)]
    if ema and not isinstance(ckpt.get("model_ema"), dict):
        problems.append("'model_ema' is missing (the run has model.ema_decay set)")
    for key in ("model", "model_ema"):
        if isinstance(ckpt.get(key), dict) and not all(isinstance(v, torch.Tensor) for v in ckpt[key].values()):
            problems.append(f"'{key}' holds values that are not tensors")
    rng = ckpt.get("rng")
    if isinstance(rng, dict):
        missing = [k for k in ("python", "numpy", "torch") if k not in rng]
        if missing:
            problems.append(f"'rng' lacks {', '.join(missing)}")
    train_state = ckpt.get("train_state")
    if isinstance(train_state, dict):
        known = {f.name for f in dataclasses.fields(TrainState)} | {"progress"}  # the snapshot's former name
        unknown = sorted(set(map(str, train_state)) - known)
        if unknown:
            problems.append(f"'train_state' has unknown keys {unknown}")
        snapshot = train_state.get("epoch_snapshot", train_state.get("progress")) or {}
        counters = {f.name for f in dataclasses.fields(EpochCounters)} | {"bad_indices"}
        if not isinstance(snapshot, dict) or set(map(str, snapshot)) - counters:
            problems.append("'train_state.epoch_snapshot' is not a saved epoch's counters")
    return problems


def check_resume_compatible(ckpt: dict, cfg: Config, classes: list[str], world_size: int,
                            data_source: Optional[dict] = None, fingerprint: Optional[dict] = None) -> None:
    """ConfigError (exit 2) listing what differs when `ckpt` is not a state this run can continue: the
    config keys the math depends on (those not marked resume-free), the classes, the process count, the
    files of each split (`fingerprint`, against the one last.pt recorded). CheckpointError (exit 2) when its
    training state is incomplete or malformed."""
    saved = ckpt.get("config")
    if not isinstance(saved, dict) or "optimizer" not in ckpt:
        raise ConfigError("--resume: this checkpoint holds no training state (is it a best.pt? use last.pt, "
                          "or --finetune to start a new schedule from its weights)")
    problems = training_state_problems(ckpt, ema=cfg.model.ema_decay is not None)
    if problems:
        raise CheckpointError("--resume: the checkpoint is damaged or was not written by this train.py: "
                              + "; ".join(problems))
    diffs = config_differences(saved, cfg.to_dict())
    if ckpt.get("classes") != classes:
        diffs.append(f"classes: {ckpt.get('classes')} -> {classes}")
    if ckpt.get("world_size", 1) != world_size:
        diffs.append(f"world size: {ckpt.get('world_size', 1)} -> {world_size}")
    diffs += data_source_differences(ckpt.get("data_source"), data_source)
    if fingerprint is not None:
        if isinstance(ckpt.get("data_fingerprint"), dict):
            diffs.extend(fingerprint_differences(ckpt["data_fingerprint"], fingerprint))
        else:
            log.info("--resume: the checkpoint records no data fingerprint (an older train.py); the files "
                     "of the splits are not compared")
    if diffs:
        raise ConfigError("--resume: the run would not continue the same training; these differ from the "
                          "checkpoint:\n  " + "\n  ".join(diffs) +
                          "\n(keep them, or pass --finetune CKPT to start a new schedule from its weights)")


def resolve_resume(resume: str, run_dir: Path) -> Optional[dict]:
    """Load the checkpoint to resume from; `auto` falls back to last.prev.pt and to a fresh start."""
    if resume != "auto":
        try:
            return load_checkpoint(resume)
        except CheckpointError as err:
            raise ConfigError(f"--resume {resume}: {err}") from err
    candidates = [run_dir / "last.pt", run_dir / "last.prev.pt"]
    if not any(p.exists() for p in candidates):
        log.info("--resume auto: no last.pt in %s, starting a new run", run_dir)
        return None
    for path in candidates:
        if not path.exists():
            continue
        try:
            ckpt = load_checkpoint(path)
        except CheckpointError as err:
            log.warning("--resume auto: %s; trying the previous state", err)
            continue
        if path.name == "last.pt":
            log.info("--resume auto: resuming from %s", path)
        else:
            log.warning("--resume auto: last.pt in %s is %s; resuming from %s (epoch %s, step %s), the state "
                        "saved before it", run_dir, "damaged" if candidates[0].exists() else "missing", path,
                        ckpt.get("epoch"), ckpt.get("step"))
        return ckpt
    raise ConfigError(f"--resume auto: no loadable checkpoint in {run_dir} (last.pt and last.prev.pt are damaged)")


def load_finetune_source(path: str) -> dict:
    try:
        return load_checkpoint(path)
    except CheckpointError as err:
        raise ConfigError(f"--finetune {path}: {err}") from err


CHECKPOINT_FILES = ("last.pt", "last.prev.pt", "best.pt")


# What output.overwrite=true deletes besides the checkpoints: every other file a run writes (train.log is
# emptied rather than deleted, as this run's log is already open on it). Nothing else in the folder is touched.
RUN_FILES = ("summary.json", "metrics.csv", "config.yaml", "batch_finder.json", "tracking_run.json")


def claim_run_dir(run_dir: Path, resume: Optional[str], overwrite: bool, is_main: bool,
                  inputs: Optional[dict] = None) -> None:
    """Before a new run writes into `run_dir` (call right after the log is set up): a folder holding another
    run's checkpoints is refused (ConfigError, exit 2) unless `output.overwrite`, which deletes that run's
    files first, after checking that none of the run's `inputs` (role -> path, `run_inputs`) lies inside.
    `--resume PATH` continues a run, and so does `--resume auto` when a last.pt is there."""
    found = [name for name in CHECKPOINT_FILES if (run_dir / name).exists()]
    resuming = resume is not None and (resume != "auto" or "last.pt" in found or "last.prev.pt" in found)
    if resuming or not found:
        return
    if overwrite:  # the same role check as infer.py / eval.py / export.py: what the run starts from stays
        existing = {role: [path] for role, path in (inputs or {}).items() if path and os.path.exists(path)}
        check_outputs_apart({}, {r: p for r, p in existing.items() if os.path.isfile(p[0])},
                            {r: p for r, p in existing.items() if os.path.isdir(p[0])},
                            {"output.dir (output.overwrite=true deletes its run files)": str(run_dir)})
    if not overwrite:
        if "last.pt" in found or "last.prev.pt" in found:
            keep = "Continue that run with --resume auto"
        else:
            keep = f"Train on from its weights with --finetune {run_dir / 'best.pt'} and a new output.dir"
        raise ConfigError(f"output.dir {run_dir} holds checkpoints of another run ({', '.join(found)}), which a new "
                          f"run would replace. {keep}, start a new run in a new output.dir=..., or pass "
                          f"output.overwrite=true to delete that run's files (checkpoints, metrics.csv, "
                          f"summary.json, TensorBoard events, train.log) and start afresh here")
    if not is_main:
        return
    removed = [*found, *(name for name in RUN_FILES if (run_dir / name).exists())]
    for name in removed:
        (run_dir / name).unlink()
    events = sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    for path in events:
        path.unlink()
    if (run_dir / "train.log").exists():
        os.truncate(run_dir / "train.log", 0)
    log.warning("output.overwrite=true: deleted the previous run's %s%s from %s and emptied its train.log",
                ", ".join(removed), f" and {len(events)} TensorBoard event file(s)" if events else "", run_dir)


def run_inputs(cfg, finetune: Optional[str]) -> dict:
    """The files a new run starts from, by the key or flag that names them (what output.overwrite must keep)."""
    teacher = cfg.distill.teacher
    return {"distill.teacher": teacher.removeprefix("local-dir:") if teacher else None, "--finetune": finetune,
            "model.weights": cfg.model.weights, "incremental.base": cfg.incremental.base}


# Below this share of the model's parameters, a --finetune source is most likely another architecture.
FINETUNE_MIN_SHARE = 0.5


def apply_finetune(model: torch.nn.Module, ckpt: dict, source: str, allow_partial: bool = False) -> float:
    """Load the checkpoint's tensors that match `model` by name and shape; returns the share of the model's
    parameters (by count) they cover. Under FINETUNE_MIN_SHARE a ConfigError (exit 2) unless `allow_partial`;
    under all of them a warning naming the share and what starts from random."""
    weights = ckpt.get("model") if isinstance(ckpt.get("model"), dict) else {}
    loaded, skipped = load_matching_weights(model, weights)
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    share = sum(params[name].numel() for name in loaded if name in params) / max(total, 1)
    source_model = ((ckpt.get("config") or {}).get("model") or {}).get("name", "unknown")
    if share < FINETUNE_MIN_SHARE and not allow_partial:
        raise ConfigError(f"--finetune {source}: only {share:.1%} of the model's parameters ({len(loaded)} tensors) "
                          f"match the checkpoint's by name and shape (it was trained as model.name={source_model}); "
                          f"the rest would start from random. Use a checkpoint of this architecture, or pass "
                          f"--finetune-partial to train from it anyway")
    if share < 1.0:
        log.warning("--finetune: %.1f%% of the model's parameters loaded from %s (%d tensors, model.name=%s); "
                    "starting from random: %s", 100 * share, source, len(loaded), source_model,
                    ", ".join(skipped[:20]) + (", ..." if len(skipped) > 20 else ""))
    else:
        log.info("--finetune: all %d tensors loaded from %s", len(loaded), source)
    return share
