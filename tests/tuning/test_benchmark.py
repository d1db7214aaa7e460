"""benchmark.py: each mode prints one JSON object with the measured rates and the settings used."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_script
from PIL import Image

from imgcls.benchmarking.modes import photo

SETTINGS_KEYS = {"model", "img_size", "batch", "amp", "channels_last", "workers", "device"}
TINY = ["model.name=resnet10t", "data.img_size=16", "train.batch_size=4", "train.device=cpu", "train.amp=none"]


@pytest.fixture(scope="module")
def jpeg_tree(tmp_path_factory):
    """2 classes x 6 train / 2 val photo-like JPEGs of 80x60."""
    root = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for split, n in (("train", 6), ("val", 2)):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(photo(rng, 80, 60)).save(root / split / c / f"{i}.jpg", quality=90)
    return root


def _bench(*args):
    result = run_script("benchmark.py", "--config", "base", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, result.stdout  # exactly one JSON object on stdout
    return json.loads(lines[0])


def test_loader_with_torchvision_baseline(jpeg_tree):
    out = _bench("--mode", "loader", "--baseline", "torchvision", "--steps", "3", "--rounds", "2",
                 f"data.root={jpeg_tree}", "data.num_workers=1", *TINY)
    assert out["mode"] == "loader" and out["baseline"] == "torchvision"
    assert out["img_per_s"] > 0 and out["baseline_img_per_s"] > 0
    assert out["ratio"] == pytest.approx(out["img_per_s"] / out["baseline_img_per_s"], rel=0.01)
    assert out["cpu_ms_per_img"] > 0 and out["baseline_cpu_ms_per_img"] > 0 and out["cpu_ratio"] > 0
    # whole epochs of 3 batches of 4, at least 3 batches per round, 2 rounds
    assert out["images"] == 2 * 12 and len(out["img_per_s_rounds"]) == 2
    assert SETTINGS_KEYS <= out["settings"].keys() and out["settings"]["workers"] == 1


def test_train_synthetic_and_real(jpeg_tree):
    out = _bench("--mode", "train", "--synthetic", "--steps", "3", "--warmup", "1", *TINY)
    assert out["settings"]["synthetic"] is True and out["settings"]["batch"] == 4
    # the CPU policy measured under: one thread (run_script sets OMP_NUM_THREADS=1), freed memory kept
    assert out["settings"]["omp_wait"] == "one thread: nothing to wait for"
    assert out["settings"]["reuse_host_memory"] is True and out["settings"]["torch_threads"] == 1
    assert out["img_per_s"] > 0 and out["peak_memory_mb"] > 0 and out["peak_memory_kind"] == "process_peak_rss"
    assert out["step_s"] == pytest.approx(out["data_wait_s"] + out["compute_s"], abs=1e-4)
    real = _bench("--mode", "train", "--steps", "4", "--warmup", "1", f"data.root={jpeg_tree}",
                  "data.num_workers=0", *TINY)
    assert real["data_wait_s"] > 0 and real["compute_s"] > 0  # the loader's time is counted as waiting
    assert 0 < real["data_wait_frac"] < 1
    assert SETTINGS_KEYS <= real["settings"].keys() and real["settings"]["amp"] == "fp32"


def test_infer_counts_every_file(jpeg_tree):
    out = _bench("--mode", "infer", "--steps", "1", f"data.root={jpeg_tree}", "data.num_workers=0", *TINY)
    assert out["images"] == 4  # the 4 validation files, in a padded batch of 4
    assert out["img_per_s"] > 0 and SETTINGS_KEYS <= out["settings"].keys()
    synthetic = _bench("--mode", "infer", "--synthetic", "--steps", "2", *TINY)
    assert synthetic["images"] == 8


def test_find_batch_keeps_the_effective_batch():
    out = _bench("--mode", "find-batch", "train.target_effective_batch=32", *TINY)
    assert out["mode"] == "find-batch" and out["img_per_s"] > 0
    assert out["table"] and out["max_batch"] <= 32
    assert out["batch_size"] * out["accum_steps"] == out["effective_batch"] == 32


@pytest.mark.slow
def test_usage_errors_exit_2():
    result = run_script("benchmark.py", "--config", "base", "--mode", "train", "--baseline", "torchvision")
    assert result.returncode == 2 and "--baseline" in result.stderr
    result = run_script("benchmark.py", "--config", "base", "--mode", "loader", *TINY)
    assert result.returncode == 2 and "data.root" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("source", ["generated", "samples"])
def test_make_photos_writes_a_class_tree_of_jpegs(tmp_path, source):
    result = run_script("benchmark.py", "--make-photos", str(tmp_path / "p"), "--photos", "8",
                        "--photo-source", source)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["source"] == source
    train = sorted((tmp_path / "p" / "train").rglob("*.jpg"))
    val = sorted((tmp_path / "p" / "val").rglob("*.jpg"))
    assert len(train) == 8 and len(val) == 1
    assert len({p.parent.name for p in train}) == 4
    for path in train:
        with Image.open(path) as img:
            assert img.format == "JPEG" and img.mode == "RGB"
            if source == "samples":  # ImageNet-sized crops of the real sample photos
                assert 400 <= max(img.size) <= 640
            else:
                assert 500 <= max(img.size) <= 1024
