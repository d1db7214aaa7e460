"""benchmark.py --mode find-batch (issue 34): timings repeated until stable (or said not to be), a human summary
on stderr, and no recommendation that leaves fewer than MIN_STEPS_PER_EPOCH optimizer steps per epoch."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import make_tree, run_script

from imgcls.benchmarking.modes import MIN_STEPS_PER_EPOCH, find_batch_summary
from imgcls.config import load_config
from imgcls.training.batch_finder import STABLE_SPREAD, TIMING_ROUNDS, StepResult, run_finder, timed_table


class JitteryStep:
    """seconds = overhead + per_image x batch, times a factor that cycles through `jitter` call by call."""

    def __init__(self, jitter=(1.0,), threshold=10_000):
        self.jitter, self.calls, self.threshold = jitter, 0, threshold

    def __call__(self, batch: int) -> StepResult:
        if batch > self.threshold:
            raise torch.OutOfMemoryError("CUDA out of memory")
        factor = self.jitter[self.calls % len(self.jitter)]
        self.calls += 1
        return StepResult((0.05 + 0.01 * batch) * factor, 1000 * batch)


def test_steady_timings_stop_after_the_minimum_rounds():
    table, rounds, stable = timed_table(JitteryStep(), [8, 16, 32], None, [])
    assert (rounds, stable) == (TIMING_ROUNDS[0], True)
    assert [r["batch"] for r in table] == [8, 16, 32] and all(r["img_per_s_spread"] == 0 for r in table)


def test_noisy_timings_are_repeated_then_said_to_be_unstable():
    step = JitteryStep(jitter=(1.0, 1.5, 0.8, 1.3))
    table, rounds, stable = timed_table(step, [8, 16], None, [])
    assert rounds == TIMING_ROUNDS[1] and not stable
    assert all(r["img_per_s_spread"] > STABLE_SPREAD for r in table)
    # the reported rate is the median of the rounds, not the last one
    rates = sorted(16 / ((0.05 + 0.01 * 16) * f) for f in (1.5, 1.3, 1.5, 1.3, 1.5))  # batch 16 gets every other factor
    assert any(r["batch"] == 16 and r["img_per_s"] == pytest.approx(rates[2], rel=1e-3) for r in table)


def test_no_recommendation_leaves_fewer_than_a_few_steps_per_epoch(caplog):
    cfg = load_config("base", ["train.device=cpu", "train.amp=none", "model.name=resnet10t"])   # target 256
    with caplog.at_level(logging.WARNING):
        report = run_finder(cfg, torch.device("cpu"), None, 7, 840, step=JitteryStep(threshold=4096),
                            min_steps_per_epoch=MIN_STEPS_PER_EPOCH)
    assert report["effective_batch"] <= 840 // MIN_STEPS_PER_EPOCH
    assert report["steps_per_epoch"] >= MIN_STEPS_PER_EPOCH
    assert "allow for 8 steps per epoch" in caplog.text
    text = find_batch_summary(report)
    assert f"use train.batch_size={report['batch_size']} train.accum_steps={report['accum_steps']}" in text
    assert f"{report['steps_per_epoch']} optimizer steps per epoch over 840 training images" in text
    assert "timings stable" in text
    unstable = dict(report, timing_stable=False, timing_rounds=5,
                    table=[dict(r, img_per_s_spread=0.4) for r in report["table"]])
    assert "WARNING: timings not stable after 5 rounds (a batch's img/s varied by 40%)" in find_batch_summary(unstable)


@pytest.mark.slow
def test_benchmark_prints_the_summary_on_stderr_and_one_json_on_stdout(tmp_path):
    root = make_tree(tmp_path / "data", {"a": (40, 2), "b": (40, 2)}, size=(16, 16))
    result = run_script("benchmark.py", "--config", "base", "--mode", "find-batch", f"data.root={root}",
                        "model.name=resnet10t", "data.img_size=16", "train.device=cpu", "train.amp=none")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["effective_batch"] * MIN_STEPS_PER_EPOCH <= 80 and out["steps_per_epoch"] >= MIN_STEPS_PER_EPOCH
    assert f"find-batch: use train.batch_size={out['batch_size']}" in result.stderr
    assert out["timing_rounds"] >= TIMING_ROUNDS[0]
