"""Optimizers (timm.optim's factory) with weight decay only on weights that are not norm scales or biases, and
per-group LR scales: layer-wise decay (timm's groups) and the classifier's multiplier."""
from __future__ import annotations

from typing import Optional

import torch
from timm.optim import create_optimizer_v2, param_groups_layer_decay

from core.config import FUSED_OPTIMIZERS, OPTIMIZER_OPTIONS
from core.errors import ConfigError
from models.factory import classifier_parameter_names


def _split_classifier(model: torch.nn.Module, groups: list[dict], head_lr_scale: float) -> list[dict]:
    """Each group's classifier parameters move to a group of their own with lr_scale x head_lr_scale (the same
    weight decay); groups left empty are dropped."""
    head = {id(p) for n, p in model.named_parameters() if n in classifier_parameter_names(model)}
    body, heads = [], []
    for group in groups:
        rest = [p for p in group["params"] if id(p) not in head]
        mine = [p for p in group["params"] if id(p) in head]
        if rest:
            body.append(dict(group, params=rest))
        if mine:
            heads.append(dict(group, params=mine, lr_scale=group["lr_scale"] * head_lr_scale))
    return body + heads


def param_groups(model: torch.nn.Module, weight_decay: float, layer_decay: Optional[float] = None,
                 head_lr_scale: float = 1.0) -> list[dict]:
    """Parameter groups, each with `weight_decay` and `lr_scale` (its LR is the peak LR times that). No weight
    decay on biases and norm scales (1-D tensors). By default two groups: decayed and not. With `layer_decay`:
    timm's layer-wise groups (param_groups_layer_decay, the same decay rule; the top layer scale 1, each one
    below `layer_decay` times the one above). With `head_lr_scale` != 1 the classifier gets groups of its own."""
    if layer_decay is None:
        decay, no_decay = [], []
        for _, param in model.named_parameters():
            if not param.requires_grad:
                continue
            (no_decay if param.ndim <= 1 else decay).append(param)
        groups = [{"params": decay, "weight_decay": weight_decay, "lr_scale": 1.0},
                  {"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0}]
    else:
        groups = param_groups_layer_decay(model, weight_decay=weight_decay, layer_decay=layer_decay)
        if layer_decay < 1.0 and len({g["lr_scale"] for g in groups}) == 1:
            raise ConfigError(f"'optim.layer_decay' = {layer_decay}: this model has no layer grouping (timm's "
                              f"group_matcher), so every layer would get the same LR; use a timm model or "
                              f"optim.layer_decay=null")
    if head_lr_scale != 1.0:
        groups = _split_classifier(model, groups, head_lr_scale)
    return groups


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


def build_optimizer(model: torch.nn.Module, optim_cfg, lr: float, fused: bool = True) -> torch.optim.Optimizer:
    """sgd, adamw, rmsprop (torch's, through timm's factory), lamb, lars, lion (timm's). LAMB and LARS adapt
    the step of decayed tensors only, so norm and bias parameters keep a plain step, as in timm. Each group
    starts at `lr` x its lr_scale: LambdaLR multiplies each group's initial lr, so the ratios hold.

    `fused`: torch's fused kernels for sgd and adamw. They cannot step a mix of parameters with and without
    optimizer state (a backbone unfrozen mid-run), so such runs take the foreach kernels instead."""
    groups = param_groups(model, optim_cfg.weight_decay, optim_cfg.layer_decay, optim_cfg.head_lr_scale)
    for group in groups:
        group["lr"] = lr * group["lr_scale"]
    kernels = {}
    if optim_cfg.name in FUSED_OPTIMIZERS:
        kernels = {"fused": True} if fused else {"foreach": True}
    return create_optimizer_v2(groups, optim_cfg.name, lr=lr, weight_decay=optim_cfg.weight_decay,
                               **optimizer_options(optim_cfg), **kernels)


def base_lr(optimizer: torch.optim.Optimizer) -> float:
    """The current LR at scale 1 (what the log and metrics.csv report as `lr`)."""
    group = optimizer.param_groups[0]
    return group["lr"] / group.get("lr_scale", 1.0)


def describe_groups(optimizer: torch.optim.Optimizer) -> str:
    scales = sorted({g.get("lr_scale", 1.0) for g in optimizer.param_groups})
    return (f"{len(optimizer.param_groups)} parameter groups, LR scales {scales[0]:.4g} .. {scales[-1]:.4g} "
            f"of the base LR")
