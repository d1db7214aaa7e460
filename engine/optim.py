"""Optimizers (timm.optim's factory) with weight decay only on weights that are not norm scales or biases."""
from __future__ import annotations

import torch
from timm.optim import create_optimizer_v2

from core.config import OPTIMIZER_OPTIONS


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: decayed (conv / linear weights) and not decayed (biases, norm scales: 1-D tensors)."""
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim <= 1 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def optimizer_options(optim_cfg) -> dict:
    """The keyword arguments `optim.name` takes, from the config (core.config.OPTIMIZER_OPTIONS)."""
    taken = OPTIMIZER_OPTIONS[optim_cfg.name]
    options = {}
    if "momentum" in taken:
        options["momentum"] = optim_cfg.momentum
    if "nesterov" in taken:  # Nesterov needs momentum: with momentum 0 it is turned off instead of failing
        options["nesterov"] = optim_cfg.nesterov and optim_cfg.momentum > 0
    if "betas" in taken:
        options["betas"] = tuple(optim_cfg.betas)
    if "eps" in taken:
        options["eps"] = optim_cfg.eps
    return options


def build_optimizer(model: torch.nn.Module, optim_cfg, lr: float) -> torch.optim.Optimizer:
    """sgd, adamw, rmsprop (torch's, through timm's factory), lamb, lars, lion (timm's). LAMB and LARS adapt
    the step of decayed tensors only, so norm and bias parameters keep a plain step, as in timm."""
    groups = param_groups(model, optim_cfg.weight_decay)
    return create_optimizer_v2(groups, optim_cfg.name, lr=lr, weight_decay=optim_cfg.weight_decay,
                               **optimizer_options(optim_cfg))
