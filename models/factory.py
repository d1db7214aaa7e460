"""Build a classifier by name: timm models, or torchvision models as `tv:<name>`.

Optional local weights (`model.weights`): a safetensors file, a plain state_dict saved with
torch.save, or one of our checkpoints; every tensor whose name and shape match is loaded, the rest
(typically the classifier of a model trained on other classes) are reported.
"""
from __future__ import annotations

import inspect
import logging
from pathlib import Path

import timm
from timm.layers import BatchNormAct2d, GroupNormAct
import torch
import torchvision

from core.errors import CheckpointError, ModelError
from core.safe_load import load_checkpoint

log = logging.getLogger("train")
TORCHVISION_PREFIX = "tv:"


def model_exists(name: str) -> bool:
    if name.startswith(TORCHVISION_PREFIX):
        return name[len(TORCHVISION_PREFIX):] in torchvision.models.list_models(module=torchvision.models)
    return timm.is_model(name)


def check_model_name(name: str) -> None:
    """Raise ModelError naming close matches when `name` is neither a timm nor a tv:<torchvision> model."""
    if model_exists(name):
        return
    import difflib

    pool = timm.list_models() + [TORCHVISION_PREFIX + n for n in torchvision.models.list_models(module=torchvision.models)]
    close = difflib.get_close_matches(name, pool, n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ModelError(f"'model.name' = {name}: no such model in timm or torchvision (tv:NAME){hint}")


def _torchvision_kwargs(name: str, drop_rate: float, drop_path_rate: float) -> dict:
    """Map model.drop_rate / drop_path_rate to the torchvision class's own arguments; refuse them where it has none."""
    builder = torchvision.models.get_model_builder(name)
    model_class = inspect.signature(builder).return_annotation
    accepted = inspect.signature(model_class.__init__).parameters if isinstance(model_class, type) else {}
    kwargs = {}
    for key, value, own in (("model.drop_rate", drop_rate, "dropout"),
                            ("model.drop_path_rate", drop_path_rate, "stochastic_depth_prob")):
        if not value:
            continue
        if own not in accepted:
            raise ModelError(f"'{key}' = {value}: torchvision's {name} has no such option; set {key}=0")
        kwargs[own] = value
    return kwargs


def _torchvision_checkpointing_kwargs(name: str) -> dict:
    """torchvision's own activation checkpointing: only DenseNet has one (`memory_efficient`)."""
    builder = torchvision.models.get_model_builder(name)
    model_class = inspect.signature(builder).return_annotation
    accepted = inspect.signature(model_class.__init__).parameters if isinstance(model_class, type) else {}
    if "memory_efficient" not in accepted:
        raise ModelError(f"'model.grad_checkpointing' = true: torchvision's {name} has no activation checkpointing "
                         f"(only tv:densenet* has it); use the timm model of that name, or set "
                         f"model.grad_checkpointing=false")
    return {"memory_efficient": True}


def enable_grad_checkpointing(model: torch.nn.Module, name: str) -> None:
    """timm's `set_grad_checkpointing()`: each block's activations are recomputed in the backward pass
    instead of kept (less memory for ~20-30% more compute). Refused where the model has none."""
    try:
        model.set_grad_checkpointing(True)
    except (AssertionError, NotImplementedError, AttributeError) as err:
        raise ModelError(f"'model.grad_checkpointing' = true: timm's {name} does not support activation "
                         f"checkpointing ({err or 'not supported'}); set model.grad_checkpointing=false") from err


def check_grad_checkpointing(model_cfg) -> None:
    """Refuse `model.grad_checkpointing` before any work where the model has none (a weightless build on
    the meta device answers in milliseconds)."""
    if not model_cfg.grad_checkpointing:
        return
    name = model_cfg.name
    if name.startswith(TORCHVISION_PREFIX):
        _torchvision_checkpointing_kwargs(name[len(TORCHVISION_PREFIX):])
        return
    try:
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False, num_classes=2)
    except Exception:  # noqa: BLE001 - a model that cannot be built on meta is checked when it is built
        return
    enable_grad_checkpointing(model, name)


def create_model(name: str, num_classes: int, drop_rate: float = 0.0, drop_path_rate: float = 0.0,
                 norm: str = "batch", group_norm_groups: int = 32, grad_checkpointing: bool = False) -> torch.nn.Module:
    check_model_name(name)
    if name.startswith(TORCHVISION_PREFIX):
        tv_name = name[len(TORCHVISION_PREFIX):]
        kwargs = _torchvision_kwargs(tv_name, drop_rate, drop_path_rate)
        if grad_checkpointing:
            kwargs.update(_torchvision_checkpointing_kwargs(tv_name))
        model = torchvision.models.get_model(tv_name, weights=None, num_classes=num_classes, **kwargs)
    else:
        kwargs = {"pretrained": False, "num_classes": num_classes, "drop_rate": drop_rate}
        if drop_path_rate:
            kwargs["drop_path_rate"] = drop_path_rate
        try:
            model = timm.create_model(name, **kwargs)
        except TypeError as err:
            if "drop_path_rate" in str(err) or "drop_rate" in str(err):
                raise ModelError(f"'model.name' = {name} does not take model.drop_rate / model.drop_path_rate "
                                 f"({err}); set them to 0") from err
            raise
        if grad_checkpointing:
            enable_grad_checkpointing(model, name)
    if norm == "group":
        model = batchnorm_to_groupnorm(model, group_norm_groups)
    return model


def build_model(model_cfg, num_classes: int) -> torch.nn.Module:
    """The classifier that `model_cfg` (the config's `model` section) describes, with fresh weights."""
    m = model_cfg
    return create_model(m.name, num_classes, m.drop_rate, m.drop_path_rate, m.norm, m.group_norm_groups,
                        m.grad_checkpointing)


def _groups_for(channels: int, wanted: int) -> int:
    groups = min(wanted, channels)
    while channels % groups:
        groups -= 1
    return groups


def batchnorm_to_groupnorm(module: torch.nn.Module, groups: int = 32) -> torch.nn.Module:
    """Replace every BatchNorm2d with a GroupNorm of the same width (for small per-device batches).

    timm's fused norm + activation layers (BatchNormAct2d) become GroupNormAct with the same activation
    and drop layers, so the network keeps its non-linearities."""
    if isinstance(module, BatchNormAct2d):
        gn = GroupNormAct(module.num_features, _groups_for(module.num_features, groups), eps=module.eps,
                          affine=module.affine)
        gn.act, gn.drop = module.act, module.drop
        if module.affine:
            with torch.no_grad():
                gn.weight.copy_(module.weight)
                gn.bias.copy_(module.bias)
        return gn
    if isinstance(module, torch.nn.BatchNorm2d):
        gn = torch.nn.GroupNorm(_groups_for(module.num_features, groups), module.num_features, eps=module.eps,
                                affine=module.affine)
        if module.affine:
            with torch.no_grad():
                gn.weight.copy_(module.weight)
                gn.bias.copy_(module.bias)
        return gn
    for child_name, child in module.named_children():
        setattr(module, child_name, batchnorm_to_groupnorm(child, groups))
    return module


def fold_batchnorm(model: torch.nn.Module) -> tuple[torch.nn.Module, int]:
    """For inference: fold each BatchNorm that directly follows a convolution into that convolution's weights
    (torch.fx's conv/BN fusion on a traced copy). Returns (model, layers folded); a model that fx cannot trace,
    or that has nothing to fold, comes back unchanged with 0. The model must be in eval mode; outputs agree
    with the unfolded model to float rounding (~1e-6 relative in fp32)."""
    from torch.fx.experimental.optimization import fuse

    before = sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    if before == 0 or model.training:
        return model, 0
    try:
        fused = fuse(model)
    except Exception as err:  # dynamic control flow, untraceable custom layers: keep the model as it is
        log.debug("BatchNorm folding skipped: fx could not trace the model (%s)", err)
        return model, 0
    folded = before - sum(isinstance(m, torch.nn.BatchNorm2d) for m in fused.modules())
    return (fused, folded) if folded else (model, 0)


def read_weights_file(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"'model.weights' = {path}: no such file")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    try:
        obj = load_checkpoint(path)
    except CheckpointError as err:
        raise ModelError(f"'model.weights': {err}") from err
    for key in ("model", "state_dict", "model_state_dict"):
        if isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    return {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in obj.items() if isinstance(v, torch.Tensor)}


def load_matching_weights(model: torch.nn.Module, state: dict) -> tuple[list[str], list[str]]:
    """Load every tensor whose name and shape match; return (loaded names, skipped names)."""
    own = model.state_dict()
    usable = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    skipped = sorted(set(state) - set(usable)) + sorted(set(own) - set(state))
    model.load_state_dict(usable, strict=False)
    return sorted(usable), skipped


def load_local_weights(model: torch.nn.Module, path: str) -> None:
    loaded, skipped = load_matching_weights(model, read_weights_file(path))
    if not loaded:
        raise ModelError(f"'model.weights' = {path}: no tensor matches the model's parameter names and shapes")
    log.info("loaded %d tensors from %s; not loaded (new or mismatched): %s", len(loaded), path,
             ", ".join(skipped) if skipped else "none")
