"""Bottleneck diagnosis: a slow input pipeline is measured, warned about once with advice, and logged."""
from __future__ import annotations

import csv
import time

from data.transforms import TrainTransform
from core.config import load_config
from engine.trainer import run
from tests.conftest import tiny_overrides


def _tensorboard_scalars(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [event.value for event in acc.Scalars(tag)]


def test_slow_data_is_reported_once_with_advice(tmp_path, tiny_tree, monkeypatch):
    original = TrainTransform.__call__

    def slow(self, path, seed=None):
        time.sleep(0.1)  # 8 images per batch: 0.8 s of waiting against a fraction of that for a 16 px step
        return original(self, path, seed)

    monkeypatch.setattr(TrainTransform, "__call__", slow)
    out = tmp_path / "run"
    cfg = load_config("base", tiny_overrides(tiny_tree, out, **{"train.epochs": 1, "output.log_interval": 1}))
    assert run(cfg) == 0

    log_text = (out / "train.log").read_text()
    assert log_text.count("waited for data") == 1
    warning = next(line for line in log_text.splitlines() if "waited for data" in line)
    assert "data.num_workers, now 0" in warning and "data.img_size" in warning
    waits = _tensorboard_scalars(out, "train/data_wait_frac")
    assert len(waits) == 6  # one point per optimizer step (log_interval 1)
    assert sum(waits) / len(waits) > 0.5
    with (out / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and float(rows[0]["data_wait_frac"]) > 0.2
