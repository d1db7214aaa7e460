"""Exponential moving average of the weights and BatchNorm statistics (timm's --model-ema).

After optimizer step t: ema = decay * ema + (1 - decay) * weights, with the first step copying the
weights. With `model.ema_decay` set, validation, best.pt and early stopping use the averaged model;
last.pt keeps both. timm's ModelEmaV3 does the update with a Python-float decay and foreach lerps, so
it adds no host sync to the training step.
"""
from __future__ import annotations

import torch
from timm.utils import ModelEmaV3


def create_ema(model: torch.nn.Module, decay: float) -> ModelEmaV3:
    """A copy of `model` (same device and memory format) that follows it; update with `.update(model, step)`."""
    ema = ModelEmaV3(model, decay=decay)
    ema.requires_grad_(False)
    ema.eval()
    return ema
