"""LR schedule and batch arithmetic: warmup counted in optimizer steps, cosine to min_lr, LR scaling."""
import math

import pytest
import torch

from imgcls.training.schedule import (build_scheduler, effective_batch, lr_factor, scaled_lr, steps_per_epoch,
                                      warmup_steps, window_length)


def test_warmup_is_linear_in_steps_and_reaches_peak():
    # 4 warmup steps from 0: the LR used by steps 0..3 climbs by equal amounts, step 4 runs at the peak.
    factors = [lr_factor(t, warmup=4, total=20) for t in range(5)]
    assert factors == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])


def test_warmup_start_factor():
    assert lr_factor(0, warmup=4, total=20, start_factor=0.5) == pytest.approx(0.6)
    assert lr_factor(3, warmup=4, total=20, start_factor=0.5) == pytest.approx(0.9)
    assert lr_factor(4, warmup=4, total=20, start_factor=0.5) == pytest.approx(1.0)


def test_cosine_after_warmup_ends_at_min_lr():
    warmup, total, min_ratio = 4, 20, 0.1
    # halfway through the decay the cosine is at the middle of [min, 1]
    assert lr_factor(12, warmup, total, min_ratio=min_ratio) == pytest.approx(0.55)
    # the LR after the last optimizer step (step index `total`) is exactly min_lr
    assert lr_factor(total, warmup, total, min_ratio=min_ratio) == pytest.approx(min_ratio)
    decay = [lr_factor(t, warmup, total, min_ratio=min_ratio) for t in range(warmup, total + 1)]
    assert all(a > b for a, b in zip(decay, decay[1:]))
    assert min(decay) >= min_ratio


def test_no_warmup_starts_at_peak():
    assert lr_factor(0, warmup=0, total=10) == pytest.approx(1.0)
    assert lr_factor(5, warmup=0, total=10) == pytest.approx(0.5)


@pytest.mark.parametrize("epochs, steps, expected", [
    (5, 100, 500),
    (0.5, 10, 5),       # fractional epochs become optimizer steps
    (0.25, 10, 3),      # 2.5 rounds half up, not to the even 2
    (1.5, 3, 5),        # 4.5 -> 5
    (0.01, 10, 1),      # any warmup asked for lasts at least one step
    (0, 10, 0),
])
def test_warmup_epochs_to_steps(epochs, steps, expected):
    assert warmup_steps(epochs, steps) == expected


def test_accumulation_changes_steps_per_epoch_with_an_honest_short_last_window():
    # 10 micro-batches per epoch, accumulation 4: windows of 4, 4 and 2 micro-batches -> 3 optimizer steps
    assert steps_per_epoch(10, 1) == 10
    assert steps_per_epoch(10, 4) == 3
    assert steps_per_epoch(12, 4) == 3
    assert [window_length(i, 10, 4) for i in range(10)] == [4] * 8 + [2] * 2
    assert [window_length(i, 12, 4) for i in range(12)] == [4] * 12
    # one warmup epoch is counted in optimizer steps, so accumulation shortens it accordingly
    assert warmup_steps(1, steps_per_epoch(10, 4)) == 3
    assert warmup_steps(1, steps_per_epoch(10, 1)) == 10


def test_effective_batch_and_lr_scaling():
    assert effective_batch(16, 4, 2) == 128
    assert effective_batch(64, 1, 1) == 64
    assert scaled_lr(0.1, 512, 256, "linear") == pytest.approx(0.2)
    assert scaled_lr(0.1, 64, 256, "linear") == pytest.approx(0.025)
    assert scaled_lr(0.1, 512, 256, "sqrt") == pytest.approx(0.1 * math.sqrt(2))
    assert scaled_lr(0.1, 64, 256, "sqrt") == pytest.approx(0.05)
    assert scaled_lr(0.1, 512, 256, "none") == pytest.approx(0.1)
    with pytest.raises(ValueError):
        scaled_lr(0.1, 512, 256, "cubic")


def _lrs_of_scheduler(peak, warmup, total, start_factor, min_ratio):
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=peak)
    scheduler = build_scheduler(optimizer, warmup, total, start_factor, min_ratio)
    used = []
    for _ in range(total):
        used.append(optimizer.param_groups[0]["lr"])  # the LR this optimizer step runs with
        optimizer.step()
        scheduler.step()
    return used, optimizer.param_groups[0]["lr"], optimizer, scheduler


def test_lambda_lr_from_build_scheduler_follows_lr_factor():
    peak, warmup, total, start, min_lr = 0.4, 3, 12, 0.1, 0.004
    used, final, _, _ = _lrs_of_scheduler(peak, warmup, total, start, min_lr / peak)
    expected = [peak * lr_factor(t, warmup, total, start, min_lr / peak) for t in range(total)]
    assert used == pytest.approx(expected, rel=1e-9)
    assert used[0] == pytest.approx(peak * (0.1 + 0.9 * 1 / 4))
    assert used[warmup] == pytest.approx(peak)
    assert max(used) == pytest.approx(peak)
    assert final == pytest.approx(min_lr)


def test_scheduler_state_round_trips_through_a_weights_only_load(tmp_path):
    peak, warmup, total = 0.2, 4, 20
    # a scheduler half-way: save after 7 steps, restore into a fresh one and continue
    param = torch.nn.Parameter(torch.zeros(2))
    opt_a = torch.optim.SGD([param], lr=peak)
    sched_a = build_scheduler(opt_a, warmup, total, 0.0, 0.0)
    for _ in range(7):
        opt_a.step()
        sched_a.step()
    torch.save(sched_a.state_dict(), tmp_path / "sched.pt")
    opt_b = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=peak)
    sched_b = build_scheduler(opt_b, 1, 2, 0.5, 0.5)  # deliberately different; the state overrides it
    sched_b.load_state_dict(torch.load(tmp_path / "sched.pt", weights_only=True))
    opt_b.param_groups[0]["lr"] = opt_a.param_groups[0]["lr"]
    for _ in range(5):
        opt_a.step()
        sched_a.step()
        opt_b.step()
        sched_b.step()
        assert opt_b.param_groups[0]["lr"] == pytest.approx(opt_a.param_groups[0]["lr"])
    assert opt_b.param_groups[0]["lr"] == pytest.approx(peak * lr_factor(12, warmup, total))


# ---------------------------------------------------------------- schedule.name: step, multistep, poly, constant, plateau

from types import SimpleNamespace  # noqa: E402

from imgcls.config import load_config  # noqa: E402
from imgcls.objectives.base import Objective  # noqa: E402
from imgcls.training.schedule import (LrSchedule, epochs_to_steps, observe_epoch, plan_run,  # noqa: E402
                                      schedule_from_config, schedule_warnings)


def factors(schedule: LrSchedule, steps: int) -> list[float]:
    return [schedule(t) for t in range(steps)]


def test_every_schedule_warms_up_the_same_way():
    for name in ("cosine", "step", "multistep", "poly", "constant", "plateau"):
        schedule = LrSchedule(warmup=4, total=20, start_factor=0.0, name=name, milestones=[10], period=5)
        assert factors(schedule, 5) == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0]), name


def test_multistep_decays_at_each_milestone_step():
    schedule = LrSchedule(warmup=2, total=30, name="multistep", milestones=[10, 20], gamma=0.1)
    lrs = factors(schedule, 30)
    assert lrs[2:10] == pytest.approx([1.0] * 8)
    assert lrs[10:20] == pytest.approx([0.1] * 10)    # the step at the milestone runs decayed (MultiStepLR)
    assert lrs[20:] == pytest.approx([0.01] * 10)


def test_step_decays_every_period_counted_from_the_start():
    schedule = LrSchedule(warmup=3, total=40, name="step", period=10, gamma=0.5)
    lrs = factors(schedule, 40)
    assert lrs[3:10] == pytest.approx([1.0] * 7) and lrs[10] == pytest.approx(0.5)
    assert lrs[19] == pytest.approx(0.5) and lrs[20] == pytest.approx(0.25) and lrs[39] == pytest.approx(0.125)


def test_min_lr_floors_the_step_schedules():
    schedule = LrSchedule(warmup=0, total=40, name="multistep", milestones=[5, 10, 15], gamma=0.1, min_ratio=0.005)
    assert schedule(16) == pytest.approx(0.005)


def test_poly_ends_at_min_lr_and_follows_the_power():
    schedule = LrSchedule(warmup=4, total=24, name="poly", power=2.0, min_ratio=0.1)
    assert schedule(4) == pytest.approx(1.0)
    assert schedule(14) == pytest.approx(0.1 + 0.9 * 0.25)   # halfway: (1 - 0.5) ** 2
    assert schedule(24) == pytest.approx(0.1)                # after the last step: exactly min_lr
    lrs = factors(schedule, 25)[4:]
    assert all(a > b for a, b in zip(lrs, lrs[1:]))


def test_constant_stays_at_the_peak_after_the_warmup():
    schedule = LrSchedule(warmup=2, total=10, name="constant", min_ratio=0.5)
    assert factors(schedule, 11)[2:] == pytest.approx([1.0] * 9)


def test_fractional_epochs_become_steps_like_the_warmup():
    cfg = SimpleNamespace(warmup_start_factor=0.0, name="multistep", milestones=[0.5, 1.25, 2], step_epochs=0.3,
                          gamma=0.1, power=1.0, plateau_patience=3)
    schedule = schedule_from_config(cfg, warmup=1, total=40, steps_in_epoch=10, min_ratio=0.0)
    assert schedule.milestones == [5, 13, 20]   # 12.5 rounds half up
    assert schedule.period == 3
    assert epochs_to_steps(2.5, 3) == 8


def _plateau_scheduler(warmup=2, patience=2):
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([{"params": [param]}, {"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=0.4)
    schedule = LrSchedule(warmup=warmup, total=100, name="plateau", gamma=0.5, patience=patience)
    return optimizer, build_scheduler(optimizer, warmup, 100, 0.0, 0.0, schedule)


def _steps(optimizer, scheduler, n):
    for _ in range(n):
        optimizer.step()
        scheduler.step()


def test_plateau_decays_after_patience_bad_epochs_and_applies_before_the_next_step():
    optimizer, scheduler = _plateau_scheduler()
    _steps(optimizer, scheduler, 2)
    assert not observe_epoch(scheduler, 0.1, "loss")   # still within the warmup: not counted
    _steps(optimizer, scheduler, 2)
    assert not observe_epoch(scheduler, 0.5, "loss")   # the first epoch after the warmup sets the best
    assert not observe_epoch(scheduler, 0.6, "loss")   # worse: 1 bad epoch
    assert not observe_epoch(scheduler, 0.4, "loss")   # better: the count restarts
    assert not observe_epoch(scheduler, 0.4, "loss")   # not better: 1
    assert observe_epoch(scheduler, 0.45, "loss")      # 2 = patience: x gamma, now
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.2, 0.2])
    _steps(optimizer, scheduler, 3)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2)
    assert not observe_epoch(scheduler, 50.0, "top1")  # higher is better for top1 (a new best)


def test_plateau_state_resumes_exactly_through_a_weights_only_load(tmp_path):
    optimizer, scheduler = _plateau_scheduler(warmup=0, patience=1)
    _steps(optimizer, scheduler, 3)
    for value in (0.5, 0.6, 0.7):   # best 0.5, then two decays
        observe_epoch(scheduler, value, "loss")
    torch.save({"s": scheduler.state_dict(), "o": optimizer.state_dict()}, tmp_path / "state.pt")
    saved = torch.load(tmp_path / "state.pt", weights_only=True)
    optimizer_b, scheduler_b = _plateau_scheduler(warmup=0, patience=1)
    optimizer_b.load_state_dict(saved["o"])
    scheduler_b.load_state_dict(saved["s"])
    assert scheduler_b.lr_lambdas[0].reductions == 2 and scheduler_b.lr_lambdas[0].best == 0.5
    for value in (0.8, 0.3, 0.9):
        assert observe_epoch(scheduler, value, "loss") == observe_epoch(scheduler_b, value, "loss")
        _steps(optimizer, scheduler, 2)
        _steps(optimizer_b, scheduler_b, 2)
        assert optimizer_b.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.4 * 0.5 ** 4)  # 0.8 and 0.9 were bad epochs


def _warnings(*overrides, batches=10):
    cfg = load_config("base", list(overrides))
    return schedule_warnings(cfg, plan_run(cfg, 8, batches, 1))


def test_start_up_warnings_name_what_the_lr_will_do():
    (warmup,) = _warnings("schedule.warmup_epochs=5", "train.epochs=4", "train.batch_size=8")
    assert "as long as the whole run" in warmup and "never decays" in warmup and "40 steps" in warmup
    (late,) = _warnings("schedule.name=multistep", "schedule.milestones=[2,6]", "train.epochs=5",
                        "schedule.warmup_epochs=1")
    assert "[6.0]" in late and "never reached" in late and "0.1 x the peak" in late
    (early,) = _warnings("schedule.name=multistep", "schedule.milestones=[1,3]", "train.epochs=5",
                         "schedule.warmup_epochs=2")
    assert "within the warmup" in early and "[1.0]" in early
    assert "never decays" in _warnings("schedule.name=step", "schedule.step_epochs=30", "train.epochs=10",
                                       "schedule.warmup_epochs=1")[0]
    assert _warnings("train.epochs=10", "schedule.warmup_epochs=1") == []


def test_start_up_logs_the_recipe_and_the_schedule_warnings(caplog):
    import logging

    from imgcls.compute.device import Runtime
    from imgcls.training.reporter import RunReporter

    cfg = load_config("base", ["schedule.warmup_epochs=5", "train.epochs=4", "train.mixup_alpha=0.2",
                               "schedule.name=multistep", "optim.name=lamb", "train.loss=bce"])
    plan = plan_run(cfg, 8, 10, 1)
    reporter = RunReporter(cfg, None, True, 1, plan.total_steps, plan.batches_per_epoch, Objective(None))
    data = SimpleNamespace(classes=["a", "b"], train_index=[0] * 80, val_index=[0] * 8)
    with caplog.at_level(logging.INFO):
        reporter.log_startup(data, Runtime(torch.device("cpu"), None), plan)
    for text in ("mixing: mixup alpha 0.2", "loss: binary cross-entropy", "optimizer: lamb (betas",
                 "then multistep: x 0.1 at epochs 30, 60, 80", "as long as the whole run (train.epochs=4, 40 steps)"):
        assert text in caplog.text, text
    assert any(r.levelno == logging.WARNING and "never decays" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_plateau_through_train_py_decays_when_validation_stops_improving(tiny_tree, tmp_path):
    import csv

    from conftest import run_script, tiny_overrides

    out = tmp_path / "run"
    result = run_script("train.py", "--config", "base", *tiny_overrides(
        tiny_tree, out, **{"schedule.name": "plateau", "schedule.plateau_patience": 1, "schedule.gamma": 0.5,
                           "schedule.warmup_epochs": 0, "early_stop.metric": "top1", "train.epochs": 4,
                           "data.limit_train_batches": 2, "optim.lr": 0.05, "output.tensorboard": "false"}))
    assert result.returncode == 0, result.stderr[-2000:]
    with (out / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    # replay the rule on the logged top-1: the LR logged at an epoch's end is the one the next epoch runs with
    peak, best, reductions, expected = 0.05 * 8 / 256, None, 0, []
    for row in rows:
        top1 = float(row["val_top1"])
        if best is None or top1 > best:
            best = top1
        else:
            reductions += 1
        expected.append(peak * 0.5 ** reductions)
    assert [float(r["lr"]) for r in rows] == pytest.approx(expected, rel=1e-6)
    assert reductions >= 1 and "schedule plateau: top1 has not improved" in result.stderr
