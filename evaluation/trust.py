"""The `calibration` record a checkpoint carries (the temperature, the reject thresholds, the feature bank)
built from the validation split's outputs, and the trust figures eval.py reports from one.

Record keys: `temperature` (None: plain softmax), `temperature_setting`, `temperature_decision` (whether a
fitted temperature was applied, and the held-out ECE that decided it), `coverage`, `method` (the reject
score used), `thresholds` (method -> the score that keeps `coverage` of the validation split), `knn_k`,
`num_samples`, and for the feature scores `feature_bank` (fp16, L2-normalised training features: the kNN
score) and, for the Mahalanobis scores the method uses, `class_means` [C, D] and `precision` [D, D] (fp32,
raw features) and `class_means_l2`, `precision_l2` (L2-normalised features); `combined` also stores
`combined_of` (its parts) and `score_scales` (part -> [centre, spread] on the validation split);
`mahalanobis_layers` stores `layer_names` (the stages; `input` first: the network input's statistics),
`layer_means` and `layer_precisions` (one fit per stage), `layer_scales` (per stage [centre, spread] on the
validation split) and `layer_weights` (each stage's weight in the score; absent in records without the
input view, whose stages weigh equally), and the `mahalanobis_l2`
fit (audit.py's outlier score, and the score where the stages cannot be tapped). `reject_notes`: warnings
about the fit (a threshold resting on few validation images, features constant up to rounding).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from core.errors import ConfigError
from core.temperature import temperature_problem
from evaluation.calibration import (apply_temperature, calibrated_temperature, expected_calibration_error, nll,
                                           selective_report)
from evaluation.split_outputs import SplitOutputs
from evaluation.rejection import (BANK_SIZE, DEFAULT_METHOD, KNN_K, COMBINED_OF, LAYERS_METHOD, LOGITS_METHOD,
                                         DEGENERATE_VARIANCE, MIN_SPREAD, Rejector, combined_score, energy_score, knn_score, layer_fits, layer_scores,
                                         layer_view, layer_weights,
                                         mahalanobis_fit, mahalanobis_score, msp_score, multilayer_score, normalise,
                                         rejector_from_record, score_scale, seeded_subset, threshold_for_coverage,
                                         variance_share)


def resolve_temperature(setting: Union[str, float], val: SplitOutputs) -> tuple[Optional[float], list[str], str]:
    """calibration.temperature: `auto` fits on the validation outputs (`calibrated_temperature`'s rule, with
    its notes and its decision), `none` is None, a number is itself; either way within core.temperature's
    range (the config's check and the fit's clamp keep to it; a stored record is checked too)."""
    if setting == "none":
        return None, [], "calibration.temperature=none: the plain softmax"
    if setting == "auto":
        fit = calibrated_temperature(val.logits, val.labels)
        t, notes, decision = fit.temperature, fit.notes, fit.decision
    else:
        t, notes, decision = float(setting), [], f"calibration.temperature={setting}: set, not fitted"
    if temperature_problem(t):
        raise ConfigError(f"calibration.temperature: {temperature_problem(t)}")
    return t, notes, decision


def least_spread(score: str) -> float:
    return MIN_SPREAD["mahalanobis" if score.startswith("mahalanobis") else "energy"]


def feature_bank(bank: SplitOutputs, seed: int, size: int = BANK_SIZE) -> torch.Tensor:
    """A seeded subset of at most `size` training features, L2-normalised, in fp16."""
    keep = seeded_subset(len(bank), size, seed)
    return normalise(bank.features[keep]).half()


def build_record(val: SplitOutputs, bank: Optional[SplitOutputs], setting: Union[str, float], coverage: float,
                 seed: int, method: str = DEFAULT_METHOD, layer_names: Optional[list[str]] = None) -> dict:
    """The checkpoint's `calibration` record. Without the stages' statistics (`layer_names` and the outputs'
    `layers`: a timm model without `feature_info`) mahalanobis_layers falls back to combined; without features
    (a model without a timm classifier, or no training features) the reject option falls back to energy."""
    temperature, notes, decision = resolve_temperature(setting, val)
    scores = {"msp": msp_score(val.logits, temperature), "energy": energy_score(val.logits)}
    record = {"temperature": temperature, "temperature_setting": str(setting), "coverage": float(coverage),
              "knn_k": KNN_K, "num_samples": len(val), "temperature_notes": notes,
              "temperature_decision": decision}
    features = val.features is not None and bank is not None and bank.features is not None and len(bank) > 0
    if features:
        stored = feature_bank(bank, seed)
        scores["knn"] = knn_score(val.features, stored.float(), KNN_K)
        classes = val.logits.shape[1]
        fits = {"mahalanobis": mahalanobis_fit(bank.features, bank.labels, classes),
                "mahalanobis_l2": mahalanobis_fit(normalise(bank.features), bank.labels, classes)}
        scores["mahalanobis"] = mahalanobis_score(val.features, *fits["mahalanobis"])
        scores["mahalanobis_l2"] = mahalanobis_score(normalise(val.features), *fits["mahalanobis_l2"])
        scales = {name: score_scale(scores[name], least_spread(name)) for name in COMBINED_OF}
        scores["combined"] = combined_score([scores[name] for name in COMBINED_OF],
                                            [scales[name] for name in COMBINED_OF])
        layers = bool(layer_names) and val.layers is not None and bank.layers is not None
        if method == LAYERS_METHOD and layers:
            fitted = layer_fits(bank.layers, bank.labels, classes, layer_names)
            per_layer = layer_scores(val.layers, fitted, layer_names)
            layer_scales = [score_scale(x, MIN_SPREAD["mahalanobis"]) for x in per_layer]
            weights = layer_weights(layer_names)
            scores[LAYERS_METHOD] = multilayer_score(per_layer, layer_scales, weights)
            record.update(layer_names=list(layer_names), layer_means=[m for m, _ in fitted],
                          layer_precisions=[p for _, p in fitted], layer_scales=[list(x) for x in layer_scales])
            if weights is not None:
                record["layer_weights"] = weights
        elif method == LAYERS_METHOD:
            method = "combined"
        record["feature_bank"] = stored
        record["reject_notes"] = degenerate_notes(bank, classes, layer_names if LAYERS_METHOD in scores else [])
        needed = {"combined": COMBINED_OF, LAYERS_METHOD: ("mahalanobis_l2",)}.get(method, (method,))
        if "mahalanobis" in needed:
            record["class_means"], record["precision"] = fits["mahalanobis"]
        if "mahalanobis_l2" in needed:
            record["class_means_l2"], record["precision_l2"] = fits["mahalanobis_l2"]
        if method == "combined":
            record["combined_of"] = list(COMBINED_OF)
            record["score_scales"] = {name: list(scales[name]) for name in COMBINED_OF}
    record["reject_notes"] = [*few_images_notes(len(val), coverage), *record.get("reject_notes", [])]
    record["thresholds"] = {name: threshold_for_coverage(s, coverage) for name, s in scores.items()}
    record["method"] = method if method in scores else LOGITS_METHOD
    return record


# Below this many validation images a threshold is said to rest on too few: 95% coverage is not even
# resolvable under 20 (every image is kept)
MIN_THRESHOLD_IMAGES = 20


def few_images_notes(count: int, coverage: float) -> list[str]:
    if count >= MIN_THRESHOLD_IMAGES:
        return []
    return [f"the reject threshold rests on {count} validation image(s) (fewer than {MIN_THRESHOLD_IMAGES}): the "
            f"share it keeps of new images may be far from calibration.coverage={coverage:g}; a larger validation "
            f"split makes it meaningful"]


def degenerate_notes(bank: SplitOutputs, classes: int, layer_names: list[str]) -> list[str]:
    """What the reject fits say when the training features are constant up to rounding (all images alike)."""
    views = [("penultimate features", bank.features), *zip(layer_names, bank.layers or [])]
    flat = [name for name, x in views
            if variance_share(layer_view(x, name), bank.labels, classes) < DEGENERATE_VARIANCE]
    if not flat:
        return []
    return [f"the training images' features ({', '.join(flat)}) are constant up to float rounding (images all "
            f"alike, e.g. of one colour): the Mahalanobis fit is degenerate and scores by the plain distance to "
            f"the class means instead; the threshold keeps images like these and little else"]


def export_record(record: Optional[dict]) -> Optional[dict]:
    """What an export's metadata (JSON) carries: the numbers, with the logits-only reject score (an export
    returns logits, not features)."""
    if not record:
        return None
    return {"temperature": record.get("temperature"), "temperature_setting": record.get("temperature_setting"),
            "coverage": record.get("coverage"), "method": LOGITS_METHOD,
            "temperature_notes": list(record.get("temperature_notes", [])),
            "thresholds": {LOGITS_METHOD: record["thresholds"][LOGITS_METHOD]},
            "num_samples": record.get("num_samples")}


def trust_metrics(outputs: SplitOutputs, record: Optional[dict], threshold: Optional[float] = None,
                  method: Optional[str] = None, log_probs: bool = False) -> dict:
    """eval.py's calibration figures over `outputs`: `ece` (calibrated, percent), `ece_uncalibrated`, `nll`
    (calibrated), `temperature`, `selective` (`threshold`, `coverage`, `accuracy`, percent, and `method`).
    `threshold` replaces the stored one (`--reject-below`). `log_probs`: the outputs are log-probabilities
    (test-time augmentation averages probabilities), whose energy is 0 for every image: no energy selection."""
    temperature = record.get("temperature") if record else None
    labels = outputs.labels
    calibrated = apply_temperature(outputs.logits, temperature)
    correct = calibrated.argmax(1) == labels
    result = {"ece": expected_calibration_error(calibrated, labels),
              "ece_uncalibrated": expected_calibration_error(apply_temperature(outputs.logits, None), labels),
              "nll": nll(outputs.logits, labels, temperature or 1.0) if len(labels) else float("nan"),
              "temperature": temperature,
              "calibration_notes": list(record.get("temperature_notes", [])) if record else [],
              "reject_notes": list(record.get("reject_notes", [])) if record else [],
              "reject_probe": dict(record.get("reject_probe") or {}) if record else {}}
    rejector = (usable_rejector(record, outputs.features is not None, method, outputs.layers is not None)
                if record else None)
    if rejector is not None and not (log_probs and rejector.method == LOGITS_METHOD):
        if threshold is not None:
            rejector.threshold = threshold
        scores = rejector.scores(outputs.logits, outputs.features, outputs.layers)
        selective = selective_report(scores, correct, rejector.threshold)
        selective["method"] = rejector.method
    else:  # no stored threshold, or none that applies: everything kept
        selective = selective_report(torch.zeros(len(labels)), correct, None)
        selective["method"] = None
    result["selective"] = selective
    return result


def usable_rejector(record: dict, have_features: bool, method: Optional[str] = None,
                    have_layers: bool = True) -> Rejector:
    """The record's reject scorer; mahalanobis_l2 where the stages' statistics cannot be had, the logits-only
    one where no features can be had."""
    method = method or record["method"]
    if method == LAYERS_METHOD and not have_layers:
        method = "mahalanobis_l2" if record.get("class_means_l2") is not None else LOGITS_METHOD
    if method in ("knn", "mahalanobis", "mahalanobis_l2", LAYERS_METHOD) and (
            not have_features or method not in record["thresholds"]):
        method = LOGITS_METHOD
    return rejector_from_record(record, method)
