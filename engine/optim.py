"""Optimizers with weight decay only on weights that are not norm scales or biases."""
from __future__ import annotations

import torch


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: decayed (conv / linear weights) and not decayed (biases, norm scales: 1-D tensors)."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim <= 1 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, optim_cfg, lr: float) -> torch.optim.Optimizer:
    groups = param_groups(model, optim_cfg.weight_decay)
    if optim_cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=optim_cfg.momentum,
                               nesterov=optim_cfg.nesterov and optim_cfg.momentum > 0)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(optim_cfg.betas), eps=optim_cfg.eps)
