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
`reject_fit`: what the feature scores were fitted on: `validation` (the validation outputs, MIN_VALIDATION_FIT
or more), `validation+training` (fewer, topped up to MIN_VALIDATION_FIT with training images' outputs), both with
thresholds on cross-fitted validation scores; or `training` (records before that: up to 2,048 training images).
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from imgcls.core.errors import ConfigError
from imgcls.core.settings import temperature_problem
from imgcls.evaluation.calibration import (apply_temperature, calibrated_temperature, expected_calibration_error, nll,
                                           selective_report)
from imgcls.evaluation.rejection import (BANK_SIZE, COMBINED_OF, DEFAULT_METHOD, DEGENERATE_VARIANCE, KNN_K,
                                         LAYERS_METHOD, LOGITS_METHOD, MIN_SPREAD, REJECT_SCORE_OUTPUT, Rejector,
                                         SplitOutputs, combined_score, energy_score, joined_outputs, knn_score,
                                         layer_fits, layer_scores, layer_view, layer_weights, mahalanobis_fit,
                                         mahalanobis_score, msp_score, multilayer_score, normalise,
                                         rejector_from_record, score_scale, seeded_subset, threshold_for_coverage,
                                         variance_share)


def resolve_temperature(setting: Union[str, float], val: SplitOutputs) -> tuple[Optional[float], list[str], str]:
    """calibration.temperature: `auto` fits on the validation outputs (`calibrated_temperature`'s rule, with
    its notes and its decision), `none` is None, a number is itself; either way within core.settings's
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


# The fewest images the reject fit is made on: the validation outputs (kept from the pass that chose best.pt:
# no pass at all after training), topped up with training images' outputs when the split holds fewer
# (`top_up_count`: a pass over that many only). Its Mahalanobis fits are shrunk by Ledoit-Wolf and its
# thresholds and scales set on cross-fitted validation scores (each validation image scored by a fit on the
# other folds and the top-up), so nothing is fitted in-sample. Measured (docs/advice.md): fits on 200 and 350
# images of resnet10t's photos-like models rejected digits, sketches and noise as well as the fit on 700
# training images, or better; on 140 validation images alone one of four trainings fell to 80.7% of digits.
MIN_VALIDATION_FIT = 200
CROSS_FIT_FOLDS = 5   # fixed folds: position in the (index-ordered) split modulo 5


def top_up_count(validation_images: int) -> int:
    """How many training images' outputs the reject fit adds to `validation_images` validation ones."""
    return max(0, MIN_VALIDATION_FIT - validation_images)


def fits_on_validation(val: SplitOutputs, top_up: Optional[SplitOutputs]) -> bool:
    """Whether the reject fit is made on the validation outputs (with features): MIN_VALIDATION_FIT of them, or
    fewer with a usable `top_up` (all the training images there are, when the training split is small too)."""
    return val.features is not None and (len(val) >= MIN_VALIDATION_FIT or top_up is not None)


def reject_fits(source: SplitOutputs, classes: int, seed: int, layer_names: Optional[list[str]],
                shrinkage: str) -> dict:
    """What the feature scores are measured against, fitted on `source`: `bank` (the kNN bank), the
    `mahalanobis` and `mahalanobis_l2` fits and, with `layer_names`, one fit per stage (`layers`)."""
    fits = {"bank": feature_bank(source, seed),
            "mahalanobis": mahalanobis_fit(source.features, source.labels, classes, shrinkage),
            "mahalanobis_l2": mahalanobis_fit(normalise(source.features), source.labels, classes, shrinkage)}
    if layer_names:
        fits["layers"] = layer_fits(source.layers, source.labels, classes, layer_names, shrinkage)
    return fits


def raw_scores(out: SplitOutputs, fits: dict, layer_names: Optional[list[str]]) -> dict:
    """knn, mahalanobis, mahalanobis_l2 and (`layers`) each stage's score of `out` under `fits`."""
    scores = {"knn": knn_score(out.features, fits["bank"].float(), KNN_K),
              "mahalanobis": mahalanobis_score(out.features, *fits["mahalanobis"]),
              "mahalanobis_l2": mahalanobis_score(normalise(out.features), *fits["mahalanobis_l2"])}
    if layer_names:
        scores["layers"] = layer_scores(out.layers, fits["layers"], layer_names)
    return scores


def cross_fitted_scores(val: SplitOutputs, classes: int, seed: int, layer_names: Optional[list[str]],
                        top_up: Optional[SplitOutputs] = None) -> dict:
    """`raw_scores` of every validation image under a fit (Ledoit-Wolf) on the other CROSS_FIT_FOLDS - 1 folds
    and the `top_up` training images."""
    folds = torch.arange(len(val)) % CROSS_FIT_FOLDS
    joined: dict = {}
    for k in range(CROSS_FIT_FOLDS):
        held, rest = (folds == k).nonzero()[:, 0], (folds != k).nonzero()[:, 0]
        if not len(held):
            continue
        fitted_on = val.select(rest) if top_up is None else joined_outputs(val.select(rest), top_up)
        part = raw_scores(val.select(held), reject_fits(fitted_on, classes, seed, layer_names, "ledoit_wolf"),
                          layer_names)
        for name, value in part.items():
            values = value if name == "layers" else [value]
            slots = joined.setdefault(name, [torch.zeros(len(val)) for _ in values])
            for slot, v in zip(slots, values):
                slot[held] = v.float()
    return {name: (slots if name == "layers" else slots[0]) for name, slots in joined.items()}


def build_record(val: SplitOutputs, bank: Optional[SplitOutputs], setting: Union[str, float], coverage: float,
                 seed: int, method: str = DEFAULT_METHOD, layer_names: Optional[list[str]] = None,
                 top_up: Optional[SplitOutputs] = None) -> dict:
    """The checkpoint's `calibration` record. The reject fit is made on `bank` (training images' outputs),
    or, without one, on the validation outputs themselves, with the `top_up` training images' where the split
    holds fewer than MIN_VALIDATION_FIT (`reject_fit` says which: training, validation, or
    validation+training). Without the stages' statistics (`layer_names` and the outputs' `layers`: a timm
    model without `feature_info`) mahalanobis_layers falls back to combined; without features (a model
    without a timm classifier, or neither training features nor enough validation ones) to energy."""
    temperature, notes, decision = resolve_temperature(setting, val)
    scores = {"msp": msp_score(val.logits, temperature), "energy": energy_score(val.logits)}
    record = {"temperature": temperature, "temperature_setting": str(setting), "coverage": float(coverage),
              "knn_k": KNN_K, "num_samples": len(val), "temperature_notes": notes,
              "temperature_decision": decision}
    top_up = top_up if top_up is not None and top_up.features is not None and len(top_up) else None
    on_val = bank is None and fits_on_validation(val, top_up)
    source = (val if top_up is None else joined_outputs(val, top_up)) if on_val else bank
    if val.features is not None and source is not None and source.features is not None and len(source) > 0:
        classes = val.logits.shape[1]
        use_layers = (method == LAYERS_METHOD and bool(layer_names) and val.layers is not None
                      and source.layers is not None)
        names = list(layer_names) if use_layers else None
        fits = reject_fits(source, classes, seed, names, "ledoit_wolf" if on_val else "ridge")
        raw = cross_fitted_scores(val, classes, seed, names, top_up) if on_val else raw_scores(val, fits, names)
        scores.update({name: raw[name] for name in ("knn", "mahalanobis", "mahalanobis_l2")})
        scales = {name: score_scale(scores[name], least_spread(name)) for name in COMBINED_OF}
        scores["combined"] = combined_score([scores[name] for name in COMBINED_OF],
                                            [scales[name] for name in COMBINED_OF])
        if use_layers:
            layer_scales = [score_scale(x, MIN_SPREAD["mahalanobis"]) for x in raw["layers"]]
            weights = layer_weights(names)
            scores[LAYERS_METHOD] = multilayer_score(raw["layers"], layer_scales, weights)
            record.update(layer_names=names, layer_means=[m for m, _ in fits["layers"]],
                          layer_precisions=[p for _, p in fits["layers"]], layer_scales=[list(x) for x in layer_scales])
            if weights is not None:
                record["layer_weights"] = weights
        elif method == LAYERS_METHOD:
            method = "combined"
        record["feature_bank"] = fits["bank"]
        record["reject_fit"] = ("validation" if top_up is None else "validation+training") if on_val else "training"
        record["reject_notes"] = degenerate_notes(source, classes, names or [])
        store_fits(record, fits, method, scales)
    record["reject_notes"] = [*few_images_notes(len(val), coverage), *record.get("reject_notes", [])]
    record["thresholds"] = {name: threshold_for_coverage(s, coverage) for name, s in scores.items()}
    record["method"] = method if method in scores else LOGITS_METHOD
    return record


def store_fits(record: dict, fits: dict, method: str, scales: dict) -> None:
    """The Mahalanobis fits (and `combined`'s parts and scales) that `method` scores by."""
    needed = {"combined": COMBINED_OF, LAYERS_METHOD: ("mahalanobis_l2",)}.get(method, (method,))
    if "mahalanobis" in needed:
        record["class_means"], record["precision"] = fits["mahalanobis"]
    if "mahalanobis_l2" in needed:
        record["class_means_l2"], record["precision_l2"] = fits["mahalanobis_l2"]
    if method == "combined":
        record["combined_of"] = list(COMBINED_OF)
        record["score_scales"] = {name: list(scales[name]) for name in COMBINED_OF}


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


def export_record(record: Optional[dict], carried: bool = False) -> Optional[dict]:
    """What an export's metadata (JSON) carries: the numbers. `carried`: the export computes the record's
    multi-layer score itself (its `reject_score` output, rejection.LogitsAndRejectScore), so it rejects by
    that method and threshold; else by the logits-only score, and `checkpoint_method` names the score the
    checkpoint rejects by when that is another one (--reject then refuses rather than silently differ)."""
    if not record:
        return None
    exported = {"temperature": record.get("temperature"), "temperature_setting": record.get("temperature_setting"),
                "coverage": record.get("coverage"), "method": LOGITS_METHOD,
                "temperature_notes": list(record.get("temperature_notes", [])),
                "thresholds": {LOGITS_METHOD: record["thresholds"][LOGITS_METHOD]},
                "num_samples": record.get("num_samples")}
    if carried:
        exported.update(method=LAYERS_METHOD, score_output=REJECT_SCORE_OUTPUT,
                        reject_notes=list(record.get("reject_notes", [])))
        exported["thresholds"][LAYERS_METHOD] = record["thresholds"][LAYERS_METHOD]
    elif record.get("method", LOGITS_METHOD) != LOGITS_METHOD:
        exported["checkpoint_method"] = record["method"]
    return exported


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
