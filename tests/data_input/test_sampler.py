"""Training sampler: class-balanced draws, seeded order per epoch, mid-epoch start."""
from collections import Counter

import pytest
from conftest import make_tree, tiny_overrides

from imgcls.config import load_config
from imgcls.data.build import build_run_data
from imgcls.data.loaders import TrainSampler

IMBALANCED = [0] * 200 + [1] * 20 + [2] * 5


def indices(sampler: TrainSampler, epoch: int, start_batch: int = 0) -> list[tuple[int, int]]:
    sampler.set_epoch(epoch, start_batch)
    return list(sampler)


def test_weighted_sampler_draws_classes_near_uniformly():
    sampler = TrainSampler(IMBALANCED, "weighted", seed=0, batch_size=15)
    counts = Counter()
    epochs = 20
    for epoch in range(epochs):
        drawn = indices(sampler, epoch)
        assert len(drawn) == len(IMBALANCED)       # one epoch = dataset-length draws
        counts.update(IMBALANCED[i] for i, _ in drawn)
    total = epochs * len(IMBALANCED)
    for c in range(3):
        # expected 1/3 each (random would give 89% / 9% / 2%); 5 sigma of a binomial is about 0.035
        assert abs(counts[c] / total - 1 / 3) < 0.04, counts
    # with replacement: the 5 images of the rarest class are drawn many times each per epoch
    first = Counter(i for i, _ in indices(sampler, 0))
    assert max(first[i] for i in range(220, 225)) > 3


def test_weighted_sampler_is_deterministic_per_seed_and_changes_by_epoch():
    a = TrainSampler(IMBALANCED, "weighted", seed=3, batch_size=15)
    b = TrainSampler(IMBALANCED, "weighted", seed=3, batch_size=15)
    c = TrainSampler(IMBALANCED, "weighted", seed=4, batch_size=15)
    assert indices(a, 0) == indices(b, 0)
    assert indices(a, 1) == indices(b, 1)
    assert [i for i, _ in indices(a, 0)] != [i for i, _ in indices(a, 1)]
    assert [i for i, _ in indices(a, 0)] != [i for i, _ in indices(c, 0)]


def test_random_sampler_is_a_seeded_permutation_per_epoch():
    labels = [i % 3 for i in range(50)]
    sampler = TrainSampler(labels, "random", seed=0, batch_size=8)
    e0 = [i for i, _ in indices(sampler, 0)]
    e1 = [i for i, _ in indices(sampler, 1)]
    assert sorted(e0) == list(range(50)) and sorted(e1) == list(range(50))
    assert e0 != e1 and e0 != list(range(50))
    assert e0 == [i for i, _ in indices(TrainSampler(labels, "random", seed=0, batch_size=8), 0)]
    assert sampler.num_batches() == 50 // 8     # the short last batch is dropped by the loader


def test_sequential_sampler_keeps_file_order():
    labels = [0] * 5 + [1] * 5
    assert [i for i, _ in indices(TrainSampler(labels, "sequential", seed=0, batch_size=2), 2)] == list(range(10))


@pytest.mark.parametrize("mode", ["random", "weighted"])
def test_start_batch_skips_exactly_the_consumed_batches(mode):
    sampler = TrainSampler(IMBALANCED, mode, seed=7, batch_size=16)
    full = indices(sampler, 5)
    resumed = indices(sampler, 5, start_batch=3)
    assert resumed == full[3 * 16:]              # same samples and same augmentation seeds
    assert len(sampler) == len(full) - 3 * 16
    assert len({seed for _, seed in full}) == len(full)   # every position gets its own augmentation seed


def test_two_ranks_split_a_random_epoch_without_overlap():
    labels = [i % 3 for i in range(40)]
    shares = [[i for i, _ in indices(TrainSampler(labels, "random", 0, 4, rank=r, world_size=2), 1)] for r in (0, 1)]
    assert set(shares[0]).isdisjoint(shares[1])
    assert sorted(shares[0] + shares[1]) == list(range(40))


def test_config_weighted_sampler_balances_what_the_loader_yields(tmp_path):
    root = make_tree(tmp_path / "data", {"a": (200, 1), "b": (20, 1), "c": (5, 1)}, size=(8, 8))
    cfg = load_config(None, tiny_overrides(root, tmp_path / "run", **{"data.sampler": "weighted",
                                                                      "train.batch_size": 25}))
    data = build_run_data(cfg, cfg.train.batch_size, 0, 1, False)
    counts = Counter()
    for epoch in range(2):
        data.sampler.set_epoch(epoch)
        for _, targets, _ in data.train_loader:
            counts.update(targets.tolist())
    total = sum(counts.values())
    assert total == 2 * 225
    assert all(abs(counts[c] / total - 1 / 3) < 0.09 for c in range(3)), counts
