"""Which pool images to label next: the selection strategies, pure functions of a scored pool (NumPy and
scikit-learn; no torch, no files), so the benchmark's simulated loop and `imgcls label pick` choose alike.

Every strategy takes the pool's calibrated probabilities `probs` [N, C], its L2-normalised embeddings `vectors`
[N, D], the labelled images' embeddings `labelled` [M, D] (M may be 0), the budget K and a seed, and returns a
`Selection`: K distinct pool positions in the order picked, each with its score and the reason it was picked.
The same inputs give the same selection.

`default` (cluster-margin): k-means of the pool's embeddings into K clusters, and from each cluster the image the
model is least sure of (the smallest margin between its top two probabilities): uncertain, and spread over the
pool, where uncertainty alone picks a batch of near-identical images. While the model is young (fewer than
YOUNG_PER_CLASS labelled images per class: the cold start, where uncertainty is no better than random), each
cluster gives its most typical image instead (TypiClust: the inverse mean distance to its nearest neighbours).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

STRATEGIES = ("default", "random", "margin", "entropy", "coreset")

# fewer labelled images per class than this: the model is young (the typicality half of `default`); 5 of 3, 5 and
# 10, measured by benchmarking/labelling_loop.py (docs/labelling.md): 10 lost to random at 100 digits labels
YOUNG_PER_CLASS = 5

# TypiClust's neighbourhood: the typicality of an image is 1 / the mean distance to this many nearest neighbours
TYPICALITY_NEIGHBOURS = 20

KMEANS_INITS = 3


@dataclass
class Selection:
    positions: np.ndarray      # [K] int64 pool positions, in the order picked
    scores: np.ndarray         # [K] float64: what the strategy ranked by (see `reasons`)
    reasons: list[str]         # one line per pick: why


def is_young(labelled_count: int, num_classes: int) -> bool:
    """Whether the labelled set is still in the cold start: fewer than YOUNG_PER_CLASS images per class."""
    return labelled_count < YOUNG_PER_CLASS * num_classes


def margins(probs: np.ndarray) -> np.ndarray:
    """Top-1 minus top-2 probability per row (1 for a one-class model): small is uncertain."""
    if probs.shape[1] < 2:
        return np.ones(len(probs))
    top2 = -np.partition(-probs, 1, axis=1)[:, :2]
    return (top2[:, 0] - top2[:, 1]).astype(np.float64)


def entropies(probs: np.ndarray) -> np.ndarray:
    p = np.clip(probs.astype(np.float64), 1e-12, 1.0)
    return -(p * np.log(p)).sum(axis=1)


def select(strategy: str, probs: np.ndarray, vectors: np.ndarray, labelled: np.ndarray, budget: int, seed: int,
           young: bool) -> Selection:
    """The `strategy`'s K = `budget` picks of the pool (1 <= K <= N, checked by the caller)."""
    n = len(probs)
    if not 1 <= budget <= n:
        raise ValueError(f"budget {budget} for a pool of {n}")
    if strategy == "random":
        chosen = np.random.default_rng(seed).choice(n, size=budget, replace=False)
        return Selection(chosen.astype(np.int64), np.zeros(budget), ["random"] * budget)
    if strategy == "margin":
        return top_ranked(margins(probs), budget, "margin (smallest first)")
    if strategy == "entropy":
        return top_ranked(-entropies(probs), budget, "entropy (largest first)", sign=-1.0)
    if strategy == "coreset":
        return k_center_greedy(vectors, labelled, budget, seed)
    if strategy == "default":
        return cluster_picks(probs, vectors, budget, seed, young)
    raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")


def top_ranked(key: np.ndarray, budget: int, what: str, sign: float = 1.0) -> Selection:
    """The `budget` smallest keys (ties: the earlier pool position first)."""
    chosen = np.argsort(key, kind="stable")[:budget]
    return Selection(chosen.astype(np.int64), sign * key[chosen], [what] * budget)


def k_center_greedy(vectors: np.ndarray, labelled: np.ndarray, budget: int, seed: int) -> Selection:
    """Core-set (Sener & Savarese): each pick is the pool image farthest from everything labelled or picked
    (Euclidean distance of the normalised embeddings); with nothing labelled the first pick is a seeded draw."""
    x = vectors.astype(np.float64)
    if len(labelled):
        nearest = np.full(len(x), np.inf)
        for start in range(0, len(labelled), 1024):
            nearest = np.minimum(nearest, pairwise_distances(x, labelled[start:start + 1024]).min(axis=1))
        first = None
    else:
        nearest = np.full(len(x), np.inf)
        first = int(np.random.default_rng(seed).integers(len(x)))
    chosen, scores = [], []
    for _ in range(budget):
        pick = first if first is not None else int(np.argmax(nearest))
        first = None
        chosen.append(pick)
        scores.append(float(nearest[pick]) if np.isfinite(nearest[pick]) else 0.0)
        nearest = np.minimum(nearest, pairwise_distances(x, x[pick:pick + 1])[:, 0])
        nearest[chosen] = -1.0
    return Selection(np.array(chosen, np.int64), np.array(scores), ["farthest from the labelled and picked"] * budget)


def pairwise_distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    squared = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * a @ b.T
    return np.sqrt(np.maximum(squared, 0.0))


def kmeans_clusters(vectors: np.ndarray, k: int, seed: int) -> np.ndarray:
    """The cluster of each pool image (k-means with a seeded k-means++ start)."""
    from sklearn.cluster import KMeans

    if k >= len(vectors):
        return np.arange(len(vectors))
    return KMeans(n_clusters=k, n_init=KMEANS_INITS, random_state=seed).fit_predict(vectors.astype(np.float64))


def typicality(vectors: np.ndarray) -> np.ndarray:
    """1 / the mean distance to the TYPICALITY_NEIGHBOURS nearest other images of `vectors` (a cluster)."""
    if len(vectors) < 2:
        return np.ones(len(vectors))
    distances = pairwise_distances(vectors, vectors)
    np.fill_diagonal(distances, np.inf)
    k = min(TYPICALITY_NEIGHBOURS, len(vectors) - 1)
    nearest = np.partition(distances, k - 1, axis=1)[:, :k]
    return 1.0 / (nearest.mean(axis=1) + 1e-12)


def cluster_picks(probs: np.ndarray, vectors: np.ndarray, budget: int, seed: int, young: bool) -> Selection:
    """One pick per k-means cluster (K = budget): the most typical image while the model is young, else the one
    with the smallest margin; the picks ordered by that score (most typical / least sure first)."""
    clusters = kmeans_clusters(vectors, budget, seed)
    margin = margins(probs)
    chosen, scores = [], []
    for cluster in range(int(clusters.max()) + 1):
        members = np.flatnonzero(clusters == cluster)
        if not len(members):
            continue
        if young:
            typical = typicality(vectors[members].astype(np.float64))
            best = int(np.argmax(typical))
            chosen.append(int(members[best]))
            scores.append(-float(typical[best]))
        else:
            best = int(np.argmin(margin[members]))
            chosen.append(int(members[best]))
            scores.append(float(margin[members[best]]))
    order = np.argsort(np.array(scores), kind="stable")
    chosen = np.array(chosen, np.int64)[order]
    scores = np.array(scores)[order]
    if len(chosen) < budget:  # k-means left clusters empty (identical vectors): the rest by margin
        taken = set(chosen.tolist())
        rest = [i for i in np.argsort(margin, kind="stable") if i not in taken][:budget - len(chosen)]
        chosen = np.concatenate([chosen, np.array(rest, np.int64)])
        scores = np.concatenate([scores, margin[rest] if not young else np.zeros(len(rest))])
    if young:
        return Selection(chosen, -scores, ["most typical of its cluster (young model)"] * len(chosen))
    return Selection(chosen, scores, ["smallest margin in its cluster"] * len(chosen))
