"""The selection strategies as pure functions of a scored pool (imgcls/labelling/strategies.py)."""
import numpy as np
import pytest

from imgcls.labelling.strategies import (STRATEGIES, YOUNG_PER_CLASS, entropies, is_young, k_center_greedy,
                                         margins, select)


def blobs(per_blob=30, centres=4, dim=8, seed=0):
    """`centres` tight clusters of normalised vectors, and probabilities whose margin falls with the position
    inside each cluster (the last member of each is the least sure)."""
    rng = np.random.default_rng(seed)
    means = np.eye(dim)[:centres] * 3
    vectors = np.concatenate([m + rng.normal(0, 0.1, (per_blob, dim)) for m in means])
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    top = np.tile(np.linspace(0.95, 0.55, per_blob), centres)
    probs = np.stack([top, 1 - top, np.zeros_like(top)], axis=1)
    return probs, vectors.astype(np.float32)


def test_margin_and_entropy_rank_the_least_sure_first():
    probs = np.array([[0.9, 0.1, 0.0], [0.4, 0.35, 0.25], [0.6, 0.4, 0.0]])
    np.testing.assert_allclose(margins(probs), [0.8, 0.05, 0.2])
    assert entropies(probs).argmax() == 1
    assert select("margin", probs, np.eye(3), np.zeros((0, 3)), 2, 0, False).positions.tolist() == [1, 2]
    assert select("entropy", probs, np.eye(3), np.zeros((0, 3)), 1, 0, False).positions.tolist() == [1]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_strategy_picks_k_distinct_images_and_the_same_ones_again(strategy):
    probs, vectors = blobs()
    first = select(strategy, probs, vectors, vectors[:2], 8, seed=3, young=False)
    again = select(strategy, probs, vectors, vectors[:2], 8, seed=3, young=False)
    assert len(set(first.positions.tolist())) == 8 == len(first.reasons) == len(first.scores)
    assert first.positions.tolist() == again.positions.tolist()
    assert np.array_equal(first.scores, again.scores)


def test_the_default_spreads_its_picks_where_margin_alone_takes_one_cluster():
    probs, vectors = blobs()
    probs[:30, 0], probs[:30, 1] = 0.5, 0.5  # the first cluster is all unsure: margin takes it alone
    cluster = np.repeat(np.arange(4), 30)
    by_margin = select("margin", probs, vectors, np.zeros((0, 8)), 4, 0, young=False)
    assert set(cluster[by_margin.positions]) == {0}
    default = select("default", probs, vectors, np.zeros((0, 8)), 4, 0, young=False)
    assert sorted(cluster[default.positions]) == [0, 1, 2, 3]
    # within the clusters it took the least sure image (each cluster's last member)
    assert {int(p) % 30 for p in default.positions if cluster[p] != 0} == {29}
    assert default.reasons[0] == "smallest margin in its cluster"


def test_a_young_model_gets_the_most_typical_image_of_each_cluster():
    probs, vectors = blobs()
    rng = np.random.default_rng(1)
    vectors[29] = rng.normal(0, 1, 8)  # an outlier: the least sure, and the least typical
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    young = select("default", probs, vectors, np.zeros((0, 8)), 4, 0, young=True)
    assert 29 not in young.positions.tolist()
    assert young.reasons[0].startswith("most typical")
    assert is_young(YOUNG_PER_CLASS * 3 - 1, 3) and not is_young(YOUNG_PER_CLASS * 3, 3)


def test_coreset_takes_the_farthest_image_from_the_labelled_first():
    vectors = np.array([[1.0, 0.0], [0.99, 0.14], [0.0, 1.0], [-1.0, 0.0]])
    picked = k_center_greedy(vectors, vectors[:1], 2, seed=0)
    assert picked.positions.tolist() == [3, 2]
    assert picked.scores[0] == pytest.approx(2.0)


def test_random_is_a_function_of_the_seed_and_a_budget_beyond_the_pool_is_refused():
    probs, vectors = blobs()
    a = select("random", probs, vectors, vectors[:0], 10, 1, False).positions
    b = select("random", probs, vectors, vectors[:0], 10, 2, False).positions
    assert a.tolist() != b.tolist()
    with pytest.raises(ValueError):
        select("margin", probs, vectors, vectors[:0], len(probs) + 1, 0, False)
