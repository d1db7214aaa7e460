"""Measure the trust figures of a checkpoint: ECE before and after temperature scaling on its validation
split, and for each reject score (msp, energy, knn, mahalanobis, and the default mahalanobis_layers) the share of out-of-distribution images
rejected at the threshold that keeps `calibration.coverage` of the validation images. The
out-of-distribution sets are crops of scikit-learn's two sample photos and benchmarking/modes.py's
generated photos. Prints one JSON object: the figures that chose the reject score checkpoints use.

python -m imgcls.benchmarking.trust --checkpoint runs/quickstart/best.pt [--images 200] [--coverage 0.95]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from imgcls.benchmarking.modes import photo, sample_photo_crop
from imgcls.compute.device import DeviceInput
from imgcls.data.build import build_eval_loader_for, scan_splits
from imgcls.data.listing import ImageIndex
from imgcls.evaluation.calibration import apply_temperature, expected_calibration_error, nll
from imgcls.evaluation.rejection import (collect_outputs, energy_score, knn_score, layer_fits, layer_names,
                                         layer_scores, layer_weights, mahalanobis_fit, mahalanobis_score, msp_score,
                                         multilayer_score, score_scale, threshold_for_coverage)
from imgcls.evaluation.trust import build_record
from imgcls.model_files.loading import load_model_file
from imgcls.training.calibrate import bank_index


def write_ood_images(folder: Path, count: int, seed: int = 0) -> dict[str, list[str]]:
    """`count` crops of the sklearn sample photos and `count` generated photos as JPEGs under `folder`."""
    from sklearn.datasets import load_sample_images

    rng = np.random.default_rng(seed)
    sources = [Image.fromarray(a) for a in load_sample_images().images]
    sets = {"sample_photos": [], "generated_photos": []}
    for i in range(count):
        path = folder / f"sample_{i:04d}.jpg"
        sample_photo_crop(rng, sources).save(path, quality=90)
        sets["sample_photos"].append(str(path))
        path = folder / f"generated_{i:04d}.jpg"
        size = int(rng.integers(64, 320))
        Image.fromarray(photo(rng, size, size)).save(path, quality=90)
        sets["generated_photos"].append(str(path))
    return sets


def outputs_of(model, index, loaded, batch: int, device_input):
    loader = build_eval_loader_for(index, loaded.eval_transform(), loaded.cfg.data.img_size, batch, 0, False)
    return collect_outputs(model, loader, device_input, with_features=True, with_layers=True)


def measure(checkpoint: str, count: int, coverage: float) -> dict:
    loaded = load_model_file(checkpoint)
    cfg = loaded.cfg
    train_index, val_index = scan_splits(cfg)
    device_input = DeviceInput.from_config(cfg, torch.device("cpu"), None)
    model = loaded.build_model(torch.device("cpu"), channels_last=False)
    val = outputs_of(model, val_index, loaded, 64, device_input)
    bank = outputs_of(model, bank_index(train_index, cfg.train.seed), loaded, 64, device_input)
    record = build_record(val, bank, cfg.calibration.temperature, coverage, cfg.train.seed)
    t = record["temperature"]
    means, precision = mahalanobis_fit(bank.features, bank.labels, len(loaded.classes))
    stored_bank = record["feature_bank"].float()
    names = layer_names(model)
    fits = layer_fits(bank.layers, bank.labels, len(loaded.classes), names) if names else None
    scales = [score_scale(x) for x in layer_scores(val.layers, fits, names)] if fits else None

    def scores(out):
        found = {"msp": msp_score(out.logits, t), "energy": energy_score(out.logits),
                 "knn": knn_score(out.features, stored_bank, record["knn_k"]),
                 "mahalanobis": mahalanobis_score(out.features, means, precision)}
        if fits:  # the shipped default (calibration.reject_method): stages' scores standardised on validation
            found["mahalanobis_layers"] = multilayer_score(layer_scores(out.layers, fits, names), scales,
                                                           layer_weights(names))
        return found
    val_scores = scores(val)
    thresholds = {name: threshold_for_coverage(s, coverage) for name, s in val_scores.items()}
    result = {"checkpoint": str(checkpoint), "val_images": len(val), "temperature": t,
              "ece_uncalibrated": expected_calibration_error(apply_temperature(val.logits, None), val.labels),
              "ece": expected_calibration_error(apply_temperature(val.logits, t), val.labels),
              "nll_uncalibrated": nll(val.logits, val.labels), "nll": nll(val.logits, val.labels, t or 1.0),
              "coverage": coverage, "bank_size": int(stored_bank.shape[0]), "knn_k": record["knn_k"],
              "val_kept": {n: 100.0 * float((s >= thresholds[n]).double().mean()) for n, s in val_scores.items()},
              "rejected": {}}
    result["held_out"] = held_out_halves(val, val_scores, coverage)
    with tempfile.TemporaryDirectory() as tmp:
        for name, paths in write_ood_images(Path(tmp), count).items():
            index = ImageIndex(Path(tmp), list(loaded.classes), paths, [0] * len(paths))
            ood = scores(outputs_of(model, index, loaded, 64, device_input))
            result["rejected"][name] = {n: 100.0 * float((s < thresholds[n]).double().mean()) for n, s in ood.items()}
    return result


def held_out_halves(val, val_scores: dict, coverage: float) -> dict:
    """Two-fold check on the validation split: fit the temperature and the thresholds on one half (even /
    odd positions), measure ECE and the share kept on the other; the mean of the two folds."""
    from imgcls.evaluation.calibration import fit_temperature

    halves = [torch.arange(0, len(val), 2), torch.arange(1, len(val), 2)]
    ece, ece_before, kept = [], [], {name: [] for name in val_scores}
    for fit, test in (halves, halves[::-1]):
        t = fit_temperature(val.logits[fit], val.labels[fit])
        ece.append(expected_calibration_error(apply_temperature(val.logits[test], t), val.labels[test]))
        ece_before.append(expected_calibration_error(apply_temperature(val.logits[test], None), val.labels[test]))
        for name, s in val_scores.items():
            kept[name].append(100.0 * float((s[test] >= threshold_for_coverage(s[fit], coverage)).double().mean()))
    return {"ece": sum(ece) / 2, "ece_uncalibrated": sum(ece_before) / 2,
            "val_kept": {name: sum(v) / 2 for name, v in kept.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--images", type=int, default=200, help="out-of-distribution images per set")
    parser.add_argument("--coverage", type=float, default=0.95)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.checkpoint, args.images, args.coverage), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
