"""The evaluation pass (sample-weighted sums over a labelled split) and the prediction pass (padded
fixed-shape batches over a file list, results in input order), both in the terms of a Task.

Both keep their results on the device until the pass ends, so the loop never waits for the device.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from imgcls.compute.device import DeviceInput
from imgcls.core.errors import ModelOutputError, StopRequested
from imgcls.tasks import get_task
from imgcls.tasks.base import Predictions, Task

SINGLE_LABEL = get_task("multiclass")


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, device_input: DeviceInput, task: Task, classes: list[str],
             tta_flip: bool = False, on_batch: Optional[Callable[[], None]] = None,
             should_stop: Optional[Callable[[int], bool]] = None,
             on_outputs: Optional[Callable] = None) -> tuple[object, list[int]]:
    """Sums over this rank's shard (call `sums.all_reduce()` under DDP). Returns the sums and the indices
    of files that could not be read (excluded, never substituted). A limit on the samples evaluated
    belongs to the loader's sampler (`build_eval_loader(limit_samples=...)`). `on_batch` runs after each
    batch (a progress bar); `should_stop(batches done)`, asked before each batch, ends the pass with
    StopRequested. `on_outputs(logits, targets, valid, indices)` receives every batch's outputs (eval.py's
    calibration figures; it copies them to the host).
    The sums are the task's (`task.new_sums`), named by `classes`."""
    was_training = model.training
    model.eval()
    sums = task.new_sums(len(classes), device_input.device, classes)
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
                if tta_flip:
                    logits = task.merge_flip(logits, model(images.flip(3)).float())
            sums.update(logits, device_input.labels(targets), valid.to(device_input.device, non_blocking=True))
            if on_outputs is not None:
                on_outputs(logits, targets, valid, indices)
            if on_batch is not None:
                on_batch()
    finally:
        model.train(was_training)
    return sums, unreadable


def predict(model: torch.nn.Module, loader, device_input: DeviceInput, k: int, temperature: Optional[float] = None,
            on_logits: Optional[Callable] = None, task: Task = SINGLE_LABEL) -> Predictions:
    """Run `model` over a loader of padded batches (images, valid, indices, errors) in input order; the
    padding rows are dropped, and each batch's logits go to the host once, as NumPy, for what a row needs of
    them (`task.outputs`: the top `k` calibrated probabilities for one label per image): the rows are made by
    the same NumPy code as the slim server's. A batch's copy is read while the next one runs, so the loop
    does not wait for the device. `temperature` scales the logits first (calibrated probabilities; the ranking
    is unchanged); `on_logits(logits, n)` receives each batch's logits, padding included, and the count of
    real rows (the reject scores)."""
    kept: dict[str, list[np.ndarray]] = {}
    valid_out: list[torch.Tensor] = []
    errors: dict = {}
    nonfinite = 0
    copies = HostCopies()

    def keep(due) -> None:
        nonlocal nonfinite
        for host, batch_valid in due:
            nonfinite += int((~np.isfinite(host).all(axis=1) & batch_valid.numpy()).sum())
            for name, value in task.outputs(host, k, temperature).items():
                kept.setdefault(name, []).append(value)

    with torch.inference_mode():
        for images, valid, indices, reasons in loader:
            n = len(indices)
            with device_input.autocast():
                logits = model(device_input.prepare(images))
            if on_logits is not None:
                on_logits(logits, n)
            copies.put(logits[:n], valid)
            keep(copies.ready())
            valid_out.append(valid)
            errors.update((i, reason) for i, reason in zip(indices.tolist(), reasons) if reason)
        keep(copies.ready(flush=True))
    if not valid_out:
        return Predictions(task.outputs(np.zeros((0, max(k, 1)), np.float32), k), torch.zeros(0, dtype=torch.bool),
                           errors)
    return Predictions({name: np.concatenate(parts) for name, parts in kept.items()}, torch.cat(valid_out), errors,
                       nonfinite)


class HostCopies:
    """Each batch's logits copied to the host as float32 without waiting (on CUDA: a non-blocking copy and an
    event); `ready()` hands over the copies that are due: all but the newest, whose batch may still run."""

    def __init__(self):
        self.pending: list = []

    def put(self, logits: torch.Tensor, valid: torch.Tensor) -> None:
        host = logits.detach().float().to("cpu", non_blocking=True)
        event = None
        if logits.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self.pending.append((host, event, valid))

    def ready(self, flush: bool = False):
        due, self.pending = (self.pending, []) if flush else (self.pending[:-1], self.pending[-1:])
        for host, event, valid in due:
            if event is not None:
                event.synchronize()
            yield host.numpy(), valid


def check_finite_outputs(nonfinite: int, total: int, model_path) -> None:
    """ModelOutputError (exit 1) naming the model file when any image got a NaN or infinite logit: a damaged
    or diverged model's 'predictions' are noise, never results."""
    if nonfinite:
        raise ModelOutputError(f"{model_path}: the model's outputs are not finite (NaN or infinity) for {nonfinite} "
                               f"of {total} image(s): its weights are damaged or diverged; no results written")
