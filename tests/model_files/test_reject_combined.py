"""The combined reject score (issue 34): an image is rejected when either of its standardised scores
(Mahalanobis on L2-normalised features, energy) looks foreign, so the checkpoint rejects what its export
(energy) rejects and what the feature score rejects."""
from __future__ import annotations

import torch

from engine.evaluation.split_outputs import SplitOutputs
from engine.evaluation.rejection import COMBINED_OF, DEFAULT_METHOD, combined_score, rejector_from_record, score_scale
from engine.evaluation.trust import build_record, export_record, usable_rejector

D, C = 16, 4


def split(n, seed, centres, feature_scale=1.0, logit_scale=1.0):
    """Features near the class centres (times `feature_scale`), logits = a linear read-out of them."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % C
    features = (centres[labels] + 0.3 * torch.randn(n, D, generator=g)) * feature_scale
    logits = features @ centres.T * logit_scale
    return SplitOutputs(logits, labels, torch.arange(n), features)


def test_score_scale_and_the_lowest_standardised_score():
    scores = torch.arange(101, dtype=torch.float32)          # median 50, 5th percentile 5
    assert score_scale(scores) == (50.0, 45.0)
    a, b = torch.tensor([50.0, 5.0, 50.0]), torch.tensor([0.0, 0.0, -2.0])
    assert combined_score([a, b], [(50.0, 45.0), (0.0, 1.0)]).tolist() == [0.0, -1.0, -2.0]


def test_combined_rejects_what_either_kind_of_score_rejects():
    centres = torch.randn(C, D, generator=torch.Generator().manual_seed(0)) * 2
    val, bank = split(200, 1, centres), split(1000, 2, centres)
    record = build_record(val, bank, "none", 0.95, seed=0)
    assert DEFAULT_METHOD == "combined" and record["method"] == "combined"
    assert record["combined_of"] == list(COMBINED_OF) and set(record["score_scales"]) == set(COMBINED_OF)
    checkpoint, export = usable_rejector(record, True), rejector_from_record(export_record(record))

    def rejected(rejector, out):
        return float(rejector.rejected(rejector.scores(out.logits, out.features)).double().mean())
    # features like the training data, but weak logits (what the export sees): the export rejects them, and so
    # does the checkpoint, though its Mahalanobis score alone keeps them
    weak = split(200, 3, centres)
    weak.logits = weak.logits * 0.05
    features_only = usable_rejector(record, True, "mahalanobis_l2")
    assert rejected(export, weak) > 0.9 and rejected(checkpoint, weak) > 0.9
    assert rejected(features_only, weak) < 0.2
    # features off the class centres' directions but with ordinary logits: the feature scores catch them
    g = torch.Generator().manual_seed(4)
    odd = split(200, 5, centres)
    odd.features = odd.features + 3.0 * torch.randn(200, D, generator=g)
    odd.logits = split(200, 5, centres).logits
    assert rejected(checkpoint, odd) > 0.9 and rejected(export, odd) < 0.2
    # its own kind of image: about the coverage is kept
    assert 0.02 <= rejected(checkpoint, split(400, 6, centres)) <= 0.12
