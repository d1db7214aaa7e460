"""train.loss=focal, train.focal_gamma and train.class_weights: the losses against hand and torch computations,
the checks that exit 2 by key, and a long-tailed run that stops and resumes bitwise."""
from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.nn.functional as F
from conftest import exit_code, make_cfg, make_tree

from imgcls.config import ConfigError, load_config
from imgcls.tasks.losses import WeightedFocalLoss, balanced_class_weights, build_criterion
from imgcls.training.trainer import open_trainer


def _batch(seed=0, n=7, classes=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, classes, generator=g) * 2, torch.randint(0, classes, (n,), generator=g)


def test_focal_loss_equals_the_hand_computation():
    logits, labels = _batch()
    gamma, weights = 2.0, [0.5, 1.0, 2.0, 3.0]
    expected = 0.0
    for row, y in zip(logits.tolist(), labels.tolist()):
        p = torch.tensor(row).softmax(0)[y].item()
        expected += -weights[y] * (1 - p) ** gamma * torch.log(torch.tensor(p)).item()
    expected /= len(labels)
    got = WeightedFocalLoss(gamma, weights)(logits, labels)
    assert got.item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_focal_gamma_0_is_cross_entropy(smoothing):
    logits, labels = _batch(1)
    cfg = load_config("base", ["train.loss=focal", "train.focal_gamma=0", f"train.label_smoothing={smoothing}"])
    got = build_criterion(cfg.train)(logits, labels)
    torch.testing.assert_close(got, F.cross_entropy(logits, labels, label_smoothing=smoothing))
    soft = torch.softmax(torch.randn(7, 4), 1)  # mixup's soft targets
    torch.testing.assert_close(build_criterion(cfg.train)(logits, soft),
                               F.cross_entropy(logits, soft, label_smoothing=smoothing))


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_class_weights_equal_torchs_weighted_cross_entropy_summed_over_the_batch_size(smoothing):
    logits, labels = _batch(2)
    weights = [0.25, 1.0, 4.0, 2.0]
    cfg = load_config("base", [f"train.class_weights={weights}", f"train.label_smoothing={smoothing}"])
    got = build_criterion(cfg.train)(logits, labels)
    # the batch size, not the batch's weight sum, divides: exact across accumulation windows and DDP ranks
    expected = F.cross_entropy(logits, labels, weight=torch.tensor(weights), label_smoothing=smoothing,
                               reduction="sum") / len(labels)
    torch.testing.assert_close(got, expected)
    halves = [build_criterion(cfg.train)(logits[s], labels[s]) * len(labels[s]) for s in (slice(0, 3), slice(3, 7))]
    torch.testing.assert_close(sum(halves) / len(labels), got)


def test_ranks_and_accumulation_windows_average_to_the_whole_batchs_loss():
    """DDP averages the ranks' gradients (each rank's loss over its own equal share), accumulation the windows':
    the mean of the shares' losses is the whole batch's, also when the shares hold different classes. torch's
    default weighted mean (divided by each share's weight sum) is not, which is why the loss divides by N."""
    logits, _ = _batch(3, n=8)
    labels = torch.tensor([0, 0, 0, 1, 2, 3, 3, 3])  # the two halves hold different classes
    cfg = load_config("base", ["train.loss=focal", "train.class_weights=[1.0,2.0,8.0,0.5]"])
    criterion = build_criterion(cfg.train)
    halves = [criterion(logits[s], labels[s]) for s in (slice(0, 4), slice(4, 8))]
    torch.testing.assert_close((halves[0] + halves[1]) / 2, criterion(logits, labels))
    weight = torch.tensor([1.0, 2.0, 8.0, 0.5])
    by_weight_sum = [F.cross_entropy(logits[s], labels[s], weight=weight) for s in (slice(0, 4), slice(4, 8))]
    assert not torch.allclose((by_weight_sum[0] + by_weight_sum[1]) / 2, F.cross_entropy(logits, labels, weight=weight))


def test_the_plain_loss_is_unchanged():
    assert type(build_criterion(load_config("base", []).train)) is torch.nn.CrossEntropyLoss


def test_balanced_weights_average_to_one_over_the_split():
    counts = [40, 8, 2]
    weights = balanced_class_weights(counts)
    assert weights == [50 / (3 * 40), 50 / (3 * 8), 50 / (3 * 2)]
    assert sum(w * c for w, c in zip(weights, counts)) / sum(counts) == pytest.approx(1.0)


MULTILABEL = ["data.task=multilabel", "data.format=csv", "data.train_csv=x.csv", "data.val_csv=x.csv"]


@pytest.mark.parametrize("overrides, key", [
    (["train.class_weights=[1.0,-0.5]"], "'train.class_weights'"),
    (["train.class_weights=[0,0]"], "'train.class_weights'"),
    (["train.class_weights=sqrt"], "train.class_weights"),
    (["train.loss=bce", "train.class_weights=balanced"], "'train.class_weights'"),
    (["train.focal_gamma=1.0"], "'train.focal_gamma'"),
    (MULTILABEL + ["train.loss=focal"], "'train.loss' = focal"),
    (MULTILABEL + ["train.class_weights=balanced"], "'train.class_weights'"),
])
def test_wrong_settings_are_refused_by_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config("base", overrides)
    assert key in str(err.value)


@pytest.fixture(scope="module")
def long_tail(tmp_path_factory):
    return make_tree(tmp_path_factory.mktemp("longtail") / "data", {"a": (10, 2), "b": (4, 2), "c": (2, 2)})


def test_a_list_of_the_wrong_length_exits_2_naming_the_key(trainer_of, long_tail, tmp_path, capsys):
    cfg = make_cfg(long_tail, tmp_path / "run", **{"train.class_weights": "[1.0,2.0]"})
    assert exit_code(lambda: trainer_of(cfg)) == 2
    assert "'train.class_weights' has 2 weights; the training split has 3 classes" in capsys.readouterr().err


@pytest.mark.slow
def test_focal_balanced_run_on_a_long_tail_stops_and_resumes_bitwise(trainer_of, long_tail, tmp_path):
    extra = {"train.loss": "focal", "train.class_weights": "balanced", "train.focal_gamma": 1.5,
             "train.batch_size": 4, "train.epochs": 2}
    reference = trainer_of(make_cfg(long_tail, tmp_path / "reference", **extra))
    assert reference.fit() == 0
    saved = torch.load(tmp_path / "reference" / "last.pt", weights_only=True)
    assert saved["config"]["train"]["class_weights"] == balanced_class_weights([10, 4, 2])

    out = tmp_path / "stopped"
    with open_trainer(make_cfg(long_tail, out, **extra)) as trainer:
        criterion, calls = trainer.run.step.objective.criterion, [0]
        assert isinstance(criterion, WeightedFocalLoss) and criterion.gamma == 1.5

        def interrupting(logits, targets):
            calls[0] += 1
            if calls[0] == 6:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in epoch 2 (4 steps an epoch)
            return criterion(logits, targets)

        trainer.run.step.objective.criterion = interrupting
        assert trainer.fit() == 130
    assert "loss: focal loss (gamma 1.5), class weights" in (out / "train.log").read_text()
    assert trainer_of(make_cfg(long_tail, out, **extra), resume="auto").fit() == 0
    resumed = torch.load(out / "last.pt", weights_only=True)
    assert resumed["step"] == saved["step"] == 8
    assert all(torch.equal(resumed["model"][k], saved["model"][k]) for k in saved["model"])
