"""WebDataset shards written by `webdataset.ShardWriter` (python -m imgcls.data.shards): the training stream (disjoint
shards per rank, a pure function of (seed, epoch, batch), broken samples skipped and counted), validation
counting each sample once at any world size, train + eval.py on shards, 2-process DDP, SIGKILL + resume; the
writer never mixes old shards with new ones, and a cut shard is named and counted as broken."""
from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import webdataset as wds
from conftest import REPO, class_image, make_tree, run_script, tiny_overrides

import imgcls.data.shards as shards
from imgcls.config import ConfigError, load_config
from imgcls.core.errors import BadDataError, DataTreeError
from imgcls.data.listing import scan_split
from imgcls.data.shards import ShardEvalStream, ShardIndex, ShardTrainStream, expand_shards, shard_index
from imgcls.data.transforms import EvalTransform, TrainTransform
from imgcls.training.rundir import check_resume_compatible

METRIC_KEYS = ("top1", "top5", "loss", "mean_class_acc", "num_samples")
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def shard_data(tmp_path_factory) -> Path:
    """train: 40 samples in 5 shards (one broken sample); val: 15 samples in 3 shards; written by the writer."""
    base = tmp_path_factory.mktemp("shards")
    tree = make_tree(base / "tree", {"a": (14, 5), "b": (13, 5), "c": (13, 5)}, ext=".jpg")
    done = subprocess.run([sys.executable, "-m", "imgcls.data.shards", "--from", str(tree / "train"), "--to",
                           str(base / "train"), "--shard-size", "8"], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    val = scan_split(tree / "val")
    shards.write_shards(val.paths, val.labels, val.classes, base / "val", 5)
    # one more training shard by hand: a truncated JPEG and a sample labelled by name (.txt)
    good = io.BytesIO()
    class_image(1).save(good, format="JPEG")
    with wds.TarWriter(str(base / "train" / "extra.tar")) as writer:
        writer.write({"__key__": "broken", "jpg": good.getvalue()[:40], "cls": "0"})
        writer.write({"__key__": "named", "jpg": good.getvalue(), "txt": "b"})
    return base


def shard_overrides(base: Path, out: Path, **extra) -> list[str]:
    return tiny_overrides(base, out, **{
        "data.format": "webdataset", "data.root": "null", "data.classes": str(base / "train" / "classes.txt"),
        "data.train_shards": f'["{base}/train/shard-{{000000..000004}}.tar", "{base}/train/extra.tar"]',
        "data.val_shards": str(base / "val" / "shard-{000000..000002}.tar"), "data.shuffle_buffer": 6,
        "data.max_bad_fraction": 0.05, **extra})


@pytest.mark.slow
def test_writer_shards_hold_every_sample_with_its_label(shard_data):
    urls = expand_shards(str(shard_data / "val" / "shard-{000000..000002}.tar"))
    assert shards.count_samples(urls) == [5, 5, 5]
    labels = sorted(int(s["cls"]) for url in urls for s in shards.read_shard(url))
    assert labels == [0] * 5 + [1] * 5 + [2] * 5
    assert (shard_data / "train" / "classes.txt").read_text() == "a\nb\nc\n"


def train_stream(base: Path, rank=0, world=1, workers=1, batch=4, total=None) -> ShardTrainStream:
    urls = expand_shards(str(base / "train" / "shard-{000000..000004}.tar")) + [str(base / "train" / "extra.tar")]
    index = ShardIndex(["a", "b", "c"], urls, total or 42)
    return ShardTrainStream(index, TrainTransform(16, (0.25, 1), (0.75, 1.33), 0.5, 0, "bilinear"), 7, batch, rank,
                            world, workers, shuffle_buffer=6)


def loader_order(stream: ShardTrainStream, monkeypatch, workers: int) -> list:
    """What a DataLoader with `workers` workers yields, batch by batch: each worker's batches in turn."""
    per_worker = []
    for worker in range(workers):
        monkeypatch.setattr(shards, "worker_slot", lambda w=worker: (w, workers))
        items = list(stream)
        per_worker.append([items[i:i + stream.batch_size] for i in range(0, len(items), stream.batch_size)])
    out = []
    for k in range(max(map(len, per_worker))):
        for batches in per_worker:
            if k < len(batches):
                out.append(batches[k])
    return out


def same_batches(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and x[1:] == y[1:] for p, q in zip(a, b)
                                    for x, y in zip(p, q))


@pytest.mark.slow
def test_training_stream_is_a_function_of_seed_epoch_and_batch_and_resumes_at_any_batch(shard_data, monkeypatch):
    stream = train_stream(shard_data, workers=2)
    stream.set_epoch(3)
    full = loader_order(stream, monkeypatch, 2)
    assert len(full) == stream.num_batches() == 42 // 4
    assert any(item[2] >= 0 for batch in full for item in batch)  # the broken sample was met, and replaced
    assert same_batches(loader_order(stream, monkeypatch, 2), full)
    for start in (1, 4, 7):
        stream.set_epoch(3, start)
        assert same_batches(loader_order(stream, monkeypatch, 2), full[start:]), start
    stream.set_epoch(4)
    assert not same_batches(loader_order(stream, monkeypatch, 2), full)


@pytest.mark.slow
def test_ranks_read_disjoint_shards_each_epoch_and_workers_split_them(shard_data):
    for epoch in (0, 1):
        owned = []
        for rank in (0, 1):
            stream = train_stream(shard_data, rank, 2, workers=1)
            stream.set_epoch(epoch)
            owned.append(set(stream.worker_shards(0)))
        assert not owned[0] & owned[1] and owned[0] | owned[1] == set(range(6))
    stream = train_stream(shard_data, 0, 1, workers=2)
    halves = [set(stream.worker_shards(v)) for v in (0, 1)]
    assert not halves[0] & halves[1] and halves[0] | halves[1] == set(range(6))
    with pytest.raises(DataTreeError, match="6 shard\\(s\\) for 2 process\\(es\\) x 4 loader worker"):
        train_stream(shard_data, 0, 2, workers=4)


@pytest.mark.slow
@pytest.mark.parametrize("world, workers, limit", [(1, 1, None), (2, 1, None), (2, 2, None), (3, 2, 7)])
def test_validation_stream_counts_every_sample_once_at_any_world_size(shard_data, monkeypatch, world, workers, limit):
    index = shard_index(str(shard_data / "val" / "shard-{000000..000002}.tar"), ["a", "b", "c"], None, "val")
    seen = []
    for rank in range(world):
        for worker in range(workers):
            monkeypatch.setattr(shards, "worker_slot", lambda w=worker: (w, workers))
            seen += [item[3] for item in ShardEvalStream(index, EvalTransform(16, 0.875, "bilinear"), 16, rank,
                                                         world, limit)]
    everything = sorted((shard << 32) | n for shard in range(3) for n in range(5))
    assert sorted(seen) == everything[:limit]


def test_weighted_sampling_and_missing_keys_on_shards_are_usage_errors():
    with pytest.raises(ConfigError, match="'data.sampler' = weighted needs random access"):
        load_config("base", ["data.format=webdataset", "data.train_shards=a.tar", "data.val_shards=b.tar",
                             "data.classes=c.txt", "data.sampler=weighted"])
    with pytest.raises(ConfigError, match="needs data.val_shards, data.classes"):
        load_config("base", ["data.format=webdataset", "data.train_shards=a.tar"])


@pytest.fixture(scope="module")
def shard_run(shard_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("shard_run") / "run"
    result = run_script("train.py", "--config", "base", *shard_overrides(shard_data, out))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.slow
def test_training_on_shards_skips_broken_samples_and_eval_reproduces_best(shard_data, shard_run, tmp_path):
    summary = json.loads((shard_run / "summary.json").read_text())
    assert summary["best"]["num_samples"] == 15 and summary["steps_completed"] == 2 * (42 // 8)
    assert summary["skipped_files"] == [f"{shard_data}/train/extra.tar (sample 0)"]
    best = torch.load(shard_run / "best.pt", weights_only=True)
    assert best["data_source"]["train_samples"] == 42 and best["classes"] == ["a", "b", "c"]
    # eval.py on shards named by --data (the DDP test evaluates the checkpoint's own data.val_shards)
    report = tmp_path / "eval.json"
    result = run_script("eval.py", "--checkpoint", str(shard_run / "best.pt"), "--data",
                        str(shard_data / "val" / "shard-{000000..000002}.tar"), "--json", str(report))
    assert result.returncode == 0, result.stderr[-3000:]
    assert {k: json.loads(report.read_text())[k] for k in METRIC_KEYS} == summary["best"]


@pytest.mark.slow
def test_benchmark_times_the_shard_loader(shard_data, tmp_path):
    result = run_script("benchmark.py", "--config", "base", "--mode", "loader", "--steps", "3", "--rounds", "1",
                        *shard_overrides(shard_data, tmp_path / "bench"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["train_images"] == 42 and report["images"] == 5 * 8  # one whole epoch of 5 batches, timed
    assert report["img_per_s"] > 0 and report["cpu_ms_per_img"] > 0


@pytest.mark.slow
def test_two_process_ddp_on_shards_validates_each_sample_once_and_matches_eval(shard_data, shard_run, tmp_path):
    out = tmp_path / "ddp"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(REPO / "train.py"), "--config", "base", *shard_overrides(shard_data, out, **{"train.epochs": 1})]
    done = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300,
                          start_new_session=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best"]["num_samples"] == 15 and summary["steps_completed"] == (42 // 2) // 8
    report = tmp_path / "eval.json"
    result = run_script("eval.py", "--checkpoint", str(out / "best.pt"), "--json", str(report))
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(report.read_text())
    assert doc["num_samples"] == 15 and doc["top1"] == summary["best"]["top1"]
    assert doc["loss"] == pytest.approx(summary["best"]["loss"], rel=1e-5)


@pytest.mark.slow
def test_sigkill_mid_epoch_on_shards_then_resume_is_bitwise_equal(shard_data, shard_run, tmp_path):
    run, marker = tmp_path / "run", tmp_path / "paused"
    args = shard_overrides(shard_data, run, **{"checkpoint.every_steps": 1})
    # killed just after the 8th save: step 7 of 10, in epoch 2 (5 steps per epoch; epoch 1 saved 6 times)
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "paused_train.py"), str(marker), "after_save:8",
                             "--", "--config", "base", *args], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for _ in range(2400):
            if marker.exists() or proc.poll() is not None:
                break
            subprocess.run(["sleep", "0.1"])
        assert marker.exists(), proc.stderr.read()[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    saved = torch.load(run / "last.pt", weights_only=True)
    assert (saved["epoch"], saved["step"], saved["batch_in_epoch"]) == (1, 7, 2)
    done = run_script("train.py", "--config", "base", *args, "--resume", "auto")
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = (torch.load(d / "last.pt", weights_only=True) for d in (shard_run, run))
    assert a["step"] == b["step"] == 10
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (shard_run, run))
    assert sa["best"] == sb["best"]
    # the batches depend on the loader-worker count: resuming with another one is refused
    other = load_config("base", shard_overrides(shard_data, run, **{"data.num_workers": 2}))
    with pytest.raises(ConfigError, match=r"data.num_workers \(a shard stream is split across loader workers\): 1 -> 2"):
        check_resume_compatible(b, other, b["classes"], 1, {**b["data_source"], "loader_workers": 2})


@pytest.mark.slow
def test_int8_export_of_a_shards_run_exits_2_naming_the_shards(shard_run, tmp_path):
    """int8 calibration reads image files; a shard set's samples are not files (its index names them, one per
    sample id, without end), so the export says so before any work."""
    result = run_script("export.py", "--checkpoint", str(shard_run / "best.pt"), "--format", "onnx",
                        "--quantize", "int8", "--output", str(tmp_path / "int8.onnx"), timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "holds no image files" in result.stderr and "shards" in result.stderr
    assert not (tmp_path / "int8.onnx").exists()


# ---------------------------------------------------------------- the shard writer's output folder, a damaged shard


def test_shard_writer_refuses_a_folder_of_old_shards_and_overwrite_replaces_them_all(three_class_jpegs, tmp_path,
                                                                                     capsys):
    """A second write into sh2 left old shards 2-7 beside the new 0-1, and a brace pattern trained on both."""
    tree = three_class_jpegs
    out = tmp_path / "sh2"
    assert shards.main(["--from", str(tree / "train"), "--to", str(out), "--shard-size", "2"]) == 0
    assert len(list(out.glob("shard-*.tar"))) == 6
    with pytest.raises(ConfigError, match="not empty.*--overwrite"):
        shards.main(["--from", str(tree / "val"), "--to", str(out), "--shard-size", "4"])
    assert len(list(out.glob("shard-*.tar"))) == 6  # nothing touched
    capsys.readouterr()
    assert shards.main(["--from", str(tree / "val"), "--to", str(out), "--shard-size", "4", "--overwrite"]) == 0
    said = capsys.readouterr().out
    assert sorted(p.name for p in out.glob("shard-*.tar")) == ["shard-000000.tar", "shard-000001.tar"]
    assert "6 samples of 3 classes in 2 shard(s)" in said and "shard-000000.tar..shard-000001.tar" in said
    assert "removed the 7 file(s)" in said
    assert shards.count_samples(sorted(str(p) for p in out.glob("shard-*.tar"))) == [4, 2]
    # --overwrite replaces shards only, never a folder of other things
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="notes.txt"):
        shards.main(["--from", str(tree / "val"), "--to", str(out), "--overwrite"])
    assert (out / "notes.txt").read_text() == "mine"


def test_shard_writer_to_a_file_and_from_a_csv_of_missing_files_exit_2(three_class_jpegs, tmp_path):
    tree = three_class_jpegs
    target = tmp_path / "file.tar"
    target.write_bytes(b"x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        shards.main(["--from", str(tree / "train"), "--to", str(target)])
    ghosts = tmp_path / "ghosts.csv"
    ghosts.write_text("path,label\n" + "".join(f"nowhere/{i}.jpg,{'abcd'[i]}\n" for i in range(4)))
    with pytest.raises(DataTreeError, match="none of its 4 row"):
        shards.main(["--from", str(ghosts), "--to", str(tmp_path / "out")])
    assert not list((tmp_path / "out").glob("*.tar"))


@pytest.fixture(scope="module")
def shard_set(three_class_jpegs, tmp_path_factory) -> Path:
    """12 samples in 3 shards of 4, then shard 1 cut at half its bytes."""
    tree = three_class_jpegs
    out = tmp_path_factory.mktemp("shardset") / "sh"
    assert shards.main(["--from", str(tree / "train"), "--to", str(out), "--shard-size", "4"]) == 0
    cut = out / "shard-000001.tar"
    data = cut.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    return out


def test_a_cut_shard_is_named_and_counted_under_the_bad_file_policy(shard_set, caplog):
    """webdataset's reader stopped at the cut without a word: 24 samples cut at 50% counted as 14."""
    spec = str(shard_set / "shard-{000000..000002}.tar")
    assert shards.shard_damage(str(shard_set / "shard-000000.tar")) is None
    assert "cut short" in shards.shard_damage(str(shard_set / "shard-000001.tar"))
    damaged = r"(?s)in damaged shards, more than data.max_bad_fraction=0.01.*shard-000001.tar \(cut short"
    with pytest.raises(BadDataError, match=damaged):
        shards.shard_index(spec, ["a", "b", "c"], None, "data.train_shards", 0.01)
    with caplog.at_level(logging.WARNING):
        index = shards.shard_index(spec, ["a", "b", "c"], None, "data.train_shards", 0.5)
    assert [Path(u).name for u in index.urls] == ["shard-000000.tar", "shard-000002.tar"] and index.total == 8
    assert "1 damaged shard(s) left out" in caplog.text and "shard-000001.tar: cut short" in caplog.text
