"""Past one machine, with the real launchers on this machine: two torchrun launchers on 127.0.0.1 as two
nodes of one c10d rendezvous equal a one-node run of the same world size bitwise (each node writes the
built-in data under its own data.root, global rank 0 alone writes the run directory); a worker group that
torchrun restarts after a SIGKILL continues from last.pt by itself and ends bitwise equal; a resume on a
node that sees another output.dir is refused naming the path; under a one-node Slurm cluster started here,
SIGUSR1 saves last.pt and requeues the job, which continues bitwise; the Kubernetes manifest runs the
command these tests run."""
from __future__ import annotations

import csv
import getpass
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import IN_PROCESS, REPO, run_train_in_process, tiny_overrides, wait_for
from multinode_launch import (ENV, SIGNALS_TO_HANDLE, files_of, finish, free_port, kill_group, node_flags, one_node,
                              output_of, two_nodes)

# The built-in digits (written by each node), 4 batches of 4 per process and epoch, 2 epochs, last.pt
# after every optimizer step: 8 steps, a few seconds of training per run.
SETTINGS = {"data.builtin": "digits", "model.name": "test_resnet", "train.batch_size": 4,
            "data.limit_train_batches": 4, "data.limit_val_batches": 2, "checkpoint.every_steps": 1,
            "output.log_interval": 1}
TOTAL_STEPS = 8


def train_args(data_root: Path, out: Path, *extra: str) -> list[str]:
    return ["--config", "base", *tiny_overrides(data_root, out, **SETTINGS), *extra]


def assert_same_run(run: Path, reference: Path) -> None:
    """Weights bitwise, metrics equal, every epoch once."""
    got, want = (torch.load(d / "last.pt", weights_only=True) for d in (run, reference))
    assert (got["step"], got["epoch"], got["world_size"]) == (want["step"], want["epoch"], 2) == (TOTAL_STEPS, 2, 2)
    different = [k for k in want["model"] if not torch.equal(got["model"][k], want["model"][k])]
    assert not different, f"weights differ from the one-node run in {different[:5]}"
    best_got, best_want = (torch.load(d / "best.pt", weights_only=True) for d in (run, reference))
    assert all(torch.equal(best_got["model"][k], best_want["model"][k]) for k in best_want["model"])
    got, want = (json.loads((d / "summary.json").read_text()) for d in (run, reference))
    assert got["best"] == want["best"] and got["best_epoch"] == want["best_epoch"]
    rows = [list(csv.DictReader((d / "metrics.csv").open())) for d in (run, reference)]
    assert [r["epoch"] for r in rows[0]] == ["1", "2"]
    for row, ref in zip(*rows):
        for key in ("step", "lr", "train_loss", "val_top1", "val_loss", "val_num_samples"):
            assert row[key] == ref[key], (key, row, ref)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    """One node, two processes: (its data root, its run directory)."""
    base = tmp_path_factory.mktemp("one_node")
    [(status, output)] = finish([one_node(train_args(base / "data", base / "run"))])
    assert status == 0, output[-3000:]
    return base / "data", base / "run"


@pytest.mark.slow
def test_two_nodes_on_loopback_equal_one_node_and_each_node_prepares_its_own_data(reference, tmp_path):
    # Each node has its own local data root (neither exists yet); the run directory is shared.
    roots = [tmp_path / f"node{r}" / "data" for r in (0, 1)]
    out = tmp_path / "shared" / "run"
    results = two_nodes(lambda r: train_args(roots[r], out), run_id="loopback")
    for status, output in results:
        assert status == 0, output[-3000:]
    # The first process of each node wrote the digits under its own root (a node left to global rank 0
    # alone would find nothing there); the same files on both nodes.
    listings = [sorted(str(p.relative_to(root)) for p in root.rglob("*.png")) for root in roots]
    assert all((root / ".complete").exists() for root in roots)
    assert listings[0] == listings[1] and len(listings[0]) == 1797
    assert_same_run(out, reference[1])
    # Global rank 0 alone wrote the run directory: both processes are local rank 0 of their node, and a
    # run directory written by local rank 0 would hold two event files and each line twice.
    def kinds(run):  # an event file's name holds its time, host and pid
        return [f.split(".out.tfevents.")[0] for f in files_of(run)]
    assert kinds(out) == kinds(reference[1])
    assert len([f for f in files_of(out) if "tfevents" in f]) == 1
    log = (out / "train.log").read_text()
    assert log.count("epoch 1/2 ") == 1 and log.count("epoch 2/2 ") == 1
    assert "2 process(es)" in log


@pytest.mark.slow
def test_a_worker_killed_mid_epoch_is_restarted_by_torchrun_and_the_group_resumes_by_itself(reference, tmp_path):
    data_root, reference_run = reference
    out, marker = tmp_path / "run", tmp_path / "paused"
    # rank 0 halts right after its 3rd last.pt (step 3 of 4 in epoch 1); the restarted group does not halt
    proc = one_node(train_args(data_root, out), max_restarts=1, run_id="elastic-test",
                    script=[str(REPO / "tests" / "paused_train.py"), str(marker), "after_save:3", "--"])
    try:
        wait_for(proc, marker.exists, "the 3rd last.pt")
    except BaseException:
        kill_group(proc)
        print(output_of(proc)[-3000:])  # shown with the failure
        raise
    os.kill(int(marker.read_text()), signal.SIGKILL)  # one worker, as a lost process would be
    [(status, output)] = finish([proc])
    assert status == 0, output[-3000:]
    assert_same_run(out, reference_run)
    log = (out / "train.log").read_text()
    assert "torchelastic restart 1 of run elastic-test: continuing from" in log
    assert "resumed at epoch 1, batch 3, optimizer step 3" in log
    last = torch.load(out / "last.pt", weights_only=True)
    assert last["elastic_run_id"] == "elastic-test"


@pytest.mark.slow
def test_a_resume_on_a_node_that_sees_another_output_dir_is_refused_naming_the_path(reference, tmp_path):
    data_root, reference_run = reference
    # node 0's output.dir holds the run's last.pt; node 1's output.dir is a local folder without it
    dirs = [tmp_path / "shared" / "run", tmp_path / "node1-local" / "run"]
    dirs[0].mkdir(parents=True)
    shutil.copy(reference_run / "last.pt", dirs[0] / "last.pt")
    results = two_nodes(lambda r: [*train_args(data_root, dirs[r]), "--resume", "auto"], run_id="shared-check")
    for status, output in results:
        assert status != 0, output[-3000:]
        # each node's process stops with one message (exit 2); torchrun then reports its child's failure
        errors = [line for line in output.splitlines() if line.startswith("error:")]
        assert errors == ["error: --resume: the ranks do not see the same checkpoint, so they would not continue "
                          "one state:"], output[-3000:]
        assert "exitcode  : 2" in output
        assert f"{dirs[1] / 'last.pt'}: absent" in output and str(dirs[0] / "last.pt") in output
        assert "on a file system every node shares" in output
    assert not (dirs[1] / "last.pt").exists() and not (dirs[0] / "best.pt").exists()


# ---------------------------------------------------------------- Slurm: SIGUSR1, requeue, continue

SLURM_PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")


@pytest.fixture(scope="module")
def slurm_conf(tmp_path_factory):
    """A one-node Slurm cluster on this machine for the module's tests; its slurm.conf."""
    missing = [name for name in SLURM_PROGRAMS if shutil.which(name) is None]
    assert not missing, f"{missing} not found: apt-get install slurm-wlm munge (.ci/run does)"
    folder = tmp_path_factory.mktemp("slurm")
    script = str(REPO / "deploy" / "slurm" / "local-cluster.sh")
    started = subprocess.run([script, "start", str(folder), str(free_port()), str(free_port())],
                             capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        yield folder / "slurm.conf"
    finally:
        subprocess.run(["scancel", "--user", getpass.getuser()], env=dict(os.environ, SLURM_CONF=str(folder / "slurm.conf")),
                       capture_output=True, timeout=60)
        subprocess.run([script, "stop", str(folder)], capture_output=True, timeout=120)


def job_fields(job: str, env: dict) -> dict:
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True, timeout=60)
    return dict(item.split("=", 1) for item in shown.stdout.split() if "=" in item)


@pytest.mark.slow
@pytest.mark.slurm
def test_slurm_usr1_saves_last_pt_requeues_and_the_requeued_job_continues_bitwise(reference, slurm_conf, tmp_path):
    data_root, reference_run = reference
    out, marker = tmp_path / "run", tmp_path / "paused"
    env = dict(ENV, SLURM_CONF=str(slurm_conf), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               NPROC_PER_NODE="2", RDZV_PORT=str(free_port()),
               # rank 0 waits after its 3rd last.pt until the signal is there; the requeued job does not wait
               TRAIN_SCRIPT=f"{REPO / 'tests' / 'paused_train.py'} {marker} wait_signal:3 --")
    submitted = subprocess.run(["sbatch", "--parsable", "--nodes=1", f"--chdir={REPO}",
                                f"--output={tmp_path / 'slurm-%j.out'}", str(REPO / "deploy" / "slurm" / "train.sbatch"),
                                *train_args(data_root, out)], env=env, capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    job_log = tmp_path / f"slurm-{job}.out"

    def fields():
        return job_fields(job, env)

    deadline = time.monotonic() + 300
    while not marker.exists():
        assert time.monotonic() < deadline and fields().get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), \
            (fields(), job_log.read_text() if job_log.exists() else "")
        time.sleep(0.2)
    # what --signal=B:USR1@120 sends before the time limit: SIGUSR1 to the batch script alone
    signalled = subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=env, capture_output=True, text=True,
                               timeout=60)
    assert signalled.returncode == 0, signalled.stderr
    while fields().get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
        assert time.monotonic() < deadline + 300, (fields(), job_log.read_text())
        time.sleep(0.5)
    state, text = fields(), job_log.read_text()
    assert (state["JobState"], state["Restarts"], state["ExitCode"]) == ("COMPLETED", "1", "0:0"), text[-3000:]
    assert "train.sbatch: SIGUSR1: saving last.pt, then requeueing job" in text
    assert f"train.sbatch: job {job} restart 1: continuing with --resume auto" in text
    log = (out / "train.log").read_text()
    # both ranks stopped at the first point they agree on (the first validation batch of epoch 1: under 10
    # steps there is none before), saved the end of that epoch's training and exited 138
    assert log.count("stopped by SIGUSR1; last.pt holds epoch 1 batch 4 (step 4)") == 1, log[-3000:]
    assert "resumed at epoch 1, batch 4, optimizer step 4" in log
    assert_same_run(out, reference_run)


# ---------------------------------------------------------------- a restart and another run's last.pt

@pytest.mark.slow
def test_a_restart_does_not_take_up_another_runs_last_pt(faults_tree, finished_run, tmp_path, monkeypatch, capsys):
    """A first start refuses a leftover last.pt as before; torchrun's retry of that refusal (restart count 1)
    refuses it too, as it was written by another run (no or another torchrun run id)."""
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    args = ["--config", "base", *tiny_overrides(faults_tree, out, **IN_PROCESS)]
    status, err = run_train_in_process(monkeypatch, capsys, *args)
    assert status == 2 and "holds checkpoints of another run" in err
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "this-run")
    status, err = run_train_in_process(monkeypatch, capsys, *args)
    assert status == 2, err
    assert "holds last.pt of another run (torchrun run id none recorded; this is run this-run" in err
    assert torch.load(out / "last.pt", weights_only=True)["step"] == 8  # untouched


# ---------------------------------------------------------------- the Kubernetes manifest

def manifest() -> dict:
    return yaml.safe_load((REPO / "deploy" / "kubernetes" / "pytorchjob.yaml").read_text())


def split_torchrun(command: list[str]) -> tuple[dict, list[str]]:
    """torchrun's flags (name -> value) and the script with its arguments."""
    assert command[0] == "torchrun", command
    flags, i = {}, 1
    while command[i].startswith("--"):
        flags[command[i]], i = command[i + 1], i + 2
    return flags, command[i:]


def test_the_pytorchjob_manifest_has_what_the_operator_needs_and_runs_the_tested_command():
    job = manifest()
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    nodes = specs["Master"]["replicas"] + specs["Worker"]["replicas"]
    dockerfile = (REPO / "Dockerfile").read_text()
    commands = []
    for role, spec in specs.items():
        assert spec["restartPolicy"] in ("OnFailure", "ExitCode")
        pod = spec["template"]["spec"]
        grace = pod["terminationGracePeriodSeconds"]
        [container] = [c for c in pod["containers"] if c["name"] == "pytorch"]  # the operator's container name
        assert container["image"].split(":")[0] == "imgcls"  # `docker build -t imgcls .` of the Dockerfile
        assert "WORKDIR /app" in dockerfile and container.get("workingDir", "/app") == "/app"
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"  # docker's --shm-size
        assert "persistentVolumeClaim" in volumes[mounts["/shared"]]  # output.dir on storage every pod shares
        commands.append(container["command"] + container.get("args", []))
    assert commands[0] == commands[1], "master and workers run the same command"
    flags, script = split_torchrun(commands[0])
    # the flags the loopback tests give torchrun, with the pod's values
    tested = node_flags(2, 1, "127.0.0.1:1", "id", 1)
    assert set(flags) == set(tested[0::2])
    assert flags["--nnodes"] == str(nodes) and flags["--rdzv-backend"] == "c10d"
    assert flags["--signals-to-handle"] == SIGNALS_TO_HANDLE and int(flags["--max-restarts"]) >= 1
    assert flags["--rdzv-endpoint"] == "$(MASTER_ADDR):$(MASTER_PORT)"  # set by the operator in every pod
    # torchrun waits for the processes to save within the time Kubernetes gives the pod after SIGTERM
    assert int(flags["--shutdown-timeout"]) < grace
    assert script[0] == "train.py" and script[1] == "--config"
    overrides = dict(arg.split("=", 1) for arg in script[3:] if "=" in arg)
    assert overrides["output.dir"].startswith("/shared/")
    assert "--resume" not in script  # a restarted pod group continues from last.pt by itself


# ---------------------------------------------------------------- the pieces, in-process

def test_launch_info_reads_torchelastics_restart_count_and_run_id():
    from imgcls.compute.distributed import launch_info

    assert launch_info({}) == launch_info({"TORCHELASTIC_RESTART_COUNT": "0"})
    assert not launch_info({}).restarted and launch_info({}).run_id is None
    info = launch_info({"TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "r1"})
    assert info.restarted and (info.restart_count, info.run_id) == (2, "r1")


def test_a_restart_plans_auto_resume_only_when_a_last_pt_is_there(tmp_path):
    from imgcls.compute.distributed import LaunchInfo
    from imgcls.training.rundir import check_own_checkpoint, plan_resume, run_id_fields

    first, again = LaunchInfo(0, "r1"), LaunchInfo(1, "r1")
    assert plan_resume(None, tmp_path, first).resume is None            # a first start: as typed
    assert plan_resume("x.pt", tmp_path, first).resume == "x.pt"
    assert plan_resume(None, tmp_path, again).resume is None            # killed before its first last.pt
    assert plan_resume("x.pt", tmp_path, again).resume == "x.pt"        # ... resumes where it began
    (tmp_path / "last.prev.pt").write_bytes(b"")
    for typed in (None, "x.pt"):
        plan = plan_resume(typed, tmp_path, again)
        assert (plan.resume, plan.must_own) == ("auto", True)
    assert plan_resume("auto", tmp_path, again).must_own is False       # typed: the user's choice
    check_own_checkpoint({"step": 1, **run_id_fields(again)}, tmp_path, again)
    check_own_checkpoint(None, tmp_path, again)
    with pytest.raises(Exception, match="torchrun run id r0; this is run r1, restart 1"):
        check_own_checkpoint({"elastic_run_id": "r0"}, tmp_path, again)


def test_view_differences_name_each_rank_and_path_that_differs(tmp_path):
    from imgcls.core.errors import ConfigError
    from imgcls.training.rundir import check_same_view, describe_view, resume_files

    shared, local = tmp_path / "shared", tmp_path / "local"
    for folder, content in ((shared, b"state 8"), (local, b"state 4")):
        folder.mkdir()
        (folder / "last.pt").write_bytes(content)
    assert resume_files(None, shared) == [] and resume_files("c.pt", shared) == [Path("c.pt")]
    views = [describe_view("a", resume_files("auto", shared)), describe_view("a", resume_files("auto", shared))]
    check_same_view(views)  # the same files: nothing to say
    views.append(describe_view("b", resume_files("auto", local)))
    with pytest.raises(ConfigError) as info:
        check_same_view(views)
    message = str(info.value)
    assert f"rank 2 on b sees {local / 'last.pt'}: 7 bytes, sha256" in message
    assert f"rank 0 on a sees {shared / 'last.pt'}" in message and "last.prev.pt" not in message
    (local / "last.pt").unlink()
    with pytest.raises(ConfigError, match="last.pt: absent"):
        check_same_view([views[0], describe_view("b", resume_files("auto", local))])
    check_same_view([views[0], None, views[1]])  # a node's other processes leave it to its first


def test_sigusr1_is_a_stop_signal_that_exits_138():
    from imgcls.compute.distributed import StopSignal

    stop = StopSignal()
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received and stop.name() == "SIGUSR1" and stop.exit_status() == 138
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def test_every_process_takes_the_device_of_its_local_rank(monkeypatch):
    """On node 1 of 2 with 4 GPUs each, global rank 5 is local rank 1: it takes cuda:1, not cuda:5."""
    import imgcls.compute.device as runtime
    from imgcls.compute.device import select_device
    from imgcls.compute.distributed import DistInfo
    from imgcls.config import load_config

    chosen = []
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setattr(runtime, "select_device", lambda setting, local_rank, world: chosen.append(
        (setting, local_rank, world)) or torch.device("cpu"))
    monkeypatch.setattr(runtime.dist_utils, "init_distributed", lambda device_type: DistInfo(5, 1, 8))
    runtime.start_runtime(load_config("base", ["train.device=auto"]), distributed=True)
    assert chosen == [("auto", 1, 8)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert select_device("auto", 1, 8) == torch.device("cuda", 1)
    assert select_device("cuda", 1, 8) == torch.device("cuda", 1)


def test_the_slurm_script_runs_torchrun_with_the_tested_flags():
    script = (REPO / "deploy" / "slurm" / "train.sbatch").read_text()
    assert "#SBATCH --signal=B:USR1@120" in script and "#SBATCH --requeue" in script
    launch = script[script.index("\nsrun "):script.index("srun_pid=$!")]
    torchrun_part = launch[launch.index("torchrun "):]
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", torchrun_part))
    assert flags == set(node_flags(2, 1, "h:1", "id", 1)[0::2])
    assert "--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in torchrun_part
    assert int(re.search(r"--shutdown-timeout (\d+)", torchrun_part).group(1)) < 120  # inside the warning
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script


def test_a_restarted_group_does_not_see_the_keys_the_previous_group_left_in_torchruns_store(monkeypatch):
    """torchrun's agent store outlives a restart with every key the killed group published (its ranks'
    addresses among them): a restarted group's process group looks only at keys of its own restart."""
    from datetime import timedelta

    import torch.distributed as dist

    from imgcls.compute.distributed import LaunchInfo, restart_store

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    server.set("default_pg/rank_0", "the killed rank 0's address")
    assert restart_store(2, LaunchInfo(0, "r")) is None  # a first start: plain env://
    first, again = restart_store(2, LaunchInfo(1, "r")), restart_store(2, LaunchInfo(2, "r"))
    assert not first.check(["default_pg/rank_0"])
    first.set("default_pg/rank_0", "restart 1's address")
    assert not again.check(["default_pg/rank_0"]) and first.get("default_pg/rank_0") == b"restart 1's address"
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # no agent store: torch's own env:// rendezvous
    assert restart_store(2, LaunchInfo(1, "r")) is None


def test_loader_workers_leave_sigusr1_to_the_main_process():
    """Slurm signals every process of a job step, loader workers included: they ignore SIGUSR1 (as SIGINT),
    and the main process saves and shuts them down."""
    from imgcls.data.loaders import leave_stop_signals_to_the_main_process

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGINT, signal.SIGTERM)}
    try:
        leave_stop_signals_to_the_main_process()  # what each loader worker runs first
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGUSR1)  # ignored: this process goes on
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
