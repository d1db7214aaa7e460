"""Bottleneck diagnosis: a slow input pipeline is measured, warned about once with advice, and logged.

The wait is injected, not slept: the loop and the trainer read a fake clock that advances 0.09 s for
each image the loader decodes and 0.08 s for each forward/backward pass, so every batch of 8 waits
0.72 s against 0.08 s of compute (90%), on any machine at any load.
"""
from __future__ import annotations

import csv
import types

import pytest
from conftest import tiny_overrides

import imgcls.training.loop as training_loop
import imgcls.training.trainer as trainer_module
from imgcls.config import load_config
from imgcls.data.transforms import TrainTransform
from imgcls.training.step import TrainStep
from imgcls.training.trainer import run

DECODE_S, STEP_S = 0.09, 0.08


def _tensorboard_scalars(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [event.value for event in acc.Scalars(tag)]


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.slow
def test_slow_data_is_reported_once_with_advice(tmp_path, tiny_tree, monkeypatch):
    clock = FakeClock()
    fake_time = types.SimpleNamespace(perf_counter=clock.perf_counter)
    monkeypatch.setattr(training_loop, "time", fake_time)
    monkeypatch.setattr(trainer_module, "time", fake_time)
    decode, forward_backward = TrainTransform.__call__, TrainStep.forward_backward

    def slow_decode(self, path, seed=None):
        clock.now += DECODE_S  # num_workers=0: decoded in this process, inside the loop's wait for a batch
        return decode(self, path, seed)

    def timed_step(self, *args, **kwargs):
        clock.now += STEP_S
        return forward_backward(self, *args, **kwargs)

    monkeypatch.setattr(TrainTransform, "__call__", slow_decode)
    monkeypatch.setattr(TrainStep, "forward_backward", timed_step)
    out = tmp_path / "run"
    cfg = load_config("base", tiny_overrides(tiny_tree, out, **{"train.epochs": 1, "output.log_interval": 1}))
    assert run(cfg) == 0

    wait_frac = 8 * DECODE_S / (8 * DECODE_S + STEP_S)
    log_text = (out / "train.log").read_text()
    assert log_text.count("waited for data") == 1
    warning = next(line for line in log_text.splitlines() if "waited for data" in line)
    assert f"waited for data {100 * wait_frac:.0f}% of the time" in warning
    assert "data.num_workers, now 0" in warning and "data.img_size" in warning
    # the warning comes after the third step line (the first two intervals include the loader's start-up)
    lines = log_text.splitlines()
    assert [i for i, line in enumerate(lines) if " step " in line][2] < lines.index(warning)
    waits = _tensorboard_scalars(out, "train/data_wait_frac")
    assert waits == pytest.approx([wait_frac] * 6)  # one point per optimizer step (log_interval 1)
    with (out / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and float(rows[0]["data_wait_frac"]) == pytest.approx(wait_frac, rel=1e-4)
