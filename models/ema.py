"""Exponential moving average of the weights and BatchNorm statistics (timm's --model-ema).

After each optimizer step: ema = decay * ema + (1 - decay) * weights. With `model.ema_decay` set,
validation, best.pt and early stopping use the averaged model; last.pt keeps both.
"""
from __future__ import annotations

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def create_ema(model: torch.nn.Module, decay: float) -> AveragedModel:
    """A copy of `model` (same device and memory format) that follows it by EMA; never trained itself."""
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)
    ema.requires_grad_(False)
    ema.eval()
    return ema
