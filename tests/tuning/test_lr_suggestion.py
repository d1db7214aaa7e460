"""The LR range test's suggestion (issues 34, 51): steepest descent before the minimum only, at most a quarter
of the minimum's LR, with a confidence (no `use:` line when it is low); and a run trained with the suggestion on
generated data trains."""
from __future__ import annotations

import csv
import json
import math
from argparse import Namespace

import pytest
from conftest import make_tree, run_script, tiny_overrides

from imgcls.training.arithmetic import exponential_lrs, lr_suggestion, smooth


def blown_up_curve(lrs):
    """The issue's curve: the loss falls to its minimum near LR 0.05, climbs after it (to under 4x the minimum,
    so no divergence is declared), and dips sharply once more near LR 1 before climbing again."""
    out = []
    for lr in lrs:
        x = math.log10(lr)
        loss = 2.0 - 1.2 / (1 + math.exp(-(x + 2.0) * 4))          # falls from 2.0 to 0.8 around LR 1e-2
        if lr > 0.05:
            loss += 0.8 * (x - math.log10(0.05))                      # climbs after the minimum
        if 0.8 < lr < 1.6:
            loss -= 0.8 * math.sin(math.pi * (x - math.log10(0.8)) / math.log10(2.0))   # a brief dip
        out.append(loss)
    return out


def test_steepest_descent_is_taken_before_the_minimum_only():
    lrs = exponential_lrs(1e-4, 10, 60)
    losses = smooth(blown_up_curve(lrs), beta=0.3)
    found = lr_suggestion(lrs, losses)
    assert found["divergence_lr"] is None
    assert 0.02 <= found["minimum_lr"] <= 0.1
    assert found["steepest_lr"] < found["minimum_lr"]            # not the dip after the blow-up near LR 1
    assert found["suggested_lr"] == pytest.approx(min(found["steepest_lr"], found["minimum_lr"] / 4))
    assert found["suggested_lr"] > found["minimum_lr"] / 10          # a tenth trained 20 points below the recipe
    assert found["suggested_lr"] <= found["steepest_lr"]


def test_confidence_says_when_the_curve_cannot_be_trusted():
    lrs = exponential_lrs(1e-4, 1, 50)
    flat = [2.0 - 0.01 * i / 50 for i in range(50)]                # hardly falls, never diverges
    found = lr_suggestion(lrs, flat)
    assert found["confidence"] == "low"
    assert any("fell only" in r for r in found["confidence_reasons"])
    assert any("raise the high end" in r for r in found["confidence_reasons"])

    falls_then_blows = [2.0 / (1 + (lr / 1e-2) ** 2) + 0.3 + (100 * lr if lr > 0.1 else 0) for lr in lrs]
    found = lr_suggestion(lrs, smooth(falls_then_blows, beta=0.5))
    assert found["divergence_lr"] is not None and found["confidence"] == "high"
    assert found["confidence_reasons"] == []


def test_the_printed_result_names_the_suggestion_and_its_confidence():
    from imgcls.commands.tune import format_lr_result

    lrs = exponential_lrs(1e-4, 1, 50)
    found = lr_suggestion(lrs, [2.0 - 0.01 * i / 50 for i in range(50)])
    text = format_lr_result({**found, "effective_batch": 16, "optim_lr": found["suggested_lr"] * 16,
                             "base_batch_size": 256, "lr_scaling": "linear"})
    assert f"suggested LR {found['suggested_lr']:.3g}" in text and "confidence: low" in text
    assert "fell only" in text


def test_a_low_confidence_test_prints_no_use_line_but_what_to_run():
    """Issue 51: 'confidence: low' followed by `use: optim.lr=0.0004632` trained to 17.6% against the
    recipe's 47.1%. A low confidence names the recipe's LR and the test to run for a confident one."""
    from imgcls.commands.tune import format_lr_result

    lrs = exponential_lrs(1e-4, 1, 50)
    found = lr_suggestion(lrs, [2.0 - 0.01 * i / 50 for i in range(50)])   # hardly falls, never diverges
    assert found["confidence"] == "low"
    text = format_lr_result({**found, "effective_batch": 32, "optim_lr": found["suggested_lr"] * 8,
                             "base_batch_size": 256, "lr_scaling": "linear", "recipe_lr": 0.1})
    assert "use:" not in text
    assert "the recipe's optim.lr=0.1 stands" in text
    assert "run again with --lr-range 0.0001,100 --steps 100" in text
    # a test that stopped early: the next one is built on the range and steps asked, not the ones run
    stopped = lr_suggestion(lrs[:30], [2.0 - 0.01 * i / 50 for i in range(30)], requested=(1e-4, 1.0, 50))
    assert stopped["rerun"] == {"low": 1e-4, "high": 100.0, "steps": 100}


def test_a_loss_that_rose_back_is_not_called_no_divergence():
    """The loss falls from 2.3 to 1.0, then climbs back to 2.6 as the LR grows (under 4x its minimum, so no
    divergence by the 4x rule): the result says it rose, and the confidence is not 'never diverged'."""
    from imgcls.commands.tune import format_lr_result

    lrs = exponential_lrs(1e-4, 10, 60)
    raw = [2.3 - 1.3 / (1 + math.exp(-(math.log10(lr) + 2.5) * 4)) + (0.8 * (math.log10(lr) + 1) if lr > 0.1 else 0)
           for lr in lrs]
    losses = smooth(raw, beta=0.3)
    found = lr_suggestion(lrs, losses)
    assert found["divergence_lr"] is None and found["rise_lr"] is not None and found["rise_lr"] > found["minimum_lr"]
    assert not any("never diverged" in r for r in found["confidence_reasons"])
    text = format_lr_result({**found, "effective_batch": 32, "optim_lr": found["suggested_lr"] * 8,
                             "base_batch_size": 256, "lr_scaling": "linear", "smoothed_loss": losses,
                             "recipe_lr": 0.1})
    assert "no divergence within the range" not in text and "rose back" in text


@pytest.mark.slow
def test_the_range_tests_lr_reaches_the_optimizer(tmp_path, monkeypatch):
    """Every optimizer step of the range test runs at the planned LR (no warmup, schedule or scaling in
    between): the parameter groups' LR at each `optimizer.step` is the exponential ramp."""
    import imgcls.tuning.sweep as sweep
    from imgcls.commands.tune import prepare
    from imgcls.config import load_config

    root = make_tree(tmp_path / "data", {"a": (16, 4), "b": (16, 4)}, size=(16, 16))
    cfg = load_config("base", tiny_overrides(root, tmp_path / "unused", **{"train.batch_size": 8,
                                                                           "schedule.warmup_epochs": 3,
                                                                           "train.label_smoothing": 0.2}))
    seen = []
    real_build = sweep.build_run

    def spying_build(*args, **kwargs):
        step, data = real_build(*args, **kwargs)
        group = step.optimizer.param_groups[0]
        step.optimizer.register_step_pre_hook(
            lambda optimizer, args, kwargs: seen.append(group["lr"] / group.get("lr_scale", 1.0)))
        return step, data
    monkeypatch.setattr(sweep, "build_run", spying_build)
    ctx, _, _ = prepare(cfg)
    result = sweep.run_lr_range(cfg, ctx, 1e-3, 1.0, 12)
    planned = exponential_lrs(1e-3, 1.0, 12)[:len(seen)]
    assert len(seen) >= 6 and seen == pytest.approx(planned, rel=1e-6)
    assert result.lrs == pytest.approx(planned, rel=1e-6)
    # the smoothed targets' entropy over the tree's 2 classes: 0.9 / 0.1
    assert result.floor == pytest.approx(-(0.9 * math.log(0.9) + 0.1 * math.log(0.1)))
    assert result.floor_reason == "label smoothing 0.2 over 2 classes"


@pytest.mark.slow
def test_a_run_at_the_suggested_lr_trains(tmp_path, capsys):
    """The range test on generated data, then train.py at its `use: optim.lr=...`: the training loss falls and
    validation accuracy is well above chance (4 classes: 25%)."""
    from imgcls.commands.tune import run_lr_test
    from imgcls.config import load_config

    root = make_tree(tmp_path / "data", {"a": (48, 12), "b": (48, 12), "c": (48, 12), "d": (48, 12)}, size=(16, 16))
    overrides = tiny_overrides(root, tmp_path / "unused", **{"train.batch_size": 16})
    cfg = load_config("base", overrides)
    json_path = tmp_path / "lr.json"
    assert run_lr_test(cfg, Namespace(steps=40, json=str(json_path), plot=None), (1e-4, 100.0)) == 0
    doc = json.loads(json_path.read_text())
    assert doc["suggested_lr"] <= doc["minimum_lr"] / 4 + 1e-12 and doc["confidence"] in ("high", "medium", "low")
    out = capsys.readouterr().out
    if doc["confidence"] == "low":
        assert "use: optim.lr" not in out and "the recipe's optim.lr=" in out
    else:
        assert f"use: optim.lr={doc['optim_lr']:.4g}" in out

    run_dir = tmp_path / "run"
    result = run_script("train.py", "--config", "base",
                        *tiny_overrides(root, run_dir, **{"train.batch_size": 16, "train.epochs": 3,
                                                           "optim.lr": f"{doc['optim_lr']:.4g}"}))
    assert result.returncode == 0, result.stderr[-2000:]
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    losses = [float(r["train_loss"]) for r in rows]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert json.loads((run_dir / "summary.json").read_text())["best"]["top1"] >= 60.0


def test_a_rise_short_of_divergence_is_said_not_denied():
    """The issue's case: the plot's loss climbs from 1.18 to 4.2 (3.5x, under the 4x that stops the test), and
    the result said 'no divergence within the range'. It names the rise and the LR it reached instead."""
    from imgcls.commands.tune import format_lr_result

    lrs = exponential_lrs(1e-4, 10, 60)
    falls_then_rises = [1.16 + 2.0 / (1 + (lr / 1e-2) ** 2) + (3.04 * min(lr, 10) / 10 if lr > 0.1 else 0)
                        for lr in lrs]
    found = lr_suggestion(lrs, falls_then_rises)
    assert found["divergence_lr"] is None
    doc = {**found, "lrs": lrs, "smoothed_loss": falls_then_rises, "effective_batch": 16,
           "optim_lr": found["suggested_lr"] * 16, "base_batch_size": 256, "lr_scaling": "linear"}
    text = format_lr_result(doc)
    assert "no divergence" not in text
    assert "the loss rose back from 1.18" in text  # named where the rise passed half the fall (the plot's)
    flat = [1.16 + 2.0 / (1 + (lr / 1e-2) ** 2) for lr in lrs]
    flat_found = lr_suggestion(lrs, flat)
    assert "no divergence within the range" in format_lr_result({**flat_found, **{k: doc[k] for k in (
        "effective_batch", "optim_lr", "base_batch_size", "lr_scaling")}, "lrs": lrs, "smoothed_loss": flat})


def test_the_loss_floor_follows_the_recipe(tmp_path):
    """Cross entropy against smoothed or mixed targets cannot fall below their entropy: 0.1 smoothing over 10
    classes leaves 0.500 nats; mixup raises it, distillation's (1 - alpha) scales it, ASL and hard labels have
    none."""
    from imgcls.config import load_config
    from imgcls.tuning.sweep import loss_floor

    def floor_of(**extra):
        return loss_floor(load_config("base", tiny_overrides(tmp_path, tmp_path / "out", **extra)), 10)
    smoothed = -(0.91 * math.log(0.91) + 9 * 0.01 * math.log(0.01))
    assert floor_of()[0] == 0.0 and floor_of()[1] == ""
    value, why = floor_of(**{"train.label_smoothing": 0.1})
    assert value == pytest.approx(smoothed, rel=1e-12) and "label smoothing 0.1 over 10 classes" in why
    mixed, why = floor_of(**{"train.label_smoothing": 0.1, "train.mixup_alpha": 0.2})
    assert smoothed + 0.1 < mixed < smoothed + math.log(2) and "mixup" in why
    half, _ = floor_of(**{"train.label_smoothing": 0.1, "train.mixup_alpha": 0.2, "train.mix_prob": 0.5})
    assert half == pytest.approx((mixed + smoothed) / 2, rel=1e-12)
    assert floor_of(**{"train.label_smoothing": 0.1, "train.loss": "bce", "train.bce_target_thresh": 0.2})[0] == 0.0
    distilled, _ = floor_of(**{"train.label_smoothing": 0.1, "distill.teacher": "resnet18", "distill.alpha": 0.75})
    assert distilled == pytest.approx(smoothed / 4, rel=1e-12)


def smoothed_curve(lrs, floor, start=2.3, low=0.6, broken=2.25):
    """A 10-class label-smoothed run (floor 0.5): the loss falls from `start` to `low` by LR 0.03, then the
    rising LR breaks the model back towards a uniform prediction's log 10 = 2.3 by the range's top."""
    out = []
    for lr in lrs:
        x = math.log10(lr)
        loss = start - (start - low) / (1 + math.exp(-(x + 2.5) * 4))
        if lr > 0.1:
            loss += (broken - low) * min(1.0, (x + 1) / 2)
        out.append(loss)
    return out


def test_a_smoothed_objective_is_judged_above_its_floor():
    """Issue 51: with label smoothing the loss has a floor above 0, so '4x the lowest' and 'fell by 10%' measured
    from 0 are the wrong scales. A model broken back to 2.25 (a uniform guess: 2.30) is only 3.75x a minimum of
    0.6 from 0 (no divergence today), but 17x above the floor of 0.5; a short test whose loss fell from 2.31 to
    2.11 fell 9% from 0 (low confidence today), 11% of the 1.81 it can fall."""
    floor = -(0.91 * math.log(0.91) + 9 * 0.01 * math.log(0.01))
    lrs = exponential_lrs(1e-4, 10, 80)
    broken = smoothed_curve(lrs, floor)
    assert lr_suggestion(lrs, broken)["divergence_lr"] is None                  # the rule measured from 0
    found = lr_suggestion(lrs, broken, floor=floor)
    assert found["divergence_lr"] is not None and 0.1 < found["divergence_lr"] < 1.0
    assert found["loss_floor"] == floor and found["confidence"] == "high"
    assert found["minimum_lr"] == lr_suggestion(lrs, broken)["minimum_lr"]   # the minimum is where it was

    short = [2.35 - 0.24 * min(1.0, i / 40) + (6.0 * (i - 44) if i > 44 else 0) for i in range(60)]
    lrs = exponential_lrs(1e-4, 10, 60)
    today = lr_suggestion(lrs, short)
    assert today["confidence"] == "low" and any("fell only 9%" in r for r in today["confidence_reasons"])
    found = lr_suggestion(lrs, short, floor=floor)
    assert not any("fell only" in r for r in found["confidence_reasons"]) and found["confidence"] == "high"


def test_the_printed_result_names_the_floor():
    from imgcls.commands.tune import format_lr_result

    lrs = exponential_lrs(1e-4, 10, 80)
    found = lr_suggestion(lrs, smoothed_curve(lrs, 0.5), floor=0.5)
    text = format_lr_result({**found, "effective_batch": 32, "optim_lr": found["suggested_lr"] * 8,
                             "base_batch_size": 256, "lr_scaling": "linear", "recipe_lr": 0.1,
                             "loss_floor_from": "label smoothing 0.1 over 10 classes"})
    assert text.startswith("the objective's loss cannot fall below 0.5 (label smoothing 0.1 over 10 classes)")
    assert "use: optim.lr=" in text


def settling_curve(lrs, seed=0):
    """The issue's curve (resnet18 from scratch on digits, 32 px, batch 32, 200 steps from LR 1e-4 to 10, no
    label smoothing; measured, docs/tuning.md): flat within its noise while the LR is too low to move it in so
    few steps, a rise near LR 0.15 while the network settles, a fall back by LR 1, divergence past 3."""
    import random

    noise = random.Random(seed)
    out = []
    for lr in lrs:
        x = math.log10(lr)
        loss = 2.3 + 1.1 * math.exp(-((x - math.log10(0.15)) / 0.35) ** 2) + noise.gauss(0.0, 0.07)
        out.append(loss + (30 * (x - math.log10(3.0)) if lr > 3.0 else 0.0))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_a_loss_that_rises_before_it_falls_is_read_from_its_fall(seed):
    """Issue 64: the lowest point of such a curve is a noise dip in its flat start, so the steepest descent before
    it was noise too: 'suggested LR 0.000319, confidence low', 300x below the recipe's 0.1, which trains (on the
    measured digits: 0.1 and 0.3 gave 59% and 54% after 3 epochs, 0.01 and below 12-14%). Where the loss never
    fell LR_MIN_DROP below its start, the suggestion reads the largest fall instead (fastai's `valley` reads the
    longest), here the one after the rise, at medium confidence with the reason."""
    from imgcls.training.arithmetic import largest_fall

    lrs = exponential_lrs(1e-4, 10, 200)
    losses = smooth(settling_curve(lrs, seed))
    found = lr_suggestion(lrs, losses)
    assert found["divergence_lr"] is not None and 3.0 < found["divergence_lr"] < 10
    assert 0.08 <= found["fall_start_lr"] <= 0.3 and 0.5 <= found["minimum_lr"] <= 3.0, found
    assert 0.05 <= found["suggested_lr"] <= 0.6, found      # the measured curves: 0.23 and 0.26; 1.0 gave 33%
    assert found["confidence"] == "medium" and "the loss first rose" in found["confidence_reasons"][0]
    top, bottom = largest_fall(losses, 20)
    assert lrs[top] == found["fall_start_lr"] and lrs[bottom] == found["minimum_lr"]


def test_a_curve_that_fell_first_keeps_its_fall_and_a_flat_one_stays_low():
    """The new reading applies only where the loss never fell: a fall to the minimum followed by a spike that
    recovers keeps the fall (the steepest descent before the minimum), and a curve flat within its noise
    throughout has no fall of LR_MIN_DROP anywhere, so it stays at low confidence with no `use:` line."""
    lrs = exponential_lrs(1e-4, 10, 60)
    found = lr_suggestion(lrs, smooth(blown_up_curve(lrs), beta=0.3))
    assert found["fall_start_lr"] is None and 0.02 <= found["minimum_lr"] <= 0.1
    import random

    noise = random.Random(1)
    flat = lr_suggestion(lrs, smooth([2.3 + noise.gauss(0.0, 0.07) for _ in lrs]))
    assert flat["confidence"] == "low" and flat["fall_start_lr"] is None


def test_a_loss_that_never_fell_back_to_its_start_asks_for_more_steps():
    """The same network over 100 steps (measured: the fall after the rise ended at 3.0, well above the start's
    2.35): no fall to read; the result says the loss never fell and asks for more steps, not a lower start."""
    from imgcls.commands.tune import format_lr_result

    lrs = exponential_lrs(1e-4, 10, 100)
    raw = [loss + (0.7 if lr > 0.3 else 0.0) * min(1.0, math.log10(lr / 0.3) * 2) for lr, loss in
           zip(lrs, settling_curve(lrs))]
    found = lr_suggestion(lrs, smooth(raw), requested=(1e-4, 10.0, 100))
    assert found["suggested_lr"] is None and found["confidence"] == "low", found
    assert "never fell below its start" in found["confidence_reasons"][0]
    assert found["rerun"] == {"low": 1e-4, "high": 10.0, "steps": 200}
    text = format_lr_result({**found, "optim_lr": None, "recipe_lr": 0.1})
    assert "the recipe's optim.lr=0.1 stands; run again with --lr-range 0.0001,10 --steps 200" in text
