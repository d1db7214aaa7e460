"""The combined reject score (issue 34): an image is rejected when either of its standardised scores
(Mahalanobis on L2-normalised features, energy) looks foreign, so the checkpoint rejects what its export
(energy) rejects and what the feature score rejects; and the multi-layer score (mahalanobis_layers, the
default since), which averages the stages' standardised scores."""
from __future__ import annotations

import pytest
import torch

from imgcls.evaluation.rejection import (COMBINED_OF, DEFAULT_METHOD, SplitOutputs, combined_score,
                                         rejector_from_record, score_scale)
from imgcls.evaluation.trust import build_record, export_record, usable_rejector

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
    record = build_record(val, bank, "none", 0.95, seed=0)   # no stages' statistics: combined
    assert record["method"] == "combined"
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


# ---------------------------------------------------------------- mahalanobis_layers (multi-layer Mahalanobis)

def test_pooled_statistics_by_hand():
    from imgcls.evaluation.rejection import pooled_statistics

    x = torch.tensor([[[[1.0, 3.0], [1.0, 3.0]], [[5.0, 5.0], [5.0, 5.0]]]])   # [1, 2, 2, 2]
    assert pooled_statistics(x).tolist() == [[2.0, 5.0, 1.0, 0.0]]              # means, then standard deviations
    four = torch.stack([torch.full((2, 2), v) for v in (1.0, 3.0, 10.0, 20.0)])[None]
    assert pooled_statistics(four, channels=2).tolist() == [[2.0, 15.0, 0.0, 0.0]]  # channel pairs averaged


def test_layer_tap_pools_each_stage_channels_first():
    from imgcls.evaluation.rejection import LayerTap, layer_names

    class Stages(torch.nn.Module):
        """Two stages, the second channels-last (as timm's NHWC stages): [N, 2, 2, 3]."""
        feature_info = [{"module": "a", "num_chs": 3}, {"module": "b", "num_chs": 3}]

        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Identity(), torch.nn.Identity()

        def forward(self, x):
            return self.b(self.a(x).permute(0, 2, 3, 1)).mean(dim=(1, 2))

    model = Stages()
    # the input's statistics first (a forward pre-hook on the model), then the stages
    assert layer_names(model) == ["input", "a", "b"] and layer_names(model, most=1) == ["input", "a"]
    tap = LayerTap(model, layer_names(model))
    x = torch.arange(12, dtype=torch.float32).reshape(1, 3, 2, 2)
    model(x)
    image, a, b = tap.take()
    assert image.shape == (1, 17) and image[0, :3].tolist() == [1.5, 5.5, 9.5]
    expected = torch.tensor([[1.5, 5.5, 9.5] + [1.25 ** 0.5] * 3])   # channel c holds 4c..4c+3
    assert torch.allclose(a, expected) and torch.allclose(b, expected)
    model(x)
    model(-x)   # the second forward (a flipped TTA view) is not recorded
    assert tap.take()[0][0, 0] == 1.5
    tap.close()
    assert not LayerTap(model, ["missing"]).available and layer_names(torch.nn.Linear(2, 2)) == []


def test_multilayer_score_by_hand():
    from imgcls.evaluation.rejection import layer_scores, multilayer_score

    eye = torch.eye(2)
    fits = [(eye, eye), (eye, eye)]                 # class means e1, e2; identity precision
    # stage 1: [2, 0] normalises onto e1 (distance 0); [1, 1] onto (0.7071, 0.7071): 2 x 0.0858 + 0.5 = 0.5858
    first = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    second = torch.tensor([[1.0, 1.0], [0.0, 3.0]])
    scores = layer_scores([first, second], fits)
    assert torch.allclose(scores[0], torch.tensor([0.0, -0.5858]), atol=1e-4)
    assert torch.allclose(scores[1], torch.tensor([-0.5858, 0.0]), atol=1e-4)
    # standardised ((s - centre) / spread) and averaged over the stages: (0 + -1.1716) / 2, (-0.5858 + 0) / 2
    assert torch.allclose(multilayer_score(scores, [(0.0, 1.0), (0.0, 0.5)]), torch.tensor([-0.5858, -0.2929]),
                          atol=1e-4)
    assert torch.allclose(multilayer_score(scores, [(-1.0, 2.0), (0.0, 1.0)]), torch.tensor([-0.0429, 0.1036]),
                          atol=1e-4)
    # weighted (a record with the input view: `layer_weights`): 0.75 x 0 + 0.25 x -1.1716, 0.75 x -0.5858 + 0
    assert torch.allclose(multilayer_score(scores, [(0.0, 1.0), (0.0, 0.5)], [0.75, 0.25]),
                          torch.tensor([-0.2929, -0.4393]), atol=1e-4)


def test_input_statistics_by_hand():
    """The stage-0 view: what tells an upscaled grey digit from a photo whatever the head learnt."""
    from imgcls.evaluation.rejection import input_statistics, layer_weights

    grey = torch.tensor([[0.0, 2.0], [0.0, 2.0]]).expand(1, 3, 2, 2)        # three equal channels: no colour
    stats = input_statistics(grey)[0]
    assert stats[:3].tolist() == [1.0] * 3 and stats[3:6].tolist() == [1.0] * 3    # means, standard deviations
    assert stats[6:8].tolist() == [0.0, 0.0]                                      # colour spread: none
    assert stats[8:11].tolist() == [2.0] * 3 and stats[11:14].tolist() == [0.0] * 3  # horizontal, vertical steps
    assert stats[14:].tolist() == [0.0] * 3       # Laplacian: a 2 x 2 image has no inner pixel (0, not nan)
    # the layout does not change it, nor does a single-channel model lack it (no colour spread then)
    assert torch.equal(input_statistics(grey.contiguous(memory_format=torch.channels_last)), input_statistics(grey))
    assert input_statistics(grey[:, :1]).shape == (1, 5)
    assert not input_statistics(torch.ones(2, 3, 1, 1)).isnan().any()
    steps = torch.tensor([[0.0, 0.0, 0.0], [0.0, 4.0, 0.0], [0.0, 0.0, 0.0]]).expand(1, 1, 3, 3)
    assert input_statistics(steps)[0, -1] == 16.0                                  # 4 x 4 at the one inner pixel
    assert layer_weights(["input", "a", "b"]) == [0.5, 0.25, 0.25] and layer_weights(["a", "b"]) is None


def test_channel_spread_is_torch_std_across_channels():
    """The colour spread is computed by hand for speed: the same numbers as torch.std over dimension 1."""
    from imgcls.evaluation.rejection import channel_spread

    torch.manual_seed(0)
    for shape in ((4, 3, 9, 7), (2, 4, 5, 5), (3, 2, 6)):
        x = torch.randn(shape) * 3 + 1
        assert torch.allclose(channel_spread(x), x.std(dim=1, keepdim=True), rtol=1e-5, atol=1e-6)
    last = torch.randn(4, 3, 9, 7).contiguous(memory_format=torch.channels_last)
    assert torch.allclose(channel_spread(last), last.std(dim=1, keepdim=True), rtol=1e-5, atol=1e-6)
    assert channel_spread(torch.ones(1, 3, 2, 2)).eq(0).all()


def test_statistics_are_the_same_in_pieces_and_in_any_layout():
    """Large batches are reduced a few rows at a time: each row's statistics are the same bitwise as from the
    whole batch in one piece and from a single row, so a validation's record does not depend on the batch it
    came in (DDP shards, the top-up, a separate pass); the input view's not on the memory layout either."""
    from imgcls.evaluation.rejection import by_rows, input_statistics, pooled_statistics

    torch.manual_seed(0)
    images = torch.randn(6, 3, 48, 40)
    stage = torch.randn(6, 160, 24, 20)     # 77k values a row: 3 rows a piece
    last = stage.contiguous(memory_format=torch.channels_last)     # a timm model's stage under channels_last
    for statistics, x in ((input_statistics, images), (pooled_statistics, stage), (pooled_statistics, last)):
        whole = statistics(x)
        assert torch.equal(by_rows(statistics, x, values=2 * x[0].numel()), whole)      # two rows a piece
        assert torch.equal(torch.cat([statistics(x[i:i + 1]) for i in range(6)]), whole)
    assert torch.equal(input_statistics(images.contiguous(memory_format=torch.channels_last)), input_statistics(images))
    assert by_rows(lambda rows: rows.sum(dim=(1, 2, 3))[:, None], stage, values=1).shape == (6, 1)
    assert pooled_statistics(stage).shape == (6, 256)


def layered(n, seed, centres, odd_stage=None):
    """`split` with two stages' statistics: stage 0 near the class centres, stage 1 near fixed directions;
    `odd_stage` puts that stage's statistics somewhere else (what an upscaled grey digit does to a photo model's
    early stages while its penultimate features look ordinary)."""
    out = split(n, seed, centres)
    g = torch.Generator().manual_seed(seed + 100)
    stage0 = centres[out.labels] + 0.3 * torch.randn(n, D, generator=g)
    stage1 = torch.ones(n, 6) + 0.1 * torch.randn(n, 6, generator=g)
    if odd_stage == 1:
        stage1 = stage1 * torch.tensor([1.0, 1, 1, -1, -1, -1])
    out.layers = [stage0, stage1]
    return out


def test_layers_record_rejects_what_one_stage_sees_and_old_records_keep_their_method():
    from imgcls.evaluation.rejection import LAYERS_METHOD

    centres = torch.randn(C, D, generator=torch.Generator().manual_seed(0)) * 2
    val, bank = layered(200, 1, centres), layered(1000, 2, centres)
    record = build_record(val, bank, "none", 0.95, seed=0, layer_names=["s0", "s1"])
    assert DEFAULT_METHOD == LAYERS_METHOD and record["method"] == LAYERS_METHOD
    assert record["layer_names"] == ["s0", "s1"] and len(record["layer_scales"]) == 2
    assert [p.shape for p in record["layer_precisions"]] == [(D, D), (6, 6)]
    assert record["class_means_l2"] is not None          # audit.py's outlier score and the untappable fallback
    rejector = usable_rejector(record, True)
    assert rejector.needs_layers and rejector.layer_names == ["s0", "s1"]

    def rejected(out):
        return float(rejector.rejected(rejector.scores(out.logits, out.features, out.layers)).double().mean())
    odd = layered(200, 3, centres, odd_stage=1)
    assert rejected(odd) > 0.9                       # one stage looks foreign: rejected
    features_only = usable_rejector(record, True, "mahalanobis_l2")
    assert float(features_only.rejected(features_only.scores(odd.logits, odd.features)).double().mean()) < 0.2
    assert 0.02 <= rejected(layered(400, 4, centres)) <= 0.12    # its own kind: about the coverage kept
    # stages that cannot be tapped: the stored Mahalanobis fit of the penultimate features; none: energy
    assert usable_rejector(record, True, have_layers=False).method == "mahalanobis_l2"
    assert usable_rejector(record, False, have_layers=False).method == "energy"
    # a model without stages is calibrated by `combined`, as is every record made before mahalanobis_layers
    plain = build_record(split(200, 1, centres), split(1000, 2, centres), "none", 0.95, seed=0)
    assert plain["method"] == "combined" and "layer_names" not in plain
    assert usable_rejector(plain, True).method == "combined"


def test_a_large_validation_split_is_the_reject_fit_and_its_threshold_is_not_set_in_sample():
    """issue 47: with MIN_VALIDATION_FIT validation images the fit needs no pass over training images: it is made
    on the validation outputs (Ledoit-Wolf shrinkage), and its thresholds on cross-fitted scores, so new images
    of the same kind are kept at about the coverage (an in-sample threshold would reject more of them)."""
    from imgcls.evaluation.rejection import LAYERS_METHOD
    from imgcls.evaluation.trust import MIN_VALIDATION_FIT

    centres = torch.randn(C, D, generator=torch.Generator().manual_seed(0)) * 2
    val = layered(MIN_VALIDATION_FIT, 1, centres)
    record = build_record(val, None, "none", 0.95, seed=0, layer_names=["s0", "s1"])
    assert record["reject_fit"] == "validation" and record["method"] == LAYERS_METHOD
    assert record["feature_bank"].shape[0] == MIN_VALIDATION_FIT
    rejector = usable_rejector(record, True)

    def rejected(out):
        return float(rejector.rejected(rejector.scores(out.logits, out.features, out.layers)).double().mean())
    assert 0.01 <= rejected(layered(2000, 4, centres)) <= 0.10       # new images of its kind: ~5% rejected
    assert rejected(val) < 0.05                                      # its own: fewer (the threshold is not in-sample)
    assert rejected(layered(200, 3, centres, odd_stage=1)) > 0.9
    # a bank given (a split too small, calibrate_best passed over training images): fitted on it, as before
    small = layered(MIN_VALIDATION_FIT - 1, 1, centres)
    assert build_record(small, layered(1000, 2, centres), "none", 0.95, 0, layer_names=["s0", "s1"])[
        "reject_fit"] == "training"
    assert build_record(small, None, "none", 0.95, 0, layer_names=["s0", "s1"])["method"] == "energy"


def test_ledoit_wolf_shrinkage_matches_scikit_learn():
    import numpy as np
    from sklearn.covariance import ledoit_wolf

    from imgcls.evaluation.rejection import ledoit_wolf_shrinkage

    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 40, generator=g, dtype=torch.float64) @ torch.randn(40, 40, generator=g, dtype=torch.float64)
    weight, mu = ledoit_wolf_shrinkage(x)
    ours = (1 - weight) * (x.T @ x / 60) + weight * mu * torch.eye(40, dtype=torch.float64)
    reference, reference_weight = ledoit_wolf(x.numpy(), assume_centered=True)
    assert weight == pytest.approx(reference_weight) and np.allclose(ours.numpy(), reference, atol=1e-10)
