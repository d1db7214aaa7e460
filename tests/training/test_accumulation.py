"""Gradient accumulation through the real training loop: batch 16 x 4 micro-batches == batch 64 x 1; a window
longer than the epoch is clamped."""
import copy
import logging

import pytest
import torch

from imgcls.compute.device import DeviceInput
from imgcls.config import OptimConfig, load_config
from imgcls.objectives.base import Objective
from imgcls.training.loop import measuring_parts, train_one_epoch
from imgcls.training.optim import build_optimizer
from imgcls.training.schedule import build_scheduler, plan_run, steps_per_epoch
from imgcls.training.state import EpochCounters, TrainState
from imgcls.training.step import TrainStep

MEAN, STD = [0.5, 0.5, 0.5], [0.25, 0.25, 0.25]


def bn_free_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, stride=2, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))


def fixed_data(n: int):
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=g)
    labels = torch.randint(0, 4, (n,), generator=g)
    return images, labels


def batches(images, labels, batch_size):
    """What the training loader yields: (uint8 images, int64 labels, bad-file index or -1), fixed order."""
    out = []
    for start in range(0, len(images), batch_size):
        sl = slice(start, start + batch_size)
        out.append((images[sl], labels[sl], torch.full((len(images[sl]),), -1, dtype=torch.int64)))
    return out


def make_context(model, accum_steps, num_batches, clip=None, momentum=0.9):
    """A TrainStep built the way Trainer.setup builds one (CPU, fp32)."""
    optim_cfg = OptimConfig(name="sgd", momentum=momentum, nesterov=momentum > 0, weight_decay=1e-3)
    optimizer = build_optimizer(model, optim_cfg, lr=0.05)
    total = steps_per_epoch(num_batches, accum_steps)
    scheduler = build_scheduler(optimizer, warmup=1, total=total, start_factor=0.0, min_ratio=0.0)
    return TrainStep(model=model, objective=Objective(torch.nn.CrossEntropyLoss()), optimizer=optimizer, scheduler=scheduler,
                     scaler=torch.amp.GradScaler("cpu", enabled=False),
                     input=DeviceInput(torch.device("cpu"), MEAN, STD, False, None), accum_steps=accum_steps,
                     clip_grad_norm=clip, nonfinite="stop", max_nonfinite_in_row=10, distributed=False)


def run_epoch(model, loader, accum_steps, clip=None, momentum=0.9):
    ctx = make_context(model, accum_steps, len(loader), clip, momentum)
    state = TrainState()
    logged = []
    parts = measuring_parts(on_step=lambda step, values: logged.append((step, values)), log_interval=1)
    progress = EpochCounters()
    train_one_epoch(ctx, parts, loader, len(loader), state, progress)
    return state, progress, logged


def assert_same_weights(a, b):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa, pb, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_batch16_accum4_equals_batch64(momentum):
    images, labels = fixed_data(128)
    start = bn_free_model()
    small, big = copy.deepcopy(start), copy.deepcopy(start)
    state_small, progress_small, _ = run_epoch(small, batches(images, labels, 16), accum_steps=4, momentum=momentum)
    state_big, progress_big, _ = run_epoch(big, batches(images, labels, 64), accum_steps=1, momentum=momentum)
    assert state_small.step == state_big.step == 2
    assert progress_small.samples == progress_big.samples == 128
    assert progress_small.loss_sum == pytest.approx(progress_big.loss_sum, rel=1e-5)
    assert_same_weights(small, big)
    # the weights did move, so the comparison means something
    assert not torch.allclose(start[0].weight, small[0].weight)


def test_short_last_window_is_averaged_over_its_own_length():
    # 6 micro-batches of 16 with accumulation 4: windows of 4 and 2 micro-batches == batches of 64 and 32
    images, labels = fixed_data(96)
    start = bn_free_model()
    small, big = copy.deepcopy(start), copy.deepcopy(start)
    state_small, _, _ = run_epoch(small, batches(images, labels, 16), accum_steps=4)
    big_loader = [(images[:64], labels[:64], torch.full((64,), -1)), (images[64:], labels[64:], torch.full((32,), -1))]
    state_big, _, _ = run_epoch(big, big_loader, accum_steps=1)
    assert state_small.step == state_big.step == 2
    assert_same_weights(small, big)


def test_clipping_happens_once_per_update_on_the_whole_window(monkeypatch):
    images, labels = fixed_data(96)
    calls = []
    real_clip = torch.nn.utils.clip_grad_norm_

    def spy(params, max_norm, *args, **kwargs):
        norm = real_clip(params, max_norm, *args, **kwargs)
        calls.append(float(norm))
        return norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    start = bn_free_model()
    small, big = copy.deepcopy(start), copy.deepcopy(start)
    # a max norm far below the real one, so clipping changes every update
    _, _, logged_small = run_epoch(small, batches(images, labels, 16), accum_steps=4, clip=1e-3)
    calls_small, calls[:] = list(calls), []
    big_loader = [(images[:64], labels[:64], torch.full((64,), -1)), (images[64:], labels[64:], torch.full((32,), -1))]
    _, _, logged_big = run_epoch(big, big_loader, accum_steps=1, clip=1e-3)
    calls_big = list(calls)

    assert len(calls_small) == 2            # 6 micro-batches, 2 optimizer steps: clipped twice, not 6 times
    assert calls_small == pytest.approx(calls_big, rel=1e-4)   # clipped norm is that of the whole window
    assert min(calls_small) > 1e-3
    assert_same_weights(small, big)
    # the logged grad norm is the pre-clipping norm of each update
    assert [v["train/grad_norm"] for _, v in logged_small] == pytest.approx(calls_small, rel=1e-5)
    assert [step for step, _ in logged_small] == [1, 2]


@pytest.mark.slow
def test_each_micro_batch_mixes_within_itself_with_its_own_draw():
    from imgcls.training.step import BatchMixing

    images, labels = fixed_data(128)
    seen = []

    class SpyLoss(torch.nn.CrossEntropyLoss):
        def forward(self, logits, targets):
            seen.append(targets.detach().clone())
            return super().forward(logits, targets)

    def run(model):
        ctx = make_context(model, accum_steps=4, num_batches=8)
        ctx.objective = Objective(SpyLoss(label_smoothing=0.1))
        ctx.mixing = BatchMixing(num_classes=4, seed=5, erase_prob=0.5, mixup_alpha=0.4, cutmix_alpha=1.0)
        loader = batches(images, labels, 16)
        train_one_epoch(ctx, measuring_parts(), loader, len(loader), TrainState(), EpochCounters())

    start = bn_free_model()
    a, b = copy.deepcopy(start), copy.deepcopy(start)
    run(a)
    first, seen[:] = list(seen), []
    run(b)
    assert all(torch.equal(x, y) for x, y in zip(first, seen))
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))  # the same draws again
    assert len(first) == 8 and all(t.shape == (16, 4) for t in first)
    lams = []
    for i, targets in enumerate(first):
        # each micro-batch's label mass stays its own: its partners come from within it
        counts = torch.bincount(labels[16 * i:16 * (i + 1)], minlength=4).float()
        assert torch.allclose(targets.sum(0), counts, atol=1e-5)
        # micro-batch i is micro-batch i % 4 of optimizer step i // 4 + 1, and its lambda is that draw's
        draw = BatchMixing(num_classes=4, seed=5, mixup_alpha=0.4, cutmix_alpha=1.0).draw(0, i // 4 + 1, i % 4, 8, 8)
        own = torch.eye(4)[labels[16 * i:16 * (i + 1)]]
        assert torch.allclose(targets, draw.lam * own + (1 - draw.lam) * own.roll(1, 0), atol=1e-6)
        lams.append(draw.lam)
    assert len(set(lams)) == 8, "the micro-batches of a window draw their own lambdas"


def test_accum_steps_larger_than_the_epoch_is_clamped_and_the_true_effective_batch_planned(caplog):
    cfg = load_config("quickstart", ["train.accum_steps=11", "train.batch_size=2", "optim.base_batch_size=2"])
    with caplog.at_level(logging.WARNING):
        plan = plan_run(cfg, 2, batches_in_split=4, world_size=1)
    assert (plan.accum_steps, plan.effective_batch, plan.steps_per_epoch) == (4, 8, 1)
    assert "train.accum_steps=11 is more than the 4 batches of an epoch" in caplog.text
