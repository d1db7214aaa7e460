"""LR schedule and batch arithmetic: warmup counted in optimizer steps, cosine to min_lr, LR scaling."""
import math

import pytest
import torch

from engine.schedule import (build_scheduler, effective_batch, lr_factor, scaled_lr, steps_per_epoch, warmup_steps,
                             window_length)


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
