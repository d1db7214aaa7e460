"""benchmark.py --mode diagnose: the verdict from injected rates (no test depends on the machine's speed),
and the measured numbers reaching the same pure function end to end."""
from __future__ import annotations

import json

import pytest
from conftest import run_script

from imgcls.benchmarking.modes import bottleneck_verdict, worker_counts

HINTS = {"img_size": 224, "amp": "fp32", "fast_bf16": True, "channels_last": True, "compile": False,
         "pin_memory": False, "prefetch_factor": 4, "cuda": True}


def test_worker_counts_double_up_to_the_cores():
    assert worker_counts(8, 2) == [0, 1, 2, 4, 8]
    assert worker_counts(6, 3) == [0, 1, 2, 3, 4]


def test_slowed_transform_is_data_bound_and_names_the_workers_that_keep_up():
    """A transform slowed to ~25 ms per image: 40 img/s per worker; the model alone does 100 img/s."""
    by_workers = {0: 38.0, 1: 40.0, 2: 79.0, 4: 150.0, 8: 290.0}
    verdict = bottleneck_verdict(79.0, 100.0, 75.0, by_workers, 2, HINTS)
    assert verdict["bottleneck"] == "data"
    assert verdict["overrides"] == ["data.num_workers=4"]
    assert "79.0 img/s" in verdict["why"] and "100.0 img/s" in verdict["why"]


def test_data_bound_beyond_any_worker_count_advises_the_image_size():
    verdict = bottleneck_verdict(20.0, 100.0, 19.0, {0: 10.0, 1: 15.0, 2: 20.0}, 2, HINTS)
    assert verdict["bottleneck"] == "data"
    assert "data.img_size=168" in verdict["overrides"] and "pre-resized" in verdict["why"]


def test_heavy_model_on_tiny_images_is_compute_bound():
    verdict = bottleneck_verdict(5000.0, 30.0, 29.0, {0: 1500.0, 2: 5000.0}, 2, HINTS)
    assert verdict["bottleneck"] == "compute"
    assert verdict["overrides"] == ["train.amp=bf16", "train.compile=true"]


def test_fast_alone_slow_together_is_the_copy():
    verdict = bottleneck_verdict(500.0, 400.0, 150.0, {2: 500.0}, 2, HINTS)
    assert verdict["bottleneck"] == "transfer"
    assert verdict["overrides"] == ["data.pin_memory=true", "data.prefetch_factor=8"]


@pytest.mark.slow
def test_diagnose_end_to_end(tmp_path, tiny_tree):
    result = run_script("benchmark.py", "--config", "base", "--mode", "diagnose", "--steps", "2", "--warmup", "1",
                        f"data.root={tiny_tree}", "model.name=resnet10t", "data.img_size=16", "train.batch_size=8",
                        "train.device=cpu", "train.amp=none", "data.num_workers=0")
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    rates = {int(k): v for k, v in out["loader_img_per_s_by_workers"].items()}
    assert set(rates) == set(worker_counts(out["cores"], 0))
    hints = {"img_size": 16, "amp": "fp32", "fast_bf16": False, "channels_last": True, "compile": False,
             "pin_memory": False, "prefetch_factor": 4, "cuda": False}
    again = bottleneck_verdict(out["loader_img_per_s"], out["model_img_per_s"], out["step_img_per_s"], rates, 0, hints)
    assert out["bottleneck"] == again["bottleneck"] in ("data", "compute", "transfer")
    assert f"bottleneck: {out['bottleneck']}" in result.stderr
