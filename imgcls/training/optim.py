"""Optimizers (timm.optim's factory) with weight decay only on weights that are not norm scales or biases, and
per-group LR scales: layer-wise decay (timm's groups) and the classifier's multiplier.

Any optimizer timm knows is `optim.name`: optim.momentum / nesterov / betas / eps go to it where its constructor
takes them, optim.options as further keyword arguments; `check_optimizer` refuses a name or an option it does not
take before any work (exit 2)."""
from __future__ import annotations

import difflib
import inspect
from typing import Optional

import torch
from timm.optim import create_optimizer_v2, get_optimizer_class, list_optimizers, param_groups_layer_decay

from imgcls.core.errors import ConfigError
from imgcls.models.factory import classifier_parameter_names
from imgcls.training.settings import OptimConfig

# torch's fused (one kernel for every tensor) implementations: the same update rule, on the CPU several times
# cheaper per step than the per-tensor loop torch defaults to there (docs/performance.md). A speed choice only:
# every other optimizer runs with its own default kernels.
FUSED_OPTIMIZERS = ("sgd", "adamw")
# the keys of the options that have one of their own (optim.<name>), passed where the constructor takes them
OWN_KEYED_OPTIONS = ("momentum", "nesterov", "betas", "eps")


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


def optimizer_parameters(name: str) -> dict[str, inspect.Parameter]:
    """The keyword parameters of the constructor timm builds for `name` (ConfigError, naming optim.name, for a
    name timm does not know or one whose package is missing)."""
    known = list_optimizers()
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ConfigError(f"'optim.name' = {name!r} is no optimizer timm.optim knows{hint} (allowed: "
                          f"{', '.join(known)})")
    try:
        cls = get_optimizer_class(name, bind_defaults=False)
    except ImportError as err:
        raise ConfigError(f"'optim.name' = {name} needs a package that is not installed: {err}") from err
    return dict(inspect.signature(cls).parameters)


def optimizer_options(optim_cfg) -> dict:
    """The keyword arguments `optim.name` gets besides lr and weight_decay: optim.momentum, nesterov, betas and eps
    where its constructor takes them, then optim.options."""
    taken = optimizer_parameters(optim_cfg.name)
    options = {}
    if "momentum" in taken:
        options["momentum"] = optim_cfg.momentum
    if "nesterov" in taken:  # Nesterov needs momentum: with momentum 0 it is turned off instead of failing
        options["nesterov"] = optim_cfg.nesterov and (optim_cfg.momentum > 0 or "momentum" not in taken)
    if "betas" in taken:
        options["betas"] = tuple(optim_cfg.betas)
    if "eps" in taken:
        options["eps"] = optim_cfg.eps
    return {**options, **{k: tuple(v) if isinstance(v, list) else v for k, v in optim_cfg.options.items()}}


def check_optimizer(optim_cfg) -> None:
    """optim.name and its options against the optimizer timm builds, before any work; ConfigError (exit 2) names
    the key. An option with a key of its own set away from its default that the optimizer does not take is a
    mistake, not a no-op; so is an optim.options entry its constructor has no parameter for."""
    name, taken = optim_cfg.name, optimizer_parameters(optim_cfg.name)
    own = tuple(k for k in OWN_KEYED_OPTIONS if k in taken)
    defaults = OptimConfig()
    for option in OWN_KEYED_OPTIONS:
        if option not in taken and getattr(optim_cfg, option) != getattr(defaults, option):
            raise ConfigError(f"'optim.{option}' = {getattr(optim_cfg, option)!r}: optim.name={name} does not take "
                              f"it ({name} takes {', '.join(('lr', 'weight_decay') + own)}); remove it or choose "
                              f"an optimizer that uses it")
    default_betas = taken["betas"].default if "betas" in taken else None
    if isinstance(default_betas, tuple) and len(default_betas) != len(optim_cfg.betas):
        raise ConfigError(f"'optim.betas' = {optim_cfg.betas}: optim.name={name} takes {len(default_betas)} betas "
                          f"(its default is {list(default_betas)}); set optim.betas to {len(default_betas)} numbers")
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in taken.values()):
        free = sorted(k for k in taken if k not in ("self", "params", "lr", "weight_decay", "fused", "foreach")
                      and k not in OWN_KEYED_OPTIONS)
        for key in optim_cfg.options:
            if key not in taken:
                raise ConfigError(f"'optim.options.{key}': optim.name={name} takes no argument '{key}' (its "
                                  f"options: {', '.join(free) or 'none'})")
    try:
        update_carries_nonfinite(optim_cfg)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ConfigError(f"'optim.name' = {name} with options {optimizer_options(optim_cfg)}: the optimizer "
                          f"refuses them: {err}") from err


def update_carries_nonfinite(optim_cfg) -> bool:
    """Whether this optimizer turns a non-finite gradient into non-finite weights, so that the next loss shows it
    and the gradients need no check of their own. Measured on a two-element probe instead of listed per
    optimizer: most updates carry a NaN through, a sign step (lion: sign(nan) = 0) leaves the weights finite
    while its state is poisoned."""
    probe = torch.nn.Parameter(torch.zeros(2))
    optimizer = create_optimizer_v2([probe], optim_cfg.name, lr=1e-3, weight_decay=0.0,
                                    **optimizer_options(optim_cfg))
    probe.grad = torch.tensor([float("nan"), 1.0])
    optimizer.step()
    return not bool(torch.isfinite(probe.detach()[0]))


def build_optimizer(model: torch.nn.Module, optim_cfg, lr: float, fused: bool = True) -> torch.optim.Optimizer:
    """Any optimizer timm knows (sgd, adamw, rmsprop: torch's, through timm's factory; lamb, lars, lion, adan,
    ...: timm's). LAMB and LARS adapt the step of decayed tensors only, so norm and bias parameters keep a plain
    step, as in timm. Each group starts at `lr` x its lr_scale: LambdaLR multiplies each group's initial lr, so
    the ratios hold.

    `fused`: torch's fused kernels for sgd and adamw. They cannot step a mix of parameters with and without
    optimizer state (a backbone unfrozen mid-run), so such runs take the foreach kernels instead."""
    check_optimizer(optim_cfg)
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
