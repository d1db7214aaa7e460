"""The evaluation pass (sample-weighted sums over a labelled split) and the prediction pass (padded
fixed-shape batches over a file list, results in input order).

Both keep their results on the device until the pass ends, so the loop never waits for the device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from core.errors import ModelOutputError, StopRequested
from engine.runtime.device import DeviceInput
from engine.evaluation.metrics import MetricSums
from engine.evaluation.multilabel import MultiLabelSums


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, device_input: DeviceInput, num_classes: int,
             tta_flip: bool = False, on_batch: Optional[Callable[[], None]] = None,
             should_stop: Optional[Callable[[int], bool]] = None,
             on_outputs: Optional[Callable] = None,
             classes: Optional[list[str]] = None) -> tuple[MetricSums | MultiLabelSums, list[int]]:
    """Sums over this rank's shard (call `sums.all_reduce()` under DDP). Returns the sums and the indices
    of files that could not be read (excluded, never substituted). A limit on the samples evaluated
    belongs to the loader's sampler (`build_eval_loader(limit_samples=...)`). `on_batch` runs after each
    batch (a progress bar); `should_stop(batches done)`, asked before each batch, ends the pass with
    StopRequested. `on_outputs(logits, targets, valid, indices)` receives every batch's outputs (eval.py's
    calibration figures; it copies them to the host).
    `classes` given: a multi-label split (float multi-hot targets), recorded in
    `MultiLabelSums` (engine/evaluation/multilabel.py) under those names."""
    was_training = model.training
    model.eval()
    multilabel = classes is not None
    sums = MultiLabelSums(num_classes, device_input.device, classes) if multilabel else MetricSums(num_classes, device_input.device)
    unreadable: list[int] = []
    try:
        for done, (images, targets, valid, indices) in enumerate(loader):
            if should_stop is not None and should_stop(done):
                raise StopRequested()
            if not bool(valid.all()):
                unreadable.extend(int(j) for j in indices[~valid])
            images = device_input.prepare(images)
            with device_input.autocast():
                logits = model(images).float()
                if tta_flip and multilabel:
                    logits = torch.logit((logits.sigmoid() + model(images.flip(3)).float().sigmoid()) / 2)
                elif tta_flip:
                    # log of the mean of the two probabilities, in log space so it never underflows to -inf
                    flipped = model(images.flip(3)).float()
                    logits = torch.logsumexp(torch.stack([logits.log_softmax(1), flipped.log_softmax(1)]), 0) - math.log(2)
            sums.update(logits, device_input.labels(targets), valid.to(device_input.device, non_blocking=True))
            if on_outputs is not None:
                on_outputs(logits, targets, valid, indices)
            if on_batch is not None:
                on_batch()
    finally:
        model.train(was_training)
    return sums, unreadable


@dataclass
class Predictions:
    top_probs: torch.Tensor    # [N, k] float32, by input order; rows of unreadable files are undefined
    top_indices: torch.Tensor  # [N, k] int64
    valid: torch.Tensor        # [N] bool
    errors: dict               # input index -> reason the file could not be read
    nonfinite: int = 0         # readable inputs whose logits hold a NaN or an infinity


def predict(model: torch.nn.Module, loader, device_input: DeviceInput, k: int, temperature: Optional[float] = None,
            on_logits: Optional[Callable] = None) -> Predictions:
    """Run `model` over a loader of padded batches (images, valid, indices, errors) in input order; the
    padding rows are dropped before softmax / top-k. `temperature` scales the logits first (calibrated
    probabilities; the ranking is unchanged); `on_logits(logits, n)` receives each batch's logits, padding
    included, and the count of real rows (the reject scores)."""
    probs_out, indices_out, valid_out = [], [], []
    errors: dict = {}
    nonfinite = torch.zeros((), dtype=torch.int64, device=device_input.device)
    with torch.inference_mode():
        for images, valid, indices, reasons in loader:
            n = len(indices)
            batch = device_input.prepare(images)
            with device_input.autocast():
                logits = model(batch)
            if on_logits is not None:
                on_logits(logits, n)
            bad = ~torch.isfinite(logits[:n]).all(dim=1)
            nonfinite += (bad & valid.to(bad.device, non_blocking=True)).sum()
            scaled = logits[:n].float() if temperature is None else logits[:n].float() / temperature
            top = scaled.softmax(dim=1).topk(k, dim=1)
            probs_out.append(top.values)
            indices_out.append(top.indices)
            valid_out.append(valid)
            for i, reason in zip(indices.tolist(), reasons):
                if reason:
                    errors[i] = reason
    if not probs_out:
        empty = torch.zeros(0, k)
        return Predictions(empty, empty.long(), torch.zeros(0, dtype=torch.bool), errors)
    return Predictions(torch.cat(probs_out).cpu(), torch.cat(indices_out).cpu(), torch.cat(valid_out), errors,
                       int(nonfinite))


def check_finite_outputs(nonfinite: int, total: int, model_path) -> None:
    """ModelOutputError (exit 1) naming the model file when any image got a NaN or infinite logit: a damaged
    or diverged model's 'predictions' are noise, never results."""
    if nonfinite:
        raise ModelOutputError(f"{model_path}: the model's outputs are not finite (NaN or infinity) for {nonfinite} "
                               f"of {total} image(s): its weights are damaged or diverged; no results written")


@dataclass
class TagPredictions:
    probs: torch.Tensor        # [N, classes] float32 sigmoid probabilities, by input order
    valid: torch.Tensor        # [N] bool
    errors: dict               # input index -> reason the file could not be read
    nonfinite: int = 0         # readable inputs whose logits hold a NaN or an infinity


def predict_tags(model: torch.nn.Module, loader, device_input: DeviceInput, num_classes: int) -> TagPredictions:
    """A multi-label model over a loader of padded batches (as `predict`): every class's sigmoid probability,
    the padding rows dropped."""
    probs_out, valid_out = [], []
    errors: dict = {}
    nonfinite = torch.zeros((), dtype=torch.int64, device=device_input.device)
    with torch.inference_mode():
        for images, valid, indices, reasons in loader:
            batch = device_input.prepare(images)
            with device_input.autocast():
                logits = model(batch)
            bad = ~torch.isfinite(logits[:len(indices)]).all(dim=1)
            nonfinite += (bad & valid.to(bad.device, non_blocking=True)).sum()
            probs_out.append(logits[:len(indices)].float().sigmoid())
            valid_out.append(valid)
            for i, reason in zip(indices.tolist(), reasons):
                if reason:
                    errors[i] = reason
    if not probs_out:
        return TagPredictions(torch.zeros(0, num_classes), torch.zeros(0, dtype=torch.bool), errors)
    return TagPredictions(torch.cat(probs_out).cpu(), torch.cat(valid_out), errors, int(nonfinite))
