"""Calibration, reject scores and Grad-CAM geometry as pure functions (no training)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from imgcls.evaluation.calibration import (apply_temperature, expected_calibration_error, fit_temperature, nll,
                                           reliability_bins, selective_report)
from imgcls.evaluation.explain import crop_geometry, heatmap_peak, to_original
from imgcls.evaluation.rejection import (SplitOutputs, energy_score, gather_outputs, knn_score, mahalanobis_fit,
                                         mahalanobis_score, seeded_subset, threshold_for_coverage)
from imgcls.evaluation.trust import build_record, export_record, trust_metrics


def overconfident_split(n=2000, classes=5, seed=0):
    """Logits of a model that is right ~70% of the time but sure of itself: labels drawn from the
    softmax of moderate logits, then the logits scaled up 4x."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, classes, generator=g) * 1.5
    labels = torch.multinomial(base.softmax(1), 1, generator=g).squeeze(1)
    return base * 4.0, labels


def test_fitted_temperature_lowers_nll_and_keeps_the_argmax():
    logits, labels = overconfident_split()
    t = fit_temperature(logits, labels)
    assert 3.0 < t < 5.0  # the logits were scaled by 4 from calibrated ones
    assert nll(logits, labels, t) < nll(logits, labels) - 0.3
    # a minimum: a little either way is worse
    assert nll(logits, labels, t) <= min(nll(logits, labels, t * 1.05), nll(logits, labels, t / 1.05))
    assert torch.equal(apply_temperature(logits, t).argmax(1), logits.argmax(1))
    before = expected_calibration_error(apply_temperature(logits, None), labels)
    after = expected_calibration_error(apply_temperature(logits, t), labels)
    assert after < before / 3


def grid_minimum(objective, low=math.log(0.05), high=math.log(20.0)) -> float:
    """exp of the u minimising `objective` (of a tensor of log T values, all at once) on a grid of log T,
    refined four times around the best point (the last grid's spacing: 5e-6 in log T)."""
    for points in (121, 41, 41, 41, 41):
        grid = torch.linspace(low, high, points, dtype=torch.float64)
        best = int(objective(grid).argmin())
        spacing = float(grid[1] - grid[0])
        low, high = float(grid[best]) - 2 * spacing, float(grid[best]) + 2 * spacing
    return math.exp(float(grid[best]))


def test_the_temperature_search_finds_the_dense_grids_optimum():
    """Issue 47: the no-grad search on log T (which replaced LBFGS with autograd) lands on the optimum a dense
    grid finds, to 1e-4 relative, for the NLL, the NLL with a prior on T and the confidence match."""
    from imgcls.evaluation.calibration import PRIOR_SD, match_temperature

    over, over_labels = overconfident_split(n=600)
    g = torch.Generator().manual_seed(7)
    under = torch.randn(300, 10, generator=g) * 0.2
    under_labels = torch.randint(0, 10, (300,), generator=g)
    under[torch.arange(300), under_labels] += 2.0
    under[:4, 0] += 4.0                                              # a few errors: the prior matters
    for logits, labels in ((over, over_labels), (under, under_labels)):
        n = len(labels)

        def scaled(u):                                               # [grid, n, C] log-probabilities
            return (logits.double()[None] / u.exp()[:, None, None]).log_softmax(dim=2)
        picked = torch.arange(n), labels
        for prior in (None, PRIOR_SD):
            def objective(u):
                prior_term = 0 if prior is None else u * u / (2 * prior ** 2 * n)
                return -scaled(u)[:, picked[0], picked[1]].mean(1) + prior_term
            assert fit_temperature(logits, labels, prior_sd=prior) == pytest.approx(grid_minimum(objective), rel=1e-4)
        right = int((logits.argmax(1) == labels).sum())
        prior = 0.5 / (1 + n - right)                                    # Jeffreys's, weighted by the errors
        jeffreys = (right + prior) / (n + 2 * prior)
        for count, target in (("jeffreys", jeffreys), ("plain", right / n if n - right >= 5 else jeffreys)):
            def mismatch(u):
                return (scaled(u).exp().max(dim=2).values.mean(1) - target).abs()
            assert match_temperature(logits, labels, count) == pytest.approx(grid_minimum(mismatch), rel=1e-4)


def test_ece_against_a_hand_computation():
    probs = torch.tensor([[0.95, 0.05], [0.92, 0.08], [0.58, 0.42], [0.3, 0.7], [0.55, 0.45]])
    labels = torch.tensor([0, 1, 0, 1, 1])
    # 15 bins of width 1/15: 0.95 and 0.92 -> bin (0.9333, 1.0] is 0.95 only; 0.92 -> (0.8667, 0.9333];
    # 0.58 -> (0.5333, 0.6]; 0.7 -> (0.6667, 0.7333]; 0.55 -> (0.5333, 0.6]
    # bins: {0.95: hit} |1-0.95|=0.05; {0.92: miss} 0.92; {0.58 hit, 0.55 miss} |0.5-0.565| x2;
    # {0.7 hit} 0.3
    hand = (0.05 + 0.92 + 2 * 0.065 + 0.3) / 5 * 100
    assert expected_calibration_error(probs, labels) == pytest.approx(hand)
    bins = reliability_bins(probs, labels)
    assert sum(b["count"] for b in bins) == 5 and len(bins) == 15
    assert bins[8]["count"] == 2 and bins[8]["accuracy"] == pytest.approx(0.5)


def test_threshold_keeps_the_requested_coverage():
    scores = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    for coverage in (0.5, 0.9, 0.95, 0.99, 1.0):
        t = threshold_for_coverage(scores, coverage)
        kept = int((scores >= t).sum())
        assert kept == math.ceil(coverage * 1000)  # at least the coverage, and not one more
    report = selective_report(scores, torch.ones(1000, dtype=torch.bool), threshold_for_coverage(scores, 0.95))
    assert report["coverage"] == pytest.approx(95.0) and report["accuracy"] == 100.0


def test_knn_and_mahalanobis_reject_far_features_and_keep_near_ones():
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(3, 32, generator=g) * 3
    labels = torch.arange(300) % 3
    bank = centres[labels] + torch.randn(300, 32, generator=g) * 0.3
    near = centres[torch.arange(60) % 3] + torch.randn(60, 32, generator=g) * 0.3
    far = torch.randn(60, 32, generator=g) * 3
    t = threshold_for_coverage(knn_score(near, bank), 0.95)
    assert float((knn_score(far, bank) < t).double().mean()) > 0.9
    means, precision = mahalanobis_fit(bank, labels, 3)
    t = threshold_for_coverage(mahalanobis_score(near, means, precision), 0.95)
    assert float((mahalanobis_score(far, means, precision) < t).double().mean()) > 0.9


def test_record_stores_a_small_fp16_bank_and_exports_carry_numbers_only():
    g = torch.Generator().manual_seed(0)
    val = SplitOutputs(torch.randn(50, 3, generator=g), torch.arange(50) % 3, torch.arange(50),
                       torch.randn(50, 8, generator=g))
    bank = SplitOutputs(torch.randn(5000, 3, generator=g), torch.arange(5000) % 3, torch.arange(5000),
                        torch.randn(5000, 8, generator=g))
    record = build_record(val, bank, "auto", 0.9, seed=3)
    assert record["feature_bank"].dtype == torch.float16 and record["feature_bank"].shape == (2048, 8)
    assert set(record["thresholds"]) == {"msp", "energy", "knn", "mahalanobis", "mahalanobis_l2", "combined"}
    assert record["method"] == "combined"
    assert record["class_means_l2"].shape == (3, 8) and record["precision_l2"].shape == (8, 8)
    assert build_record(val, bank, "auto", 0.9, seed=3, method="knn").keys() >= {"feature_bank"}
    assert build_record(val, bank, 2.5, 0.9, seed=3)["temperature"] == 2.5
    assert build_record(val, bank, "none", 0.9, seed=3)["temperature"] is None
    assert seeded_subset(5000, 2048, 3) == seeded_subset(5000, 2048, 3) != seeded_subset(5000, 2048, 4)
    exported = export_record(record)
    assert exported["method"] == "energy" and "feature_bank" not in exported
    # without features (an export), the metrics fall back to the energy score
    metrics = trust_metrics(SplitOutputs(val.logits, val.labels, val.indices, None), exported)
    assert metrics["selective"]["method"] == "energy"
    assert metrics["selective"]["coverage"] == pytest.approx(90.0, abs=2.1)
    assert float((energy_score(val.logits) >= exported["thresholds"]["energy"]).double().mean()) >= 0.9
    # test-time augmentation gives log-probabilities, whose energy is 0 everywhere: no selection by it
    log_probs = SplitOutputs(val.logits.log_softmax(1), val.labels, val.indices, None)
    selective = trust_metrics(log_probs, exported, log_probs=True)["selective"]
    assert selective["threshold"] is None and selective["coverage"] == 100.0 and selective["method"] is None


def test_gather_outputs_sorts_by_index_in_one_process():
    out = SplitOutputs(torch.tensor([[1.0], [2.0], [3.0]]), torch.tensor([0, 1, 2]), torch.tensor([4, 0, 2]), None)
    gathered = gather_outputs(out)
    assert gathered.indices.tolist() == [0, 2, 4] and gathered.logits.squeeze(1).tolist() == [2.0, 3.0, 1.0]


@pytest.mark.parametrize("size,resize_to,img_size", [((200, 100), 36, 32), ((100, 300), 64, 56), ((64, 64), 64, 64)])
def test_peak_maps_back_to_the_original_pixels(size, resize_to, img_size):
    """A heatmap peak at a known place of the crop lands on the original pixel that the eval transform
    moved there (checked by running torchvision's own resize and crop on a coordinate image)."""
    import torchvision.transforms.v2.functional as F

    width, height = size
    xs = torch.arange(width, dtype=torch.float32)[None, None, :].expand(1, height, width)
    ys = torch.arange(height, dtype=torch.float32)[None, :, None].expand(1, height, width)
    coords = torch.cat([xs, ys])
    cropped = F.center_crop(F.resize(coords, resize_to, antialias=False), img_size)
    geometry = crop_geometry(width, height, resize_to, img_size)
    for cx, cy in ((0, 0), (img_size - 1, img_size // 3), (img_size // 2, img_size - 1)):
        cam = np.zeros((img_size, img_size))
        cam[cy, cx] = 1.0
        x, y = to_original(*heatmap_peak(cam), geometry, width, height)
        want_x, want_y = cropped[0, cy, cx].item(), cropped[1, cy, cx].item()
        assert abs(x - want_x) <= 1.0 and abs(y - want_y) <= 1.0


def test_the_temperature_range_is_one_rule_for_config_fit_and_stored_records():
    from imgcls.config import ConfigError, load_config
    from imgcls.core.errors import CheckpointError
    from imgcls.core.settings import MAX_TEMPERATURE, MIN_TEMPERATURE, check_calibration_record, temperature_problem

    for bad in ("1e-300", "0", "-1", "21", ".nan", ".inf"):
        with pytest.raises(ConfigError, match="calibration.temperature"):
            load_config("base", [f"calibration.temperature={bad}"])
    assert load_config("base", ["calibration.temperature=0.05"]).calibration.temperature == 0.05
    assert [temperature_problem(t) is None for t in (MIN_TEMPERATURE, 1, MAX_TEMPERATURE, 0.049, True, "1")] == \
        [True, True, True, False, False, False]
    logits, labels = overconfident_split()
    assert temperature_problem(fit_temperature(logits * 1e6, labels)) is None  # a fit that runs off: clamped
    check_calibration_record({"temperature": None, "thresholds": {"energy": 1.5}}, "m.pt")
    for record in ({"temperature": float("nan")}, {"temperature": -1.0}, {"temperature": "2"},
                   {"temperature": 1.0, "thresholds": {"energy": float("nan")}}):
        with pytest.raises(CheckpointError, match="m.pt"):
            check_calibration_record(record, "m.pt")


def test_infer_json_never_holds_a_bare_nan(tmp_path):
    from imgcls.tasks.rows import write_rows, write_tag_rows

    out = tmp_path / "rows.json"
    write_rows([{"path": "a.png", "label": "x", "prob": float("nan"), "error": None}], out, 0)
    assert json.loads(out.read_text())[0]["prob"] is None and "NaN" not in out.read_text()
    write_tag_rows([{"path": "a.png", "labels": ["x"], "probs": {"x": float("nan")}, "error": None}], out, ["x"], " ")
    assert json.loads(out.read_text())[0]["probs"] == {"x": None} and "NaN" not in out.read_text()


def constant_outputs(n: int, rounding: float, seed: int) -> SplitOutputs:
    """Outputs of n copies of one image, as two passes give them: equal up to `rounding` (batch arrangement)."""
    g = torch.Generator().manual_seed(seed)
    noisy = lambda base: base + rounding * torch.randn(n, base.shape[1], generator=g)  # noqa: E731
    logits = torch.tensor([[2.0, 0.5, -1.0]]).expand(n, -1)
    features = torch.linspace(0.1, 1.0, 16)[None].expand(n, -1)
    layers = [torch.linspace(0.2, 0.9, 8)[None].expand(n, -1), torch.linspace(1.0, 3.0, 12)[None].expand(n, -1)]
    return SplitOutputs(noisy(logits), torch.arange(n) % 3, torch.arange(n), noisy(features),
                        [noisy(x) for x in layers])


def test_reject_option_on_constant_colour_data_keeps_every_copy_in_every_pass_and_says_so():
    """Training's pass, eval.py's and infer.py's differ by float rounding only: each keeps every copy (it was
    95%, 0% and 100%: precision matrices of 1e15 turned rounding into whole units)."""
    from imgcls.evaluation.rejection import rejector_from_record

    val, bank = constant_outputs(40, 1e-8, 0), constant_outputs(60, 1e-8, 1)
    record = build_record(val, bank, "none", 0.95, seed=0, method="mahalanobis_layers", layer_names=["s1", "s2"])
    assert record["method"] == "mahalanobis_layers"
    assert max(float(p.abs().max()) for p in record["layer_precisions"]) < 1e3  # shrunk to a scaled identity
    assert float(record["precision_l2"].abs().max()) < 1e3
    notes = record["reject_notes"]
    assert len(notes) == 1 and "(penultimate features, s1, s2) are constant up to float rounding" in notes[0]
    combined = build_record(val, bank, "none", 0.95, seed=0, method="combined")
    for stored, method in ((record, "mahalanobis_layers"), (record, "mahalanobis_l2"), (record, "energy"),
                           (record, "msp"), (combined, "combined")):
        rejector = rejector_from_record(stored, method)
        for seed in (2, 3, 4):  # other passes over the same images
            again = constant_outputs(40, 1e-7, seed)
            assert not rejector.rejected(rejector.scores(again.logits, again.features, again.layers)).any(), method
    foreign = SplitOutputs(val.logits, val.labels, val.indices, val.features + 0.5, [x + 0.5 for x in val.layers])
    rejector = rejector_from_record(record)
    assert rejector.rejected(rejector.scores(foreign.logits, foreign.features, foreign.layers)).all()
    assert any("constant up to float rounding" in n for n in trust_metrics(val, record)["reject_notes"])


def test_a_threshold_never_falls_between_copies_and_one_on_few_images_is_warned():
    tied = torch.tensor([3.0, 2.0, 2.0 + 1e-9, 2.0 - 1e-9, 2.0, 1.0])
    t = threshold_for_coverage(tied, 0.5)  # 3 of 6 would cut through the copies scoring 2: all four kept
    assert int((tied >= t).sum()) == 5 and 1.0 < t < 2.0 - 1e-6
    g = torch.Generator().manual_seed(0)
    one = SplitOutputs(torch.randn(1, 3, generator=g), torch.tensor([0]), torch.tensor([0]), torch.randn(1, 8, generator=g))
    bank = SplitOutputs(torch.randn(90, 3, generator=g), torch.arange(90) % 3, torch.arange(90),
                        torch.randn(90, 8, generator=g))
    notes = build_record(one, bank, "none", 0.95, seed=0)["reject_notes"]
    assert len(notes) == 1 and notes[0].startswith("the reject threshold rests on 1 validation image(s) (fewer than 20)")
    many = SplitOutputs(torch.randn(40, 3, generator=g), torch.arange(40) % 3, torch.arange(40),
                        torch.randn(40, 8, generator=g))
    assert build_record(many, bank, "none", 0.95, seed=0)["reject_notes"] == []


def test_grad_cam_reads_the_deepest_stage_fine_enough_for_the_input():
    """Issue 51: at 48 px ResNet's last stage is a 2x2 map, coarser than the objects; Grad-CAM reads the
    deepest stage with at least 6 cells a side, and says which."""
    import timm

    from imgcls.evaluation.explain import MIN_CAM_CELLS, Explainer, target_layer

    model = timm.create_model("resnet10t", pretrained=False, num_classes=3)
    assert target_layer(model, 224)[0] == "layer4"                  # 7x7
    assert target_layer(model, 48)[0] == "layer2"                   # 6x6 (layer3: 3x3, layer4: 2x2 or less)
    assert target_layer(model, 8)[0] == "act1"                      # nothing fine enough: the finest stage
    assert target_layer(model)[0] == "layer4"                       # no input size: the last stage
    explainer = Explainer(model, 48)
    try:
        assert explainer.describe() == "'layer2' (6x6 cells)" and MIN_CAM_CELLS == 6
        cams = explainer.heatmaps(torch.randn(2, 3, 48, 48), [0, 1])
        assert cams.shape == (2, 48, 48)
    finally:
        explainer.close()


def test_far_off_images_are_made_at_the_models_input_and_say_when_rejection_is_weak():
    """Issue 51: a 3-epoch photos model rejected 51.6% of digit images while 10-epoch ones rejected 93-94%;
    the fit measures its rejection of generated far-off images and says when it is weak."""
    from imgcls.commands.evaluate import format_trust_line
    from imgcls.evaluation.rejection import PROBE_KINDS, far_off_image, probe_batches, rejection_rates, weak_note

    rng = np.random.default_rng(0)
    for kind in PROBE_KINDS:
        image = far_off_image(kind, rng, 40, 3)
        assert image.shape == (3, 40, 40) and image.dtype == np.uint8
    assert float(far_off_image("flat colours", rng, 16, 3).std(axis=(1, 2)).max()) == 0.0
    batches = probe_batches(32, 1, seed=0, per_kind=5)
    assert [b[0].shape for b in batches] == [(5, 1, 32, 32)] * len(PROBE_KINDS)
    assert torch.equal(probe_batches(32, 1, seed=0, per_kind=5)[2][0], batches[2][0])   # seeded
    scores = {"noise": torch.tensor([-5.0, 1.0, 2.0, 1.0]), "strokes": torch.tensor([-9.0, -8.0, 7.0, 6.0])}
    rates = rejection_rates(scores, threshold=0.0)
    assert rates == {"noise": 25.0, "strokes": 50.0}
    note = weak_note(rates, "mahalanobis_layers")
    assert note is not None and "only 38% of generated far-off images" in note and "noise 25%, strokes 50%" in note
    assert weak_note({"noise": 100.0, "strokes": 100.0, "grey blocks": 87.5}, "energy") is None   # mean 95.8%
    assert weak_note({"noise": 100.0, "flat colours": 75.0, "strokes": 100.0, "grey blocks": 70.8},
                     "mahalanobis_layers") is not None                  # mean 86.5%: a 3-epoch model's
    line = format_trust_line({"ece": 1.0, "ece_uncalibrated": 2.0, "nll": 0.5, "temperature": 1.0,
                              "selective": {"threshold": None}, "reject_notes": [note]})
    assert f"reject warning: {note}" in line


def test_the_probe_scores_far_off_images_through_the_model():
    import timm

    from imgcls.compute.device import DeviceInput
    from imgcls.evaluation.rejection import PROBE_KINDS, Rejector, probe_rejector

    model = timm.create_model("resnet10t", pretrained=False, num_classes=3).eval()
    device_input = DeviceInput(torch.device("cpu"), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), False, None)
    everything = probe_rejector(model, device_input, Rejector("energy", float("inf")), 32, 3, seed=0)
    nothing = probe_rejector(model, device_input, Rejector("energy", -float("inf")), 32, 3, seed=0)
    assert list(everything) == list(PROBE_KINDS)
    assert set(everything.values()) == {100.0} and set(nothing.values()) == {0.0}


def test_the_kept_validation_outputs_are_a_separate_pass_s_and_bounded():
    """Training's validation records what the fits after training need; what it keeps equals a separate
    collect_outputs pass bitwise (no second pass needed), the objective's own receiver still sees every
    batch, and a split over the byte limit keeps nothing (the calibration then passes again)."""
    import timm

    from imgcls.compute.device import DeviceInput
    from imgcls.evaluation.evaluate import evaluate
    from imgcls.evaluation.rejection import collect_outputs
    from imgcls.tasks import get_task
    from imgcls.training.calibrate import RECORDED_VALIDATIONS, KeptOutputs

    torch.manual_seed(0)
    model = timm.create_model("resnet10t", num_classes=3).eval()
    batches = [(torch.randint(0, 256, (4, 3, 24, 24), dtype=torch.uint8), torch.tensor([0, 1, 2, 0]),
                torch.tensor([True, True, False, True]), torch.arange(4) + 4 * i) for i in range(3)]
    device_input = DeviceInput(torch.device("cpu"), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), False, None)
    seen = []
    kept = KeptOutputs(enabled=True)
    on_outputs = kept.start(model, lambda *args: seen.append(len(args[0])))
    evaluate(model, batches, device_input, get_task("multiclass"), ["a", "b", "c"], on_outputs=on_outputs)
    kept.finish(completed=True)
    assert kept.outputs() is None  # nothing kept until the pass is the best one
    kept.keep(epoch=0)
    ours, theirs = kept.outputs(), collect_outputs(model, batches, device_input, with_features=True, with_layers=True)
    assert seen == [4, 4, 4] and len(ours) == 9 and ours.indices.tolist() == theirs.indices.tolist()
    for a, b in [(ours.logits, theirs.logits), (ours.features, theirs.features), *zip(ours.layers, theirs.layers)]:
        assert torch.equal(a, b)
    assert not any(m._forward_hooks for m in model.modules())  # the taps are removed
    small = KeptOutputs(enabled=True, limit=1000)
    evaluate(model, batches, device_input, get_task("multiclass"), ["a", "b", "c"], on_outputs=small.start(model, None))
    small.finish(completed=True)
    small.keep(epoch=1)
    assert small.outputs() is None
    early = KeptOutputs(enabled=True)  # more than RECORDED_VALIDATIONS to come: this pass records nothing
    assert early.start(model, None, validations_left=RECORDED_VALIDATIONS + 1) is None
    early.finish(completed=True)
    early.keep(epoch=0)
    assert early.outputs() is None and not any(m._forward_hooks for m in model.modules())
    stopped = KeptOutputs(enabled=True)
    stopped.start(model, None)
    stopped.finish(completed=False)  # a pass a stop signal ended keeps nothing
    stopped.keep(epoch=2)
    assert stopped.outputs() is None


def test_a_short_top_up_pass_decodes_in_process():
    """The reject fit's top-up pass (the training images a small validation split lacks) forks no loader
    workers for two batches or fewer: forking them took longer than decoding the images."""
    from imgcls.training.calibrate import top_up_workers

    assert top_up_workers(32, 32, 2) == 0 and top_up_workers(64, 32, 4) == 0
    assert top_up_workers(65, 32, 2) == 2 and top_up_workers(160, 32, 0) == 0
