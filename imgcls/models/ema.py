"""Exponential moving average of the weights and BatchNorm statistics (timm's --model-ema).

After optimizer step t: ema = decay * ema + (1 - decay) * weights, with the first step copying the
weights. With `model.ema_decay` set, validation, best.pt and early stopping use the averaged model;
last.pt keeps both. timm's ModelEmaV3 does the update with a Python-float decay and foreach lerps, so
it adds no host sync to the training step.

`model.ema_every_steps` = N (torchvision's --model-ema-steps) updates every N optimizer steps with the
decay raised to the N-th power, so the average spans as many steps as with N = 1. `model.ema_warmup`
is timm's warmup: decay(t) = min(ema_decay, 1 - (1 + t) ** -2/3), the average follows the weights
closely at first.
"""
from __future__ import annotations

from typing import Optional

import torch
from timm.utils import ModelEmaV3


class StridedEma(ModelEmaV3):
    """ModelEmaV3 updated at optimizer steps N, 2N, ...; each update weighs like N single-step updates."""

    def __init__(self, model: torch.nn.Module, decay: float, every_steps: int = 1, warmup: bool = False):
        super().__init__(model, decay=decay, use_warmup=warmup)
        self.every_steps = every_steps

    def get_decay(self, step: Optional[int] = None) -> float:
        if step is None:
            return self.decay ** self.every_steps
        # the per-step decay at the window's first step (step 1: 0, a copy), for each of its N steps
        return super().get_decay(step - self.every_steps + 1) ** self.every_steps

    @torch.no_grad()
    def update(self, model: torch.nn.Module, step: Optional[int] = None) -> None:
        """After optimizer step `step` (from 1): updates only when `step` is a multiple of every_steps."""
        if step is not None and step % self.every_steps:
            return
        super().update(model, step)


def create_ema(model: torch.nn.Module, decay: float, every_steps: int = 1, warmup: bool = False) -> StridedEma:
    """A copy of `model` (same device and memory format) that follows it; update with `.update(model, step)`."""
    ema = StridedEma(model, decay, every_steps, warmup)
    ema.requires_grad_(False)
    ema.eval()
    return ema
