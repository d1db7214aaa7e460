"""The validation outputs the fits after training need (every sample's logits, penultimate features and the
stages' pooled statistics), recorded during the last validation passes and kept from the pass that made best.pt:
the temperature and the reject fit then take them instead of passing over the validation split again.

Kept in memory only, per rank (calibrate_best gathers them as it gathers its own pass): a resumed run whose
best epoch came before the stop has none, nor has a run whose best epoch came before the recorded
validations, and a split too large for KEEP_BYTES records none; the calibration then passes over the split
as before.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from imgcls.evaluation.rejection import layer_names
from imgcls.evaluation.split_outputs import OutputRecorder, SplitOutputs

# Recording costs 4-9% of a validation pass's model time (resnet18 / resnet10t, 32-128 px, one CPU thread:
# docs/performance.md) and saves one pass: only the last RECORDED_VALIDATIONS scheduled validations record,
# where a scheduled run's best epoch mostly is; a best epoch before them is passed over again.
RECORDED_VALIDATIONS = 5
# What one rank keeps at most (the kept pass's outputs and the one being recorded, each): resnet18's 512
# features, five stages of at most 256 statistics and the logits are ~8 KB a sample, so ~30000 samples.
KEEP_BYTES = 256 * 2**20


class BoundedRecorder(OutputRecorder):
    """An OutputRecorder that drops everything (and records no more) once its outputs pass `limit` bytes."""

    def __init__(self, model: torch.nn.Module, layers: list[str], limit: int):
        super().__init__(model, with_features=True, layers=layers)
        self.limit, self.bytes, self.overflowed = limit, 0, False

    def __call__(self, logits, targets, valid, indices) -> None:
        if self.overflowed:
            return
        super().__call__(logits, targets, valid, indices)
        part = self.parts[-1]
        tensors = [part.logits, part.labels, part.indices, part.features, *(part.layers or [])]
        self.bytes += sum(t.numel() * t.element_size() for t in tensors if t is not None)
        if self.bytes > self.limit:
            self.overflowed, self.parts = True, []
            self.close()


class KeptOutputs:
    """`recording(model, on_outputs)` around a validation pass; `keep(epoch)` when that pass made best.pt;
    `outputs()` the kept pass's outputs (this rank's), or None."""

    def __init__(self, enabled: bool, limit: int = KEEP_BYTES):
        self.enabled, self.limit = enabled, limit
        self.recorder: Optional[BoundedRecorder] = None
        self.last: Optional[SplitOutputs] = None   # the last finished pass's
        self.kept: Optional[SplitOutputs] = None
        self.kept_epoch: Optional[int] = None

    def start(self, model: torch.nn.Module, on_outputs: Optional[Callable],
              validations_left: int = 1) -> Optional[Callable]:
        """Begin recording a pass of `model` (when it is one of the last RECORDED_VALIDATIONS: `validations_left`
        counts it and the run's later ones); returns the `on_outputs` to give `evaluate` (the objective's too).
        Call `finish()` after the pass, also when it failed."""
        self.last = None
        if not self.enabled or validations_left > RECORDED_VALIDATIONS:
            return on_outputs
        self.recorder = BoundedRecorder(model, layer_names(model), self.limit)
        if on_outputs is None:
            return self.recorder
        recorder = self.recorder

        def both(*args) -> None:
            on_outputs(*args)
            recorder(*args)
        return both

    def finish(self, completed: bool) -> None:
        recorder, self.recorder = self.recorder, None
        if recorder is None:
            return
        recorder.close()
        self.last = recorder.outputs() if completed and not recorder.overflowed else None

    def keep(self, epoch: int) -> None:
        """The last pass made best.pt (None kept when it recorded nothing: a later fit must pass again)."""
        self.kept, self.kept_epoch, self.last = self.last, epoch, None

    def outputs(self) -> Optional[SplitOutputs]:
        return self.kept
