"""Random erasing, mixup and CutMix on the device (training/step.py) and the training losses (tasks/losses.py):
label mass, the lambda distribution, CutMix boxes and their corrected lambda, erasing boxes like torchvision's,
draws as a function of (seed, step, micro-batch), and the loss math against timm's."""
import math
import statistics

import pytest
import torch
from timm.data.mixup import one_hot as timm_one_hot
from timm.loss import BinaryCrossEntropy as TimmBCE, SoftTargetCrossEntropy

from imgcls.tasks.losses import BinaryCrossEntropy
from imgcls.training.step import BatchMixing, MixDraw, apply_mix, draw_mix, erase, erase_boxes

H = W = 16


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def labelled_batch(n=8, classes=5):
    labels = torch.arange(n) % classes
    # image i is the constant i + 1 on every pixel: the source of each mixed pixel can be read back
    images = (torch.arange(n, dtype=torch.float32) + 1).view(n, 1, 1, 1).expand(n, 3, H, W).clone()
    return images, labels


@pytest.mark.parametrize("draw", [MixDraw("mixup", 0.3), MixDraw("cutmix", 1 - 40 / 256, (2, 10, 3, 8))])
def test_mixing_preserves_the_label_mass_and_pairs_each_image_with_its_neighbour(draw):
    images, labels = labelled_batch()
    original = images.clone()
    mixed, targets = apply_mix(images, labels, draw, 5)
    assert targets.shape == (8, 5)
    assert torch.allclose(targets.sum(1), torch.ones(8))
    # the batch's label mass per class is unchanged: lam of each label stays, 1 - lam moves to its neighbour
    assert torch.allclose(targets.sum(0), torch.bincount(labels, minlength=5).float())
    expected = draw.lam * torch.eye(5)[labels] + (1 - draw.lam) * torch.eye(5)[labels.roll(1)]
    assert torch.allclose(targets, expected)
    partner = original.roll(1, 0)
    if draw.mode == "mixup":
        assert torch.allclose(mixed, draw.lam * original + (1 - draw.lam) * partner)
    else:
        own_share = (mixed == original).float().mean(dim=(1, 2, 3))
        assert torch.allclose(own_share, torch.full((8,), draw.lam))  # lambda = the share of own pixels
        top, bottom, left, right = draw.box
        assert torch.equal(mixed[:, :, top:bottom, left:right], partner[:, :, top:bottom, left:right])


def test_mixup_lambda_follows_beta_alpha_alpha():
    alpha = 0.4
    lams = [draw_mix(gen(s), alpha, 0.0, 1.0, 0.5, H, W).lam for s in range(3000)]
    assert all(0.0 <= lam <= 1.0 for lam in lams)
    # Beta(a, a): mean 1/2, variance 1 / (4 (2a + 1)); the standard errors at n = 3000 are ~0.007 and ~0.003
    assert statistics.fmean(lams) == pytest.approx(0.5, abs=0.03)
    assert statistics.pvariance(lams) == pytest.approx(1 / (4 * (2 * alpha + 1)), abs=0.012)
    # U-shaped for a < 1: a quarter of the draws lie within 0.05 of an end (Beta(0.4, 0.4): ~0.36)
    assert 0.3 < sum(lam < 0.05 or lam > 0.95 for lam in lams) / len(lams) < 0.42


def test_mix_prob_and_switch_prob_share_the_batches():
    draws = [draw_mix(gen(s), 0.2, 1.0, 0.6, 0.25, H, W) for s in range(3000)]
    modes = [d.mode for d in draws]
    assert modes.count(None) / 3000 == pytest.approx(0.4, abs=0.04)
    mixed = [m for m in modes if m is not None]
    assert mixed.count("cutmix") / len(mixed) == pytest.approx(0.25, abs=0.04)
    assert all(d.lam == 1.0 for d in draws if d.mode is None)


def test_cutmix_boxes_lie_within_the_image_and_lambda_is_corrected_by_their_area():
    alpha, height, width = 1.0, 12, 20
    draws = [draw_mix(gen(s), 0.0, alpha, 1.0, 0.5, height, width) for s in range(2000)]
    assert {d.mode for d in draws} == {"cutmix"}
    clipped = 0
    for d in draws:
        top, bottom, left, right = d.box
        assert 0 <= top <= bottom <= height and 0 <= left <= right <= width
        assert d.lam == pytest.approx(1 - (bottom - top) * (right - left) / (height * width))
        clipped += (top == 0 or bottom == height or left == 0 or right == width)
    assert clipped > 100  # boxes near the border are clipped (and their lambda corrected), not shifted
    # Beta(1, 1) is uniform; the correction to the pasted area (clipping, integer sides) only raises lambda
    assert 0.5 < statistics.fmean(d.lam for d in draws) < 0.75


@pytest.mark.slow
def test_draws_are_a_function_of_seed_step_and_micro_batch():
    mixing = BatchMixing(num_classes=5, seed=3, erase_prob=0.5, mixup_alpha=0.2, cutmix_alpha=1.0)

    def run(step, micro, seed=3):
        mixing.seed = seed
        images, labels = labelled_batch()
        return mixing(images, labels, epoch=0, step=step, micro=micro)

    a, b = run(7, 1), run(7, 1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    others = [run(8, 1), run(7, 0), run(7, 1, seed=4)]
    assert all(not torch.equal(a[0], o[0]) for o in others)


def test_mixing_stops_at_mix_off_epoch():
    mixing = BatchMixing(num_classes=5, seed=0, mixup_alpha=1.0, off_epoch=2)
    assert all(mixing.draw(1, s, 0, H, W).mode == "mixup" for s in range(20))
    assert all(mixing.draw(2, s, 0, H, W).mode is None for s in range(20))
    images, labels = labelled_batch()
    out, targets = mixing(images.clone(), labels, epoch=2, step=1, micro=0)
    assert torch.equal(out, images) and torch.equal(targets, labels)  # hard labels when not mixed


def test_erasing_boxes_follow_torchvision_random_erasing():
    from torchvision.transforms.v2 import RandomErasing

    n, height, width = 4000, 24, 32
    boxes = erase_boxes(n, height, width, 0.5, gen(0))
    top, left, h, w = boxes.T
    erased = h > 0
    assert erased.float().mean().item() == pytest.approx(0.5, abs=0.03)
    assert ((top + h <= height) & (left + w <= width) & (top >= 0) & (left >= 0)).all()
    area = (h * w)[erased].float() / (height * width)
    assert area.min() >= 0.015 and area.max() <= 0.36   # scale (0.02, 0.33), sides rounded
    # the same distribution of box areas as torchvision's own draw (with its global RNG)
    torch.manual_seed(0)
    image = torch.zeros(3, height, width)
    tv_area = [p[2] * p[3] / (height * width) for p in (RandomErasing.get_params(image, (0.02, 0.33), (0.3, 3.3))
                                                        for _ in range(3000)) if p[2] < height]
    assert area.mean().item() == pytest.approx(statistics.fmean(tv_area), abs=0.01)


def test_erase_sets_the_box_to_zero_on_every_channel_and_nothing_else():
    images = torch.ones(3, 3, 8, 8).to(memory_format=torch.channels_last)
    boxes = torch.tensor([[1, 2, 3, 4], [0, 0, 0, 0], [5, 5, 3, 3]])
    out = erase(images, boxes)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert out[0, :, 1:4, 2:6].eq(0).all() and out[0].eq(0).sum() == 3 * 12
    assert out[1].eq(1).all()
    assert out[2, :, 5:8, 5:8].eq(0).all() and out[2].eq(0).sum() == 3 * 9


def test_cross_entropy_on_mixed_targets_with_smoothing_matches_timm():
    torch.manual_seed(0)
    logits, labels, lam, smoothing, classes = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 0, 1]), 0.7, 0.1, 4
    _, targets = apply_mix(torch.zeros(6, 3, 2, 2), labels, MixDraw("mixup", lam), classes)
    ours = torch.nn.CrossEntropyLoss(label_smoothing=smoothing)(logits, targets)
    off = smoothing / classes
    timm_targets = (lam * timm_one_hot(labels, classes, 1 - smoothing + off, off) +
                    (1 - lam) * timm_one_hot(labels.roll(1), classes, 1 - smoothing + off, off))
    assert ours.item() == pytest.approx(SoftTargetCrossEntropy()(logits, timm_targets).item(), rel=1e-6)


@pytest.mark.parametrize("thresh", [None, 0.2])
def test_binary_cross_entropy_matches_timm_on_hard_and_mixed_targets(thresh):
    torch.manual_seed(0)
    logits, labels = torch.randn(6, 4), torch.tensor([0, 1, 2, 3, 0, 1])
    hard = BinaryCrossEntropy(0.1, thresh)(logits, labels)
    assert hard.item() == pytest.approx(TimmBCE(0.1, thresh)(logits, labels).item(), rel=1e-6)
    _, mixed = apply_mix(torch.zeros(6, 3, 2, 2), labels, MixDraw("mixup", 0.6), 4)
    soft = BinaryCrossEntropy(0.0, thresh)(logits, mixed)
    assert soft.item() == pytest.approx(TimmBCE(0.0, thresh)(logits, mixed).item(), rel=1e-6)
    assert math.isfinite(soft.item())
