"""Likely label errors from out-of-sample probabilities: cleanlab's confident learning, and the images the
out-of-fold model confidently files under another class.

Single-label: `cleanlab.filter.find_label_issues` (prune_by_noise_rate) counts an image towards another class
only when that class's probability reaches the class's mean self-confidence. The audit's fold models train
for few epochs and are under-confident, so a planted error the fold model put in the right class at 0.58 was
missed where that class's own images averaged 0.63 (and a user's cat filed under `coffee`). An image whose
out-of-fold prediction is another class at DISAGREEMENT_RATIO times the probability of its given label is
flagged too. Issues are ranked by self-confidence (the probability the model gives the label the image has:
lowest first) and each gets the class the model prefers; `rule` says which test flagged it. The rows are
labelled-sample records so that a multi-label audit can produce the same record shape.

Out-of-sample class probabilities: K-fold cross-validation with the configured model and the real trainer,
or the predictions of a checkpoint the user already has.

Fold assignment is stratified and a pure function of (seed, content hash): within each class the distinct
contents are ordered by SHA-256(seed, content hash) and dealt to the folds in turn, so byte-identical copies
share a fold (a copy in the training folds would teach the model the held-out image's own label). Fold k is
trained by `training.trainer.run` on the other folds, written as CSV lists (absolute paths, the class list
fixed by `data.classes`, so a fold that lacks a class keeps the label order), then predicts its own images."""
from __future__ import annotations

import copy
import csv
import hashlib
import logging
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from imgcls.auditing.outliers import fold_outlier_z
from imgcls.compute.device import DeviceInput, build_runtime
from imgcls.data.build import eval_transform
from imgcls.data.datasets import FileListDataset, build_inference_loader
from imgcls.evaluation.evaluate import predict
from imgcls.model_files.loading import load_model_file
from imgcls.training.runlog import setup_logging, stderr_level
from imgcls.training.trainer import run as train_run

DISAGREEMENT_RATIO = 2.0   # argmax probability over the given label's probability that flags a disagreement


def find_label_issues(labels: list[int], probs: np.ndarray) -> list[dict]:
    """[{"position", "given", "suggested", "score", "rule"}] for the images flagged, most likely error first.
    `score` is the self-confidence: the out-of-sample probability of the given label; `rule` is
    `confident_learning` (cleanlab) or `disagreement` (predicted another class at DISAGREEMENT_RATIO x)."""
    from cleanlab.filter import find_label_issues as cleanlab_find

    labels_arr = np.asarray(labels, dtype=np.int64)
    if len(labels_arr) == 0:
        return []
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / np.clip(probs.sum(axis=1, keepdims=True), 1e-12, None)
    flagged = set(int(i) for i in cleanlab_find(labels_arr, probs, filter_by="prune_by_noise_rate"))
    rows = np.arange(len(labels_arr))
    given_p = probs[rows, labels_arr]
    predicted = probs.argmax(axis=1)
    disagree = (predicted != labels_arr) & (probs[rows, predicted] >= DISAGREEMENT_RATIO * given_p)
    positions = sorted(flagged | set(int(i) for i in np.flatnonzero(disagree)), key=lambda i: (given_p[i], i))
    return [{"position": i, "given": int(labels_arr[i]), "suggested": int(predicted[i]), "score": float(given_p[i]),
             "rule": "confident_learning" if i in flagged else "disagreement"} for i in positions]

log = logging.getLogger("audit")


ALWAYS_TRAINED = -1  # the "fold" of a class whose images are all copies of one: in every fold's training


def assign_folds(digests: list[str], labels: list[int], folds: int, seed: int) -> list[int]:
    """The fold (0..folds-1) of each image: stratified by label, copies (equal digests) of a class together.
    A class whose images are all copies of one image cannot be held out from its own training (the other folds
    would not know the class): its images are ALWAYS_TRAINED, in every fold's training, and never checked."""
    fold_of_content: dict[tuple[int, str], int] = {}
    by_class: dict[int, list[str]] = {}
    for digest, label in zip(digests, labels):
        by_class.setdefault(label, [])
        if (label, digest) not in fold_of_content:
            fold_of_content[(label, digest)] = -1
            by_class[label].append(digest)
    for label, contents in by_class.items():
        ranked = sorted(contents, key=lambda c: hashlib.sha256(f"{seed}\0{c}".encode()).digest())
        for position, content in enumerate(ranked):
            fold_of_content[(label, content)] = position % folds if len(ranked) > 1 else ALWAYS_TRAINED
    return [fold_of_content[(label, digest)] for digest, label in zip(digests, labels)]


def write_list(path: Path, files: list[str], labels: list[int], classes: list[str]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "label"])
        writer.writerows((file, classes[label]) for file, label in zip(files, labels))


def fold_config(cfg, work: Path, fold: int, epochs: int):
    """The configured run, reading fold `fold`'s lists and writing into `work`; the warmup shortened in
    proportion when the folds train fewer epochs than the config."""
    c = copy.deepcopy(cfg)
    d = c.data
    d.format, d.root, d.builtin, d.val_fraction = "csv", None, None, None
    d.train_csv, d.val_csv = str(work / f"fold{fold}_train.csv"), str(work / f"fold{fold}_val.csv")
    d.classes = str(work / "classes.txt")
    d.csv_path_column, d.csv_label_column = "path", "label"
    d.train_shards = d.val_shards = None
    d.train_samples = None
    if epochs < c.train.epochs:
        c.schedule.warmup_epochs = c.schedule.warmup_epochs * epochs / c.train.epochs
    c.train.epochs = epochs
    c.output.dir = str(work / f"fold{fold}")
    c.output.overwrite, c.output.tensorboard = True, False
    c.early_stop.patience = None
    return c


def predict_probs(model, model_cfg, files: list[str], batch_size: int, num_workers: int,
                  device: torch.device, amp_dtype, classes_count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities [N, C], readable [N]) of `files` through `model`, with `model_cfg`'s eval preprocessing."""
    transform = eval_transform(model_cfg.data)
    loader = build_inference_loader(FileListDataset(files, transform, transform.img_size), batch_size, num_workers,
                                    pin_memory=device.type == "cuda")
    preds = predict(model, loader, DeviceInput.from_config(model_cfg, device, amp_dtype), classes_count)
    probs = torch.zeros(len(files), classes_count)
    probs.scatter_(1, torch.from_numpy(preds.top_indices), torch.from_numpy(preds.top_probs))
    return probs, preds.valid


def open_model(path: Path, device_setting: str, amp_setting: Optional[str] = None):
    """(ModelFile, model, device, amp dtype) for predictions, set up as eval.py and infer.py set up theirs."""
    loaded = load_model_file(path)
    runtime = build_runtime(loaded.cfg, saved_threads=loaded.threads, training=False,
                            device_setting=device_setting,
                            amp_setting=amp_setting, fp32_only=loaded.fp32_only)
    model = loaded.build_model(runtime.device, loaded.cfg.train.channels_last)
    return loaded, model, runtime.device, runtime.amp_dtype


def copy_keys(names: list[str], digests: list[str], duplicates: list[dict], leaks: list[dict]) -> list[str]:
    """A fold key per image: near copies (one duplicate or leak group, by auditing.duplicates) share one, the
    group's first name, so that they land in one fold; any other image keeps its content hash. A near copy in
    the training folds teaches the model the held-out image's own (possibly wrong) label, and makes a foreign
    image look familiar."""
    parent = {name: name for name in names}

    def root(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    groups = [g["paths"] for g in duplicates] + [[p for s in leak["splits"] for p in leak[s]] for leak in leaks]
    for group in groups:
        members = [p for p in group if p in parent]
        for other in members[1:]:
            parent[root(other)] = root(members[0])
    grouped = {name for group in groups for name in group}
    return [f"group:{root(name)}" if name in grouped else digest for name, digest in zip(names, digests)]


def cross_validated_probs(cfg, files: list[str], labels: list[int], digests: list[str], classes: list[str],
                          work: Path, folds: int, epochs: int, on_fold: Callable[[int], None] | None = None,
                          outlier_z: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[N, C] probabilities, row i from the fold model that did not train on file i (NaN for the images of a
    class of copies of one image, which every fold trains on: `assign_folds`). `outlier_z` (N, filled
    in place): each file's out-of-distribution score under that fold model (auditing/outliers.py). The
    fold runs log to their own train.log; stderr shows their errors only, and one line per fold."""
    fold_of = assign_folds(digests, labels, folds, cfg.audit.seed)
    single = sorted({classes[label] for label, fold in zip(labels, fold_of) if fold == ALWAYS_TRAINED})
    if single:
        log.warning("audit: every image of class(es) %s is a copy of one image: a fold cannot hold them out and "
                    "still train the class, so they train in every fold and their labels are not checked",
                    ", ".join(single))
    (work / "classes.txt").write_text("".join(f"{name}\n" for name in classes))
    probs = torch.full((len(files), len(classes)), float("nan"))
    for fold in range(folds):
        held = [i for i, f in enumerate(fold_of) if f == fold]
        rest = [i for i, f in enumerate(fold_of) if f != fold]
        if not held:
            continue
        write_list(work / f"fold{fold}_train.csv", [files[i] for i in rest], [labels[i] for i in rest], classes)
        write_list(work / f"fold{fold}_val.csv", [files[i] for i in held], [labels[i] for i in held], classes)
        fold_cfg = fold_config(cfg, work, fold, epochs)
        with stderr_level(logging.ERROR):
            code = train_run(fold_cfg)
        setup_logging(None, True)  # the run's file handler points into the fold folder
        if code != 0:
            raise RuntimeError(f"the training run of fold {fold + 1} failed (exit {code}); see the log above")
        loaded, model, device, amp = open_model(Path(fold_cfg.output.dir) / "last.pt", cfg.train.device,
                                                cfg.train.amp)
        bs = fold_cfg.train.batch_size if isinstance(fold_cfg.train.batch_size, int) else 64  # resolved by the run
        fold_probs, _ = predict_probs(model, loaded.cfg, [files[i] for i in held], bs, cfg.data.num_workers,
                                      device, amp, len(classes))
        probs[held] = fold_probs
        best = Path(fold_cfg.output.dir) / "best.pt"
        if outlier_z is not None and best.exists():
            z = fold_outlier_z(open_model(best, cfg.train.device, cfg.train.amp), [files[i] for i in held],
                               cfg.data.num_workers, [labels[i] for i in held])
            if z is not None:
                outlier_z[held] = z
        right = float((fold_probs.argmax(1) == torch.tensor([labels[i] for i in held])).double().mean())
        log.info("audit fold %d/%d: trained on %d images (%d epoch(s)), %.1f%% of the %d held-out ones predicted "
                 "as labelled", fold + 1, folds, len(rest), epochs, 100 * right, len(held))
        if on_fold is not None:
            on_fold(fold)
    return probs


def unseen_by_checkpoint(names: list[str], splits: list[str], data_source: Optional[dict]) -> list[bool]:
    """Which images a checkpoint did not train on. A checkpoint that records its split (data.val_fraction)
    names its training files; one that does not trained on its training split, so only the validation (and
    test) images are out of sample. Predictions on images a model trained on hide their label errors."""
    split = (data_source or {}).get("split")
    if split is not None:
        trained = set(split.get("train", []))
        return [name not in trained for name in names]
    return [s != "train" for s in splits]


def check_same_classes(model_classes: list[str], data_classes: list[str]) -> None:
    """ConfigError (exit 2) unless the model knows exactly the data's classes (in any order)."""
    from imgcls.core.errors import ConfigError

    if set(model_classes) != set(data_classes):
        missing = sorted(set(data_classes) - set(model_classes))
        extra = sorted(set(model_classes) - set(data_classes))
        raise ConfigError(f"--checkpoint: its classes differ from the data's; not in the model: {missing or 'none'}; "
                          f"not in the data: {extra or 'none'}")


def align_classes(probs: torch.Tensor, model_classes: list[str], data_classes: list[str]) -> torch.Tensor:
    """Columns reordered from the model's class order to the data's (the same names, any order)."""
    check_same_classes(model_classes, data_classes)
    at = [model_classes.index(name) for name in data_classes]
    return probs[:, at]
