"""train.batch_size=auto: the search converges on the memory limit, picks a fast small batch, keeps the
effective batch and the LR rule; a plain out-of-memory error tells the user what to change."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import run_script, tiny_overrides

from imgcls.training.batch_finder import (LinearMemoryModel, StepResult, accumulation_for, find_batch,
                                          pick_fastest_small, search_max_batch)
from imgcls.training.schedule import scaled_lr


class FakeStep:
    """An injected training step: out of memory above `threshold`; time = overhead + per-image cost, so
    img/s grows with the batch and saturates."""

    def __init__(self, threshold: int, overhead: float = 0.05, per_image: float = 0.01):
        self.threshold = threshold
        self.overhead = overhead
        self.per_image = per_image
        self.calls: list[int] = []

    def __call__(self, batch: int) -> StepResult:
        self.calls.append(batch)
        if batch > self.threshold:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate for batch {batch}")
        return StepResult(self.overhead + self.per_image * batch, 1000 * batch)


@pytest.mark.parametrize("threshold", [1, 7, 100, 300, 777, 1500])
def test_search_converges_within_5_percent_of_the_oom_threshold(threshold):
    step = FakeStep(threshold)
    result = find_batch(step, limit=4096)
    assert threshold * 0.95 <= result.max_batch <= threshold
    # the failures were caught, never returned as fitting
    assert all(p["fits"] == (p["batch"] <= threshold) for p in result.fit_probes)
    assert any(not p["fits"] for p in result.fit_probes)


def test_search_stops_at_the_limit_without_probing_beyond():
    step = FakeStep(threshold=10_000)
    result = find_batch(step, limit=96)
    assert result.max_batch == 96
    assert max(step.calls) == 96


def test_nothing_fits_is_an_error():
    with pytest.raises(MemoryError, match="batch of 1"):
        find_batch(FakeStep(threshold=0), limit=64)


def test_other_errors_are_not_taken_for_out_of_memory():
    def broken(batch):
        raise ValueError("shape mismatch")

    with pytest.raises(ValueError, match="shape mismatch"):
        find_batch(broken, limit=64)


def test_search_is_a_doubling_then_bisection():
    fits_up_to = 300
    batch, tried = search_max_batch(lambda b: b <= fits_up_to, limit=10_000)
    assert [b for b, _ in tried[:10]] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert 285 <= batch <= 300
    assert len(tried) <= 16


def test_cpu_budget_uses_a_linear_memory_model_from_two_measured_steps():
    fixed, per_image = 500 * 2**20, 3 * 2**20
    budget = fixed + per_image * 300

    def step(batch):
        if fixed + per_image * batch > budget:  # must never be run: the model predicts it
            raise AssertionError(f"batch {batch} over budget was executed")
        return StepResult(0.1 + 0.01 * batch, fixed + per_image * batch)

    result = find_batch(step, limit=4096, memory_budget=budget)
    assert 285 <= result.max_batch <= 300
    assert result.memory_model["per_image_mb"] == pytest.approx(3.0)
    model = LinearMemoryModel((8, fixed + 8 * per_image), (16, fixed + 16 * per_image))
    assert model(300) == pytest.approx(budget)


def test_speed_pick_is_the_smallest_batch_within_5_percent_of_the_best():
    table = [{"batch": 32, "img_per_s": 90.0}, {"batch": 64, "img_per_s": 97.0},
             {"batch": 128, "img_per_s": 100.0}, {"batch": 256, "img_per_s": 99.0}]
    assert pick_fastest_small(table) == 64
    # the fake step (0.05 s overhead + 0.01 s per image) saturates: ~99 img/s near 800, ~95 at a eighth of it
    result = find_batch(FakeStep(threshold=800, overhead=0.05, per_image=0.01), limit=4096)
    rates = {row["batch"]: row["img_per_s"] for row in result.table}
    best = max(rates.values())
    assert rates[result.chosen_batch] >= 0.95 * best
    assert all(rates[b] < 0.95 * best for b in rates if b < result.chosen_batch)
    assert result.chosen_batch < result.max_batch


@pytest.mark.parametrize("target,world,fitting", [(256, 1, 100), (256, 1, 64), (256, 2, 48), (100, 1, 512),
                                                  (1000, 4, 37)])
def test_accumulation_keeps_the_effective_batch(target, world, fitting):
    batch, accum = accumulation_for(fitting, target, world)
    assert batch <= fitting
    effective = batch * accum * world
    assert target <= effective < target + accum * world  # exact when the target divides evenly


def test_accumulation_is_exact_when_the_target_divides():
    assert accumulation_for(64, 256, 1) == (64, 4)
    assert accumulation_for(100, 256, 1) == (86, 3)   # 258: the fewest micro-batches that fit
    assert accumulation_for(48, 256, 2) == (43, 3)
    assert accumulation_for(512, 100, 1) == (100, 1)


@pytest.mark.slow
def test_train_with_auto_batch(tmp_path, tiny_tree):
    """End to end on the CPU: the finder runs real steps, saves its table, and the run keeps the target
    effective batch by accumulation, with the LR scaled by optim.lr_scaling from it. A target beyond the
    48 training images is one no epoch can hold: the finder aims at 48, the effective batch that happens."""
    out = tmp_path / "run"
    result = run_script("train.py", "--config", "base",
                        *tiny_overrides(tiny_tree, out, **{"train.batch_size": "auto", "train.epochs": 1,
                                                           "train.target_effective_batch": 96,
                                                           "optim.base_batch_size": 48, "optim.lr": 0.05,
                                                           "optim.lr_scaling": "sqrt"}))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "the target effective batch 96 (train.target_effective_batch" in result.stderr
    report = json.loads((out / "batch_finder.json").read_text())
    assert report["target_effective_batch"] == 48
    assert report["search_limit"] == 48  # no per-device batch beyond the 48 training images
    assert report["table"] and all(row["img_per_s"] > 0 and row["peak_memory_mb"] > 0 for row in report["table"])
    assert report["batch_size"] * report["accum_steps"] == report["effective_batch"] == 48
    assert report["accum_steps"] <= 48 // report["batch_size"]  # every window fits in the epoch
    summary = json.loads((out / "summary.json").read_text())
    assert summary["effective_batch"] == 48
    assert summary["peak_lr"] == pytest.approx(scaled_lr(0.05, 48, 48, "sqrt"))
    import yaml

    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["train"]["batch_size"] == report["batch_size"]
    assert saved["train"]["accum_steps"] == report["accum_steps"]
    assert "batch-size finder" in result.stderr and "effective batch 48" in result.stderr


@pytest.mark.slow
def test_out_of_memory_message_names_the_batch_size_and_the_options(capsys):
    from imgcls.cli import run_main

    def main():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(SystemExit) as exit_info:
        run_main(main)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    for words in ("out of memory", "train.batch_size", "train.accum_steps", "train.batch_size=auto", "train.amp",
                  "data.img_size"):
        assert words in err


def test_cpu_sizes_measured_over_budget_are_dropped():
    """The linear model from small batches can be optimistic; a timed step that measures over the budget
    is not chosen."""
    budget = 1000 * 2**20

    def step(batch):  # linear up to 16 (what the model sees), then steeper
        peak = 500 * 2**20 + 2**20 * batch + (0 if batch <= 16 else 4 * 2**20 * (batch - 16))
        return StepResult(0.1 + 0.001 * batch, peak)

    result = find_batch(step, limit=1024, memory_budget=budget)
    assert result.max_batch > 400  # what the model predicted from batches 8 and 16
    assert result.table and all(row["peak_memory_mb"] <= 1000 for row in result.table)
    assert result.chosen_batch <= 100
