"""Sample-weighted evaluation metrics: sums over samples, balanced accuracy, masks, per-class report."""
import math

import pytest
import torch
from sklearn.metrics import balanced_accuracy_score

from imgcls.tasks import is_improvement
from imgcls.tasks.metrics import MetricSums, per_class_report, reduce_metrics


def _logits_for(predictions: list[list[int]], num_classes: int) -> torch.Tensor:
    """Logits whose ranking puts the given classes first, in order (score 10, 9, 8, ...)."""
    logits = torch.zeros(len(predictions), num_classes)
    for row, ranked in enumerate(predictions):
        for rank, c in enumerate(ranked):
            logits[row, c] = 10.0 - rank
    return logits


def test_uneven_last_batch_is_weighted_by_samples():
    num_classes = 6
    # batch 1: 4 samples, 1 right at top-1; batch 2: 1 sample, right at top-1
    batch1 = _logits_for([[0, 1, 2, 3, 4], [2, 1, 0, 3, 4], [5, 4, 3, 2, 1], [0, 1, 2, 3, 4]], num_classes)
    targets1 = torch.tensor([0, 1, 1, 5])   # top1 hit only for sample 0; top5 hits: 0, 1, 2 (5 is not ranked)
    batch2 = _logits_for([[3, 0, 1, 2, 4]], num_classes)
    targets2 = torch.tensor([3])
    sums = MetricSums(num_classes, torch.device("cpu"))
    sums.update(batch1, targets1)
    sums.update(batch2, targets2)
    m = sums.compute()

    losses = torch.cat([torch.nn.functional.cross_entropy(batch1, targets1, reduction="none"),
                        torch.nn.functional.cross_entropy(batch2, targets2, reduction="none")])
    assert m["num_samples"] == 5
    assert m["top1"] == pytest.approx(100 * 2 / 5)
    assert m["top5"] == pytest.approx(100 * 4 / 5)
    assert m["loss"] == pytest.approx(float(losses.double().sum()) / 5, rel=1e-6)
    # not the mean of the two batch means (which would over-weight the 1-sample batch)
    mean_of_means_top1 = 100 * (1 / 4 + 1 / 1) / 2
    assert m["top1"] != pytest.approx(mean_of_means_top1)


def test_top5_is_clipped_to_the_number_of_classes():
    sums = MetricSums(3, torch.device("cpu"))
    assert sums.k == 3
    logits = torch.tensor([[3.0, 2.0, 1.0], [1.0, 2.0, 3.0], [0.0, 5.0, 1.0]])
    sums.update(logits, torch.tensor([2, 0, 1]))
    m = sums.compute()
    assert m["top5"] == pytest.approx(100.0)   # every class is within the top 3
    assert m["top1"] == pytest.approx(100 / 3)


def test_mean_class_acc_is_balanced_accuracy():
    torch.manual_seed(0)
    targets = torch.tensor([0] * 20 + [1] * 5 + [2] * 2)
    logits = torch.randn(len(targets), 3)
    logits[torch.arange(20), 0] += 2.0  # the big class is mostly right; the small ones mostly wrong
    sums = MetricSums(3, torch.device("cpu"))
    sums.update(logits[:10], targets[:10])
    sums.update(logits[10:], targets[10:])
    m = sums.compute()
    predicted = logits.argmax(1)
    assert m["mean_class_acc"] == pytest.approx(100 * balanced_accuracy_score(targets, predicted))
    assert m["top1"] == pytest.approx(100 * float((predicted == targets).double().mean()))
    assert m["mean_class_acc"] != pytest.approx(m["top1"])


def test_valid_mask_excludes_samples_everywhere():
    num_classes = 3
    logits = torch.tensor([[5.0, 0, 0], [0, 5.0, 0], [0, 0, 5.0], [5.0, 0, 0]])
    targets = torch.tensor([0, 1, 0, 2])          # samples 2 and 3 are wrong
    valid = torch.tensor([True, True, False, False])
    masked = MetricSums(num_classes, torch.device("cpu"))
    masked.update(logits, targets, valid)
    only_valid = MetricSums(num_classes, torch.device("cpu"))
    only_valid.update(logits[:2], targets[:2])
    a, b = masked.compute(), only_valid.compute()
    assert a == pytest.approx(b)
    assert a["num_samples"] == 2 and a["top1"] == pytest.approx(100.0)
    assert torch.equal(masked.confusion, only_valid.confusion)


def test_no_samples_gives_nan_loss_not_a_crash():
    m = reduce_metrics(0.0, 0, 0, torch.zeros(3, 3, dtype=torch.int64))
    assert m["num_samples"] == 0 and math.isnan(m["loss"])


def test_per_class_report_on_a_hand_checked_confusion():
    # rows: true class, columns: predicted class
    confusion = torch.tensor([[3, 1, 0],
                              [0, 2, 2],
                              [0, 0, 0]])
    report = per_class_report(confusion, ["cat", "dog", "fox"])
    assert report["cat"]["count"] == 4
    assert report["cat"]["accuracy"] == pytest.approx(75.0)
    assert report["cat"]["recall"] == pytest.approx(75.0)
    assert report["cat"]["precision"] == pytest.approx(100.0)       # 3 of 3 predicted cats are cats
    assert report["cat"]["f1"] == pytest.approx(100 * 2 * 0.75 / 1.75)
    assert report["dog"]["count"] == 4
    assert report["dog"]["recall"] == pytest.approx(50.0)
    assert report["dog"]["precision"] == pytest.approx(100 * 2 / 3)  # 2 of 3 predicted dogs are dogs
    assert report["dog"]["f1"] == pytest.approx(100 * 2 * 0.5 * (2 / 3) / (0.5 + 2 / 3))
    assert report["fox"] == {"accuracy": 0.0, "precision": 0.0, "recall": 0.0, "f1": 0.0, "count": 0}
    # balanced accuracy averages over the classes that have samples (fox has none)
    m = reduce_metrics(0.0, 5, 8, confusion)
    assert m["mean_class_acc"] == pytest.approx((75.0 + 50.0) / 2)


def test_is_improvement_respects_direction_and_min_delta():
    assert is_improvement(50.0, None, "top1", 0.0)
    assert is_improvement(50.1, 50.0, "top1", 0.0)
    assert not is_improvement(50.1, 50.0, "top1", 0.5)
    assert not is_improvement(50.0, 50.0, "top1", 0.0)
    assert is_improvement(0.4, 0.5, "loss", 0.0)
    assert not is_improvement(0.6, 0.5, "loss", 0.0)
    assert not is_improvement(0.45, 0.5, "loss", 0.1)
    assert not is_improvement(float("nan"), None, "loss", 0.0)  # a diverged validation is never best
    assert not is_improvement(float("-inf"), 1.0, "loss", 0.0)
