"""How good the pooled pre-logits features are on labelled data, without the classifier head: cosine kNN
with the training split as the memory bank (a weighted vote, as DINO's evaluation: each of the k
neighbours votes exp(cosine / KNN_TEMPERATURE) for its class) and a linear probe (scikit-learn's
LogisticRegression fitted on the frozen training features). Both in percent, as eval.py's top1."""
from __future__ import annotations

import logging

import numpy as np

from imgcls.embedding.embedder import Embedder

log = logging.getLogger(__name__)

KNN_TEMPERATURE = 0.07
QUERY_ROWS = 1024       # queries searched at a time
PROBE_MAX_ITER = 1000


def split_features(embedder: Embedder, loader) -> tuple[np.ndarray, np.ndarray]:
    """(L2-normalised features [N, D], labels [N]) of an evaluation loader's readable images, in its order."""
    features, labels = [], []
    for images, targets, valid, _ in loader:
        keep = valid.numpy().astype(bool)
        features.append(embedder.vectors(images, len(valid))[keep])
        labels.append(targets.numpy()[keep])
    if not features:
        return np.zeros((0, 0), np.float32), np.zeros(0, np.int64)
    return np.concatenate(features), np.concatenate(labels)


def knn_top1(bank: np.ndarray, bank_labels: np.ndarray, queries: np.ndarray, labels: np.ndarray, k: int,
             num_classes: int) -> float:
    """Top-1 (%) of the weighted vote of each query's k most similar memory-bank vectors (exact search)."""
    import faiss

    index = faiss.IndexFlatIP(bank.shape[1])
    index.add(np.ascontiguousarray(bank, dtype=np.float32))
    k = min(k, len(bank))
    correct = 0
    for start in range(0, len(queries), QUERY_ROWS):
        chunk = np.ascontiguousarray(queries[start:start + QUERY_ROWS], dtype=np.float32)
        scores, rows = index.search(chunk, k)
        votes = np.zeros((len(chunk), num_classes))
        np.add.at(votes, (np.arange(len(chunk))[:, None], bank_labels[rows]), np.exp(scores / KNN_TEMPERATURE))
        correct += int((votes.argmax(1) == labels[start:start + QUERY_ROWS]).sum())
    return 100.0 * correct / max(1, len(queries))


def linear_probe_top1(train: np.ndarray, train_labels: np.ndarray, queries: np.ndarray, labels: np.ndarray) -> float:
    """Top-1 (%) of a logistic regression (L2-regularised, lbfgs) fitted on the frozen training features."""
    from sklearn.linear_model import LogisticRegression

    probe = LogisticRegression(max_iter=PROBE_MAX_ITER)
    probe.fit(train, train_labels)
    return 100.0 * float((probe.predict(queries) == labels).mean()) if len(queries) else 0.0
