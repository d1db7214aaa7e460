"""DDP under torchrun on CPU (gloo, 2 processes): a run completes, validation counts every sample once and
equals single-process evaluation of best.pt, only rank 0 writes, SIGTERM leaves one consistent, resumable
checkpoint, resume at another world size is refused, SyncBN; plus the distributed samplers, in-process."""
from __future__ import annotations

import csv
import json
import os
import re
import signal
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from conftest import REPO, make_tree, run_script, tiny_overrides, wait_for
from ddp_workers import calibrate_where_one_rank_cannot_see_best, nonfinite_on_one_rank, thread_counts_agreed

from imgcls.compute.device import DeviceInput
from imgcls.compute.distributed import ProcessPlace, check_sync_bn, convert_sync_bn, init_distributed, process_place
from imgcls.config import ConfigError
from imgcls.core.errors import DistributedSetupError
from imgcls.data.datasets import EvalDataset
from imgcls.data.listing import scan_split
from imgcls.data.loaders import TrainSampler, UnpaddedEvalSampler, build_eval_loader
from imgcls.data.transforms import EvalTransform
from imgcls.evaluation.evaluate import evaluate
from imgcls.models.factory import create_model
from imgcls.tasks import get_task

# 17 validation images: not a multiple of world size x batch (2 x 2), and the two ranks get different
# numbers of batches (9 samples -> 5 batches, 8 samples -> 4 batches). 120 training images: 60 per rank,
# 30 batches of 2, 15 optimizer steps of 2 micro-batches per epoch.
COUNTS = {"a": (40, 6), "b": (40, 6), "c": (40, 5)}
VAL_SIZE = 17
BATCH = 4
MAIN = {"train.batch_size": 2, "train.accum_steps": 2, "train.epochs": 2}
STEPS_PER_EPOCH = 15


def torchrun(*args: str, timeout: int = 300, popen: bool = False, script: list | None = None):
    """train.py (or `script`) under torchrun with 2 CPU processes, in its own process group (see kill_group)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               *(script or [str(REPO / "train.py")]), *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if popen else subprocess.PIPE, text=True, start_new_session=True)
    if popen:
        return proc
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def kill_group(proc: subprocess.Popen) -> None:
    """torchrun and its workers (a bare kill of torchrun would leave the workers running)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def ddp_overrides(data: Path, out: Path, **extra) -> list[str]:
    return tiny_overrides(data, out, **{"train.batch_size": BATCH, **extra})


def evaluate_checkpoint(path: Path, data: Path, limit_samples=None, unreadable=()) -> dict:
    """Single-process evaluation of a checkpoint on the val split (another batch size than training);
    `unreadable`: the indices of the files expected to be left out."""
    ckpt = torch.load(path, weights_only=True)
    cfg, pre = ckpt["config"], ckpt["preprocessing"]
    model = create_model(cfg["model"]["name"], len(ckpt["classes"]))
    model.load_state_dict(ckpt["model"], strict=True)
    index = scan_split(data / "val", classes=ckpt["classes"])
    dataset = EvalDataset(index, EvalTransform(pre["img_size"], pre["crop_pct"], pre["interpolation"]),
                          pre["img_size"])
    loader = build_eval_loader(dataset, 5, 0, False, limit_samples=limit_samples)
    sums, bad = evaluate(model, loader, DeviceInput(torch.device("cpu"), pre["mean"], pre["std"], False, None),
                         get_task("multiclass"), ckpt["classes"])
    assert bad == list(unreadable)
    return sums.compute()


def assert_same_metrics(summary_best: dict, single: dict) -> None:
    assert summary_best["num_samples"] == single["num_samples"]
    assert summary_best["top1"] == single["top1"]
    assert summary_best["top5"] == single["top5"]
    assert summary_best["mean_class_acc"] == pytest.approx(single["mean_class_acc"], abs=1e-9)
    assert summary_best["loss"] == pytest.approx(single["loss"], rel=1e-5)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return make_tree(tmp_path_factory.mktemp("ddp") / "data", COUNTS)


@pytest.fixture(scope="module")
def ddp_run(data_root, tmp_path_factory):
    """2 processes, 2 epochs, gradient accumulation 2 (no_sync on the first micro-batch)."""
    out = tmp_path_factory.mktemp("ddp") / "run"
    result = torchrun("--config", "resnet18", *ddp_overrides(data_root, out, **MAIN))
    return out, result


@pytest.mark.slow
def test_torchrun_run_completes_with_world_size_in_batch_and_lr(ddp_run):
    out, result = ddp_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs_completed"] == 2
    assert summary["effective_batch"] == 2 * 2 * 2             # batch x accum x world size
    assert summary["peak_lr"] == pytest.approx(0.05 * 8 / 256)  # linear scaling by the effective batch
    assert summary["steps_completed"] == 2 * STEPS_PER_EPOCH
    last = torch.load(out / "last.pt", weights_only=True)
    assert last["world_size"] == 2 and last["step"] == 2 * STEPS_PER_EPOCH
    assert "2 process(es)" in (out / "train.log").read_text()


@pytest.mark.slow
def test_validation_counts_each_sample_once_and_equals_single_process_eval(ddp_run, data_root):
    out, result = ddp_run
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best"]["num_samples"] == VAL_SIZE
    with (out / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["val_num_samples"]) for r in rows] == [VAL_SIZE, VAL_SIZE]
    best = torch.load(out / "best.pt", weights_only=True)
    assert best["epoch"] == summary["best_epoch"]
    assert_same_metrics(summary["best"], evaluate_checkpoint(out / "best.pt", data_root))
    # the same with eval.py, one process
    report = out.parent / "eval.json"
    result = run_script("eval.py", "--checkpoint", str(out / "best.pt"), "--data", str(data_root),
                        "--json", str(report))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_metrics(summary["best"], json.loads(report.read_text()))


@pytest.mark.slow
def test_only_rank_zero_writes(ddp_run):
    out, result = ddp_run
    assert result.returncode == 0, result.stderr[-3000:]
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    events = [f for f in files if "tfevents" in f]
    assert len(events) == 1 and events[0].startswith("tensorboard/")
    assert sorted(set(files) - set(events)) == ["best.pt", "config.yaml", "curves.png", "last.prev.pt", "last.pt", "metrics.csv",
                                                "summary.json", "train.log"]
    log = (out / "train.log").read_text()
    assert log.count("epoch 1/2 ") == 1 and log.count("epoch 2/2 ") == 1
    with (out / "metrics.csv").open() as f:
        assert [r["epoch"] for r in csv.DictReader(f)] == ["1", "2"]


@pytest.mark.slow
def test_weighted_sampler_unreadable_files_and_limited_validation_under_ddp(tmp_path):
    # class c has 2 training images, one unreadable: the balanced sampler draws it on some rank, and it
    # is replaced there; the 2nd validation image (rank 1's shard) is unreadable and left out.
    data = make_tree(tmp_path / "data", {"a": (16, 6), "b": (16, 6), "c": (2, 5)})
    (data / "train" / "c" / "c_0001.png").write_bytes(b"not an image")
    (data / "val" / "a" / "a_0001.png").write_bytes(b"not an image")
    out = tmp_path / "run"
    result = torchrun("--config", "resnet18", *ddp_overrides(data, out, **{
        "data.sampler": "weighted", "data.limit_val_batches": 1, "data.max_bad_fraction": 0.2,
        "train.epochs": 1}))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_files"] == [str(data / "train" / "c" / "c_0001.png")]
    assert "1 validation file(s) could not be read" in (out / "train.log").read_text()
    # limit_val_batches=1 with batch 4: the first 4 images of the split, whatever the world size; 1 unreadable
    assert summary["best"]["num_samples"] == BATCH - 1
    assert_same_metrics(summary["best"],
                        evaluate_checkpoint(out / "best.pt", data, limit_samples=BATCH, unreadable=[1]))


@pytest.mark.slow
def test_sigterm_stops_all_ranks_at_one_point_and_the_resumed_run_equals_the_uninterrupted_one(
        ddp_run, data_root, tmp_path):
    reference, _ = ddp_run
    out = tmp_path / "run"
    proc = torchrun("--config", "resnet18", *ddp_overrides(data_root, out, **MAIN), popen=True)
    try:
        log_file = out / "train.log"
        wait_for(proc, lambda: log_file.exists() and "step 2/" in log_file.read_text(), "step 2")
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    # torchrun reports its own SIGTERM as a failure (1); both workers saved and stopped at the same point,
    # one the ranks agree on (every 10 optimizer steps, or an epoch end).
    assert proc.returncode != 0
    stops = [line.split("WARNING ", 1)[1] for line in output.splitlines() if "stopped by SIGTERM" in line]
    assert len(stops) == 2 and stops[0] == stops[1], output[-3000:]
    last = torch.load(out / "last.pt", weights_only=True)
    assert last["world_size"] == 2
    assert f"epoch {last['epoch'] + 1} batch {last['batch_in_epoch']} (step {last['step']})" in stops[0]
    assert last["step"] % 10 == 0 or last["batch_in_epoch"] == 0

    # A different world size is refused (exit 2) ...
    single = run_script("train.py", "--config", "resnet18", *ddp_overrides(data_root, out, **MAIN),
                        "--resume", str(out / "last.pt"))
    assert single.returncode == 2, single.stderr[-3000:]
    assert "world size: 2 -> 1" in single.stderr
    # ... unless the weights start a new schedule with --finetune
    tuned = run_script("train.py", "--config", "resnet18", *ddp_overrides(data_root, tmp_path / "tuned", **{
        "train.epochs": 1, "data.limit_train_batches": 2, "data.limit_val_batches": 1}),
        "--finetune", str(out / "last.pt"))
    assert tuned.returncode == 0, tuned.stderr[-3000:]

    # The same world size continues the run, and ends where the uninterrupted run ended.
    resumed = torchrun("--config", "resnet18", *ddp_overrides(data_root, out, **MAIN), "--resume", str(out / "last.pt"))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    got, want = (torch.load(d / "last.pt", weights_only=True) for d in (out, reference))
    assert got["step"] == want["step"] == 2 * STEPS_PER_EPOCH
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), (name, stops[0], (got["model"][name] - tensor).abs().max())
    got, want = (json.loads((d / "summary.json").read_text()) for d in (out, reference))
    assert got["best"] == want["best"] and got["best_epoch"] == want["best_epoch"]


@pytest.mark.slow
def test_sigterm_during_validation_stops_all_ranks_at_one_validation_batch(data_root, tmp_path):
    """The signal arrives while both ranks validate epoch 1: they agree at the next check, save one last.pt
    at the end of that epoch's training and stop, instead of finishing the pass (torchrun waits 30 s)."""
    out, marker = tmp_path / "run", tmp_path / "paused"
    proc = torchrun("--config", "resnet18", *ddp_overrides(data_root, out, **MAIN), popen=True,
                    script=[str(REPO / "tests" / "paused_train.py"), str(marker), "val_signal:1", "--"])
    try:
        wait_for(proc, marker.exists, "validation")
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    stops = [line.split("WARNING ", 1)[1] for line in output.splitlines() if "stopped by SIGTERM" in line]
    assert len(stops) == 2 and stops[0] == stops[1], output[-3000:]
    assert f"last.pt holds epoch 1 batch {2 * STEPS_PER_EPOCH} (step {STEPS_PER_EPOCH})" in stops[0]
    last = torch.load(out / "last.pt", weights_only=True)
    assert (last["epoch"], last["step"], last["world_size"]) == (0, STEPS_PER_EPOCH, 2)
    assert not (out / "best.pt").exists()


@pytest.mark.slow
def test_failed_process_group_start_is_one_clear_line(data_root, tmp_path):
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "not-a-port"}
    result = run_script("train.py", "--config", "resnet18", *ddp_overrides(data_root, tmp_path / "run"), env=env)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "WORLD_SIZE=2 asks for distributed training" in lines[0], result.stderr


@pytest.mark.parametrize("env, named", [
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc'"),
    ({"WORLD_SIZE": "-1"}, "WORLD_SIZE='-1'"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
    ({"WORLD_SIZE": "2", "RANK": "x", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK='x'"),
    ({"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK=2 with WORLD_SIZE=2"),
    ({"WORLD_SIZE": "2", "LOCAL_RANK": "-3", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "LOCAL_RANK='-3'"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "29500"}, "without MASTER_ADDR"),
])
def test_a_malformed_launcher_environment_names_the_variable(env, named):
    with pytest.raises(ConfigError, match=re.escape(named)):
        process_place(env)


def test_the_launcher_environment_of_torchrun_and_of_one_process_is_read():
    assert process_place({}) == ProcessPlace(1, 0, 0)
    torchrun_env = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x"}
    assert process_place(torchrun_env) == ProcessPlace(4, 3, 1)


@pytest.mark.slow
def test_world_size_abc_exits_2_naming_it_before_any_work(data_root, tmp_path):
    result = run_script("train.py", "--config", "resnet18", *ddp_overrides(data_root, tmp_path / "run"),
                        env={"WORLD_SIZE": "abc"})
    assert result.returncode == 2, result.stderr
    assert "WORLD_SIZE='abc'" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("rank, waited", [(0, "the other 1 process(es) to join 127.0.0.1:"), (1, "rank 0 at 127.0.0.1:")])
def test_a_missing_peer_is_waited_for_a_bounded_time_naming_the_address(monkeypatch, rank, waited):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for name, value in {"WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(DistributedSetupError, match=re.escape(waited)) as caught:
        init_distributed("cpu", join_timeout=timedelta(seconds=1))
    assert "waited 1 s" in str(caught.value)


# ---------------------------------------------------------------- in-process: the loop, samplers, SyncBN

@pytest.mark.slow
def test_a_step_nonfinite_on_one_rank_is_skipped_on_all_ranks(tmp_path):
    # the worker lives in a small module so that the spawned processes import little
    torch.multiprocessing.spawn(nonfinite_on_one_rank, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert ranks[0]["skipped"] == ranks[1]["skipped"] == 1
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)   # the replicas stayed identical


@pytest.mark.slow
def test_calibration_ends_on_every_rank_when_only_rank_zero_sees_best_pt(tmp_path):
    """Two nodes with separate working directories: rank 1 has no best.pt. Rank 0 decides and sends the weights;
    before, rank 0 waited in the outputs' all_gather and rank 1 at the final barrier (gloo's timeout)."""
    torch.multiprocessing.spawn(calibrate_where_one_rank_cannot_see_best, args=(2, str(tmp_path / "store"),
                                                                               str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert [r["before"] for r in ranks] == [False, False] and [r["after"] for r in ranks] == [True, True]
    assert [r["record"] for r in ranks] == [True, False]  # rank 0 fits and writes
    assert "calibration" in torch.load(tmp_path / "node0" / "best.pt", weights_only=True)
    assert not (tmp_path / "node1" / "best.pt").exists()
    assert all(torch.equal(ranks[0]["weights"][k], ranks[1]["weights"][k]) for k in ranks[0]["weights"])


@pytest.mark.slow
def test_every_rank_computes_with_the_fewest_threads_any_rank_chose(tmp_path):
    # each rank reads its own machine's load; the checkpoint records one count, so all ranks use it
    torch.multiprocessing.spawn(thread_counts_agreed, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert [(r["threads"], r["torch"]) for r in ranks] == [(1, 1), (1, 1)]
    assert ranks[0]["source"].startswith("OMP_NUM_THREADS;") and "the fewest of any rank" in ranks[1]["source"]


def test_weighted_sampler_draws_balanced_disjoint_shares():
    labels = [0] * 90 + [1] * 10      # imbalanced 9:1
    shares = []
    for rank in (0, 1):
        sampler = TrainSampler(labels, "weighted", seed=3, batch_size=5, rank=rank, world_size=2)
        sampler.set_epoch(4)
        shares.append([i for i, _ in sampler])
    assert len(shares[0]) == len(shares[1]) == 50
    # the two shares are disjoint halves of the single-process draw of the same epoch
    whole = TrainSampler(labels, "weighted", seed=3, batch_size=5)
    whole.set_epoch(4)
    drawn = [i for i, _ in whole]
    assert shares[0] == drawn[0::2] and shares[1] == drawn[1::2]
    assert shares[0] != shares[1]
    # balanced: the rare class makes up about half of each rank's share (not 10%)
    for share in shares:
        minority = sum(labels[i] for i in share) / len(share)
        assert 0.3 < minority < 0.7
    # a new epoch is a new draw; the same (seed, epoch) the same draw
    again = TrainSampler(labels, "weighted", seed=3, batch_size=5, rank=0, world_size=2)
    again.set_epoch(4)
    assert [i for i, _ in again] == shares[0]
    again.set_epoch(5)
    assert [i for i, _ in again] != shares[0]


def test_random_sampler_shards_cover_the_split_once():
    labels = list(range(10)) * 4
    seen = []
    for rank in (0, 1):
        sampler = TrainSampler(labels, "random", seed=0, batch_size=4, rank=rank, world_size=2)
        sampler.set_epoch(1)
        seen.append([i for i, _ in sampler])
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(40))


@pytest.mark.parametrize("n, limit", [(17, None), (17, 8), (17, 100), (3, None)])
def test_shard_sampler_is_unpadded_and_limits_the_same_samples(n, limit):
    shards = [list(UnpaddedEvalSampler(n, rank, 2, limit)) for rank in (0, 1)]
    expected = list(range(min(n, limit or n)))
    assert sorted(shards[0] + shards[1]) == expected
    assert list(UnpaddedEvalSampler(n, 0, 1, limit)) == expected


@pytest.mark.slow
def test_sync_bn_on_cpu_processes_is_refused_before_any_work(data_root, tmp_path):
    # PyTorch's SyncBatchNorm runs only on GPUs: under DDP on CPU the run stops with exit 2 before the
    # process group starts (so no torchrun is needed to see it).
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    result = run_script("train.py", "--config", "resnet18",
                        *ddp_overrides(data_root, tmp_path / "run", **{"model.sync_bn": "true"}), env=env)
    assert result.returncode == 2
    assert "'model.sync_bn' = true needs GPU processes" in result.stderr
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError):
        check_sync_bn(True, "cpu", 2)
    check_sync_bn(True, "cuda", 2)
    check_sync_bn(True, "cpu", 1)   # one process: plain BatchNorm, nothing to synchronise


def test_convert_sync_bn_replaces_every_batchnorm():
    model = create_model("resnet10t", 3)
    batchnorms = sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    converted, count = convert_sync_bn(model)
    assert count == batchnorms > 0
    assert not any(type(m) is torch.nn.BatchNorm2d for m in converted.modules())
    assert set(converted.state_dict()) == set(create_model("resnet10t", 3).state_dict())


@pytest.mark.slow
def test_calibration_gathers_every_validation_sample_once_and_equals_one_process(ddp_run, data_root):
    """After a DDP run, best.pt's temperature and feature bank come from every validation / training sample
    once (17 and 120, split unevenly over the ranks), as a single process computes them. The validation
    outputs are the ones each rank's validation pass kept (gathered, no second pass)."""
    from imgcls.data.listing import scan_split
    from imgcls.evaluation.calibration import calibrated_temperature
    from imgcls.evaluation.rejection import collect_outputs, normalise

    out, result = ddp_run
    assert result.returncode == 0, result.stderr[-3000:]
    assert "kept from the pass that chose best.pt (no second pass)" in (out / "train.log").read_text()
    best = torch.load(out / "best.pt", weights_only=True)
    record = best["calibration"]
    # the reject fit: the 17 validation outputs topped up with the training split's (120 < MIN_VALIDATION_FIT)
    assert record["num_samples"] == VAL_SIZE and record["feature_bank"].shape[0] == VAL_SIZE + 120
    cfg, pre = best["config"], best["preprocessing"]
    model = create_model(cfg["model"]["name"], len(best["classes"]))
    model.load_state_dict(best["model"], strict=True)
    device_input = DeviceInput(torch.device("cpu"), pre["mean"], pre["std"], False, None)
    transform = EvalTransform(pre["img_size"], pre["crop_pct"], pre["interpolation"])

    def outputs(split):
        index = scan_split(data_root / split, classes=best["classes"])
        loader = build_eval_loader(EvalDataset(index, transform, pre["img_size"]), 5, 0, False)
        return collect_outputs(model, loader, device_input, with_features=True, with_layers=True)
    val, train = outputs("val"), outputs("train")
    fit = calibrated_temperature(val.logits, val.labels)
    assert record["temperature"] == pytest.approx(fit.temperature, rel=1e-3)
    assert torch.allclose(record["feature_bank"].float(), normalise(torch.cat([val.features, train.features])),
                          atol=2e-3)
    # the stages' statistics are gathered too: the per-stage class means of the multi-layer reject score
    from imgcls.evaluation.rejection import layer_fits

    names = record["layer_names"]
    fits = layer_fits([torch.cat([v, t]) for v, t in zip(val.layers, train.layers)],
                      torch.cat([val.labels, train.labels]), len(best["classes"]), names)
    assert names[0] == "input" and len(record["layer_means"]) == len(fits) == 6   # the input, then 5 stages
    assert record["reject_fit"] == "validation+training"  # 17 validation images, topped up by a training pass
    assert all(torch.allclose(stored, means, atol=2e-3) for stored, (means, _) in zip(record["layer_means"], fits))
