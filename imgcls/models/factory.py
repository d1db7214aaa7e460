"""Whether the Hugging Face hub can be reached, found once per process with one short connection.

Without a network, huggingface_hub retries every file it looks for (five times, with back-off, for each of
the two weight-file names timm asks for): some 50 s of warnings before the error. One probe decides
instead; when the hub cannot be reached, offline mode is set for the rest of the process (the environment
for child processes, huggingface_hub's constant for this one), so the cache answers at once and a file that
is not cached fails at once.

A timm model folder (`config.json` + weights, as `timm.models.save_for_hf` writes it; `local-dir:` model
names and exported timm folders) checked against itself before timm loads it.

timm builds the model its config.json describes and, when a classifier in the weights has another shape,
drops it and starts a random one (an INFO line "expected if adapted"); other shape differences, a cut
safetensors file or a hostile pickle end in a traceback. Here the weights' names and shapes are read
(safetensors: the header only; other files by `torch.load(weights_only=True)`) and compared with the model
config.json builds on the meta device (no memory), so every such folder ends in one line, exit 2.

Build a classifier by name: timm models (also `hf-hub:ORG/NAME` and `local-dir:PATH`, which timm
reads), or torchvision models as `tv:<name>`.

Pretrained weights (`model.pretrained`): timm's loader, or torchvision's default weights, into a model
with its own classifier; their tensors are copied into ours, whose classifier is new for our classes
(kept only when the pretrained labels are our classes).
Fine-tuning helpers: the classifier's parameters, and `BackboneFreeze` (`model.freeze=backbone`).

Optional local weights (`model.weights`): a safetensors file, a plain state_dict saved with
torch.save, or one of our checkpoints; every tensor whose name and shape match is loaded, the rest
(typically the classifier of a model trained on other classes) are reported."""
from __future__ import annotations

import inspect
import json
import logging
import math
import os
import re
import socket
import urllib.request
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

import timm
import torch
import torchvision
from timm.layers import BatchNormAct2d, GroupNormAct

from imgcls.config import fill_unset
from imgcls.core.errors import CheckpointError, ModelError
from imgcls.core.files import not_a_regular_file
from imgcls.core.safe_load import load_checkpoint
from imgcls.models.feature_tap import TORCHVISION_HEADS, classifier_heads

PROBE_TIMEOUT_S = 3.0


DEFAULT_ENDPOINT = "https://huggingface.co"


_TRUE = {"1", "on", "yes", "true"}


_decided: Optional[tuple[bool, str]] = None  # (offline, why), once per process


def offline_by_environment() -> bool:
    return any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def probe_address() -> tuple[str, int]:
    """Where a download would first connect: the HTTPS proxy when one is set, else the hub's endpoint."""
    proxy = urllib.request.getproxies().get("https")
    url = urlsplit(proxy if proxy and "://" in proxy else (f"http://{proxy}" if proxy else
                                                          os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT))
    return url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)


def can_connect(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """None when a TCP connection to host:port opens within `timeout`, else why not."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return None
    except OSError as err:
        return f"{host}:{port} cannot be reached: {err.strerror or err}"


def hub_offline() -> tuple[bool, str]:
    """(offline, why): decided once per process, by HF_HUB_OFFLINE or by one probe; when the probe fails,
    offline mode is switched on so that nothing retries."""
    global _decided
    if _decided is None:
        why = "HF_HUB_OFFLINE is set" if offline_by_environment() else can_connect(*probe_address())
        _decided = (why is not None, why or "")
        if why is not None:
            set_offline()
    return _decided


def set_offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import huggingface_hub.constants  # read its environment at import: the constant is what it checks

    huggingface_hub.constants.HF_HUB_OFFLINE = True

# the weight files timm looks for in a folder, in its order (timm.models._hub._PREFERRED_FILES)
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "pytorch_model.pth", "model.pth")


def weight_file(folder: Path) -> Path:
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return folder / name
    raise ModelError(f"{folder}: no weights file ({', '.join(WEIGHT_FILES)}) beside config.json")


def weight_shapes(path: Path) -> dict[str, tuple]:
    """Tensor name -> shape of a weights file, without running any code from it."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
        except Exception as err:  # safetensors raises its own SafetensorError for a cut or damaged header
            raise ModelError(f"{path}: damaged or truncated safetensors file ({type(err).__name__}: "
                             f"{' '.join(str(err).split())[:200]})") from err
    from imgcls.core.safe_load import load_checkpoint

    try:
        state = load_checkpoint(path)
    except CheckpointError as err:
        raise ModelError(f"{path}: {err}") from err
    for key in ("state_dict", "model"):
        if isinstance(state.get(key), dict):
            state = state[key]
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def expected_shapes(folder: Path) -> tuple[dict[str, tuple], int]:
    """(name -> shape of the model config.json describes, as timm builds it for `local-dir:`: its model_args,
    num_classes from config.json where they name none), and that model's num_classes. ModelError when the
    classes config.json declares (num_classes, label_names) are not the model's."""
    import timm
    from timm.models._hub import load_model_config_from_path

    config = folder / "config.json"
    try:
        pretrained_cfg, architecture, model_args = load_model_config_from_path(folder)
        declared = int(pretrained_cfg["num_classes"])
        args = dict(model_args or {})
        args.setdefault("num_classes", declared)
        with torch.device("meta"):
            model = timm.create_model(architecture, pretrained=False, **args)
    except Exception as err:  # a config.json timm cannot build from: many types
        raise ModelError(f"{config}: timm cannot build the model it describes "
                         f"({type(err).__name__}: {' '.join(str(err).split())[:200]})") from err
    if int(args["num_classes"]) != declared:
        raise ModelError(f"{config}: num_classes {declared} but model_args.num_classes {args['num_classes']} (the "
                         f"model its weights were saved from); timm would drop the classifier and start a random "
                         f"one: fix num_classes in config.json")
    labels = pretrained_cfg.get("label_names") or []
    if labels and len(labels) != declared:
        raise ModelError(f"{config}: num_classes {declared} but {len(labels)} label_names; they must agree "
                         f"(fix config.json)")
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}, declared


def check_timm_folder(folder: str | Path) -> None:
    """ModelError (exit 2) naming the disagreement when config.json and the weights beside it do not describe
    the same model: another classifier size (num_classes, label_names), other shapes for the same tensor
    names, or a weights file that cannot be read safely. Tensors are matched by name and shape, as loaded."""
    folder = Path(folder).expanduser()
    expected, num_classes = expected_shapes(folder)
    path = weight_file(folder)
    found = weight_shapes(path)
    differ = [f"{k} {list(found[k])} (config.json: {list(shape)})" for k, shape in expected.items()
              if k in found and found[k] != shape]
    if differ:
        raise ModelError(f"{folder}: config.json (architecture and num_classes {num_classes}) and {path.name} "
                         f"disagree on {len(differ)} tensor(s): {'; '.join(differ[:4])}"
                         f"{'; ...' if len(differ) > 4 else ''}; the folder was not written as one model "
                         f"(fix num_classes in config.json, or write the folder again with timm's save_for_hf)")
    if not set(expected) & set(found):
        raise ModelError(f"{folder}: none of the {len(found)} tensors in {path.name} is named as in the model "
                         f"config.json describes")

log = logging.getLogger(__name__)


TORCHVISION_PREFIX = "tv:"


HF_HUB_PREFIX = "hf-hub:"


LOCAL_DIR_PREFIX = "local-dir:"


_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+(@[\w./-]+)?$")


# the data.* keys that follow the pretrained model's preprocessing unless the user set them
PRETRAINED_DATA_KEYS = ("data.mean", "data.std", "data.interpolation", "data.crop_pct")


INTERPOLATIONS = ("bilinear", "bicubic", "nearest")


def model_exists(name: str) -> bool:
    if name.startswith(TORCHVISION_PREFIX):
        return name[len(TORCHVISION_PREFIX):] in torchvision.models.list_models(module=torchvision.models)
    return timm.is_model(name)


def list_model_names(pattern: str = "*") -> list[str]:
    """The model.name values this install builds that match `pattern` (a shell wildcard; a plain word matches
    the names containing it, case-insensitively): timm's, then torchvision's as tv:NAME."""
    import fnmatch

    wildcard = pattern.lower() if any(c in pattern for c in "*?[") else f"*{pattern.lower()}*"
    timm_names = [n for n in timm.list_models() if fnmatch.fnmatchcase(n.lower(), wildcard)]
    tv_names = [TORCHVISION_PREFIX + n for n in sorted(torchvision.models.list_models(module=torchvision.models))
                if fnmatch.fnmatchcase(n.lower(), wildcard)
                or fnmatch.fnmatchcase((TORCHVISION_PREFIX + n).lower(), wildcard)]
    return timm_names + tv_names


def _check_local_dir(name: str) -> None:
    folder = Path(name[len(LOCAL_DIR_PREFIX):]).expanduser()
    config = folder / "config.json"
    if not config.is_file():
        raise ModelError(f"'model.name' = {name}: no {config} (a local-dir: model is a folder with config.json "
                         f"and model.safetensors, as timm saves them)")
    try:
        architecture = json.loads(config.read_text()).get("architecture")
    except (OSError, ValueError, AttributeError) as err:
        raise ModelError(f"'model.name' = {name}: {config} is not a timm model config ({err})") from err
    if not isinstance(architecture, str) or not timm.is_model(architecture):
        raise ModelError(f"'model.name' = {name}: {config} names architecture {architecture!r}, not a timm model")


def check_model_name(name: str) -> None:
    """Raise ModelError naming close matches when `name` is neither a timm nor a tv:<torchvision> model, nor a
    well-formed hf-hub:ORG/NAME, nor a local-dir: folder holding a timm config.json."""
    if name.startswith(HF_HUB_PREFIX):
        if not _HUB_ID.match(name[len(HF_HUB_PREFIX):]):
            raise ModelError(f"'model.name' = {name}: a Hugging Face hub model is named hf-hub:ORG/NAME[@REVISION] "
                             f"(for example hf-hub:timm/resnet50.a1_in1k)")
        return
    if name.startswith(LOCAL_DIR_PREFIX):
        _check_local_dir(name)
        return
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
                 norm: str = "batch", group_norm_groups: int = 32, grad_checkpointing: bool = False,
                 in_chans: int = 3) -> torch.nn.Module:
    check_model_name(name)
    if name.startswith(TORCHVISION_PREFIX):
        tv_name = name[len(TORCHVISION_PREFIX):]
        kwargs = _torchvision_kwargs(tv_name, drop_rate, drop_path_rate)
        if grad_checkpointing:
            kwargs.update(_torchvision_checkpointing_kwargs(tv_name))
        model = torchvision.models.get_model(tv_name, weights=None, num_classes=num_classes, **kwargs)
        if in_chans != 3:
            replace_stem(model, in_chans, name)
    else:
        kwargs = {"pretrained": False, "num_classes": num_classes, "drop_rate": drop_rate}
        if in_chans != 3:
            kwargs["in_chans"] = in_chans
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


def build_model(model_cfg, num_classes: int, in_chans: int = 3) -> torch.nn.Module:
    """The classifier that `model_cfg` (the config's `model` section) describes, with fresh weights, for
    `in_chans` input channels (`data.channels`)."""
    m = model_cfg
    return create_model(m.name, num_classes, m.drop_rate, m.drop_path_rate, m.norm, m.group_norm_groups,
                        m.grad_checkpointing, in_chans)


def stem_conv(model: torch.nn.Module) -> tuple[str, torch.nn.Conv2d]:
    """(name, module) of the model's first convolution: the stem that reads the input channels."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Conv2d):
            return name, module
    raise ModelError(f"{type(model).__name__} has no Conv2d to read the input channels")


def replace_stem(model: torch.nn.Module, in_chans: int, name: str) -> None:
    """A torchvision model's first convolution rebuilt for `in_chans` channels (torchvision has no channel
    argument), its weights adapted from the 3-channel ones as timm adapts a pretrained stem."""
    path, conv = stem_conv(model)
    if conv.groups != 1:
        raise ModelError(f"'model.name' = {name}: its first convolution is grouped; data.channels={in_chans} "
                         f"needs a plain stem")
    new = torch.nn.Conv2d(in_chans, conv.out_channels, conv.kernel_size, conv.stride, conv.padding, conv.dilation,
                          bias=conv.bias is not None, padding_mode=conv.padding_mode)
    with torch.no_grad():
        new.weight.copy_(adapt_channels(in_chans, conv.weight))
        if conv.bias is not None:
            new.bias.copy_(conv.bias)
    parent_path, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent_path) if parent_path else model, attr, new)


def adapt_stem_weights(model: torch.nn.Module, state: dict) -> dict:
    """`state` with its stem weight adapted to the model's input channels when they differ (a 3-channel
    pretrained model or a checkpoint of any channel count into N channels: `adapt_channels`). Says so in the
    log."""
    path, conv = stem_conv(model)
    key = f"{path}.weight"
    weight = state.get(key)
    if (weight is None or weight.ndim != 4 or weight.shape[1] == conv.in_channels
            or weight.shape[0] != conv.out_channels or weight.shape[2:] != conv.weight.shape[2:]):
        return state
    log.info("%s: %d-channel weights adapted to %d input channels (timm's adapt_input_conv rule)", key,
             weight.shape[1], conv.in_channels)
    return {**state, key: adapt_channels(conv.in_channels, weight.float()).to(weight.dtype)}


def adapt_channels(in_chans: int, weight: torch.Tensor) -> torch.Tensor:
    """A stem weight (O, I, kH, kW) for `in_chans` input channels, by timm's adapt_input_conv rule for any I:
    one channel sums the I filters; N channels repeat them cyclically, scaled by I / N (a 3-channel weight gives
    exactly timm's; timm itself refuses, or keeps as it is, a source of other than 3 channels)."""
    sources = weight.shape[1]
    if in_chans == 1:
        return weight.sum(dim=1, keepdim=True)
    repeated = weight.repeat(1, math.ceil(in_chans / sources), 1, 1)[:, :in_chans]
    return repeated * (sources / in_chans)


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
    problem = not_a_regular_file(path)
    if problem:
        raise ModelError(f"'model.weights' = {path}: {problem}; it must name a regular file")
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
    state = adapt_stem_weights(model, state)
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


def _has_weight_source(pretrained_cfg: dict) -> bool:
    return any(pretrained_cfg.get(k) for k in ("url", "file", "state_dict", "hf_hub_id"))


def _unavailable(name: str, err: Exception, offline_why: str = "") -> ModelError:
    """One line: the model, why its weights could not be had (the hub's reachability when it is offline), and
    the ways to provide them."""
    reason = offline_why or (str(err).strip().splitlines() or [type(err).__name__])[0].split(". ")[0][:200]
    if name.startswith(LOCAL_DIR_PREFIX):
        return ModelError(f"'model.name' = {name}: cannot load its pretrained weights ({reason}); the folder needs "
                          f"config.json and model.safetensors (or pytorch_model.bin), as timm's save_for_hf writes them")
    cache = ("torch's hub cache (TORCH_HOME, default ~/.cache/torch/hub/checkpoints)"
             if name.startswith(TORCHVISION_PREFIX) else
             "the Hugging Face hub cache (HF_HOME: download once where there is a network, then set HF_HUB_OFFLINE=1)")
    return ModelError(f"'model.name' = {name}: its pretrained weights are not cached here and cannot be downloaded "
                      f"({reason}); provide them with model.weights=FILE (and model.pretrained=false), a "
                      f"local-dir:/path/to/folder model name (config.json + model.safetensors or "
                      f"pytorch_model.bin), or {cache}")


def load_pretrained(model_cfg) -> torch.nn.Module:
    """The model named by `model_cfg.name` with its pretrained weights and its own classifier: timm's loader
    (the hub cache, downloading when allowed), or torchvision's default weights for tv: names. ModelError
    (exit 2) when they cannot be had, naming the model and how to provide them."""
    name = model_cfg.name
    if "." in name and not name.startswith((HF_HUB_PREFIX, LOCAL_DIR_PREFIX)) and not timm.list_pretrained(name):
        raise ModelError(f"'model.name' = {name}: timm has no pretrained weights with that tag "
                         f"(timm.list_pretrained('{name.split('.')[0]}.*') lists them)")
    offline, why = (False, "") if name.startswith((TORCHVISION_PREFIX, LOCAL_DIR_PREFIX)) else hub_offline()
    if name.startswith(LOCAL_DIR_PREFIX):
        check_timm_folder(name[len(LOCAL_DIR_PREFIX):])
    try:
        if name.startswith(TORCHVISION_PREFIX):
            return torchvision.models.get_model(name[len(TORCHVISION_PREFIX):], weights="DEFAULT")
        model = timm.create_model(name, pretrained=True)
    except (OSError, ValueError, KeyError) as err:  # hub / URL errors are OSErrors; no DEFAULT weights: ValueError
        raise _unavailable(name, err, why if offline else "") from err
    if not _has_weight_source(model.pretrained_cfg):
        raise ModelError(f"'model.name' = {name}: timm has no pretrained weights for it (pick a name with a "
                         f"pretrained tag, e.g. from timm.list_pretrained(), or set model.pretrained=false)")
    return model


def pretrained_preprocessing(name: str, model: torch.nn.Module) -> dict:
    """The pretrained weights' preprocessing as data.* values: timm's resolve_data_config of the model's
    pretrained_cfg, or the torchvision weights' transforms. An interpolation we do not offer is left out."""
    if name.startswith(TORCHVISION_PREFIX):
        transforms = torchvision.models.get_model_weights(name[len(TORCHVISION_PREFIX):]).DEFAULT.transforms()
        values = {"mean": list(transforms.mean), "std": list(transforms.std),
                  "interpolation": transforms.interpolation.value,
                  "crop_pct": transforms.crop_size[0] / transforms.resize_size[0]}
    else:
        resolved = timm.data.resolve_data_config({}, model=model)
        values = {k: resolved[k] for k in ("mean", "std", "interpolation", "crop_pct")}
        values["mean"], values["std"] = list(values["mean"]), list(values["std"])
    if values["interpolation"] not in INTERPOLATIONS:
        log.warning("the pretrained config's interpolation %r is not one of %s; data.interpolation keeps its value",
                    values.pop("interpolation"), ", ".join(INTERPOLATIONS))
    return {f"data.{k}": v for k, v in values.items()}


def prepare_pretrained(cfg, resume_config: Optional[dict]) -> tuple[Optional[torch.nn.Module], list[str]]:
    """For model.pretrained: the model with its pretrained weights (see load_pretrained), and the data.*
    preprocessing of its pretrained config filled in where the user set none. Returns (that model, lines for the
    log). When resuming nothing is loaded (last.pt restores the weights) and the resumed run's values are used."""
    if resume_config is not None:
        saved = resume_config.get("data", {})
        values = {k: saved[k.split(".")[1]] for k in PRETRAINED_DATA_KEYS if k.split(".")[1] in saved}
        return None, (["model.pretrained: resuming, so nothing is loaded (last.pt restores the weights)"]
                      + fill_unset(cfg, values, "the resumed run's config"))
    source = load_pretrained(cfg.model)
    values = pretrained_preprocessing(cfg.model.name, source)
    if cfg.data.channels != 3:  # the pretrained RGB mean / std say nothing about N bands: auto (docs/channels.md)
        values = {k: v for k, v in values.items() if k not in ("data.mean", "data.std")}
    return source, fill_unset(cfg, values, f"{cfg.model.name}'s pretrained config")


def load_pretrained_weights(model: torch.nn.Module, source: torch.nn.Module, name: str, classes: list[str]) -> None:
    """Copy every tensor of `source` whose name and shape match into `model`, except its classifier: ours is new,
    initialised for `classes`, unless the pretrained config's label_names are exactly those (a model trained
    on these classes, as our timm export writes it). Says which."""
    head = classifier_parameter_names(model)
    labels = list((getattr(source, "pretrained_cfg", None) or {}).get("label_names") or [])
    same_classes = labels == list(classes)
    state = {k: v for k, v in source.state_dict().items() if same_classes or k not in head}
    loaded, skipped = load_matching_weights(model, state)
    if same_classes and head <= set(loaded):
        detail = "classifier loaded too (its label_names are our classes)"
    else:
        detail = f"new classifier initialised for our {len(classes)} classes ({', '.join(sorted(head))})"
    log.info("model.pretrained: %d tensors loaded from %s; %s", len(loaded), name, detail)
    others = [n for n in skipped if n not in head]
    if others:
        log.warning("model.pretrained: not loaded (absent or another shape in the pretrained weights): %s",
                    ", ".join(others))


def classifier_parameter_names(model: torch.nn.Module) -> set[str]:
    """Names of the classifier's parameters, by models.feature_tap's rule (timm's get_classifier(), else
    torchvision's fc / classifier / heads)."""
    heads = classifier_heads(model)
    if not heads:
        raise ModelError(f"cannot tell the classifier of {type(model).__name__}: no get_classifier() with weights "
                         f"and no torchvision head ({', '.join(TORCHVISION_HEADS)}); model.freeze and "
                         f"optim.head_lr_scale need one")
    ids = {id(p) for _, h in heads for p in h.parameters()}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def _keep_eval(module: torch.nn.Module, args) -> None:
    module.training = False  # a frozen BatchNorm normalises with, and keeps, its pretrained statistics


class BackboneFreeze:
    """model.freeze=backbone: every parameter but the classifier's has requires_grad off until epoch
    `unfreeze_epoch` (0-based; None: the whole run), so it gets no gradient, and so no optimizer state (SGD
    momentum and Adam moments start at the unfreeze). BatchNorm layers outside the classifier then run as in
    eval mode: they normalise with their running statistics and do not update them, so every frozen tensor
    stays bitwise unchanged. The modules stay in place, so state_dicts and optimizer groups keep their shape
    and a run resumes across the unfreeze."""

    def __init__(self, model: torch.nn.Module, unfreeze_epoch: Optional[int]):
        head = classifier_parameter_names(model)
        self.params = [p for n, p in model.named_parameters() if n not in head]
        head_ids = {id(p) for n, p in model.named_parameters() if n in head}
        self.norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                      and not any(id(p) in head_ids for p in m.parameters())]
        self.unfreeze_epoch = unfreeze_epoch
        self.head = sorted(head)
        self.hooks: list = []
        self.frozen: Optional[bool] = None  # None: not set yet (the first epoch of this process says which)

    def set_epoch(self, epoch: int) -> None:
        """Freeze or unfreeze for `epoch` (0-based); call at each epoch start (also the resumed one)."""
        frozen = self.unfreeze_epoch is None or epoch < self.unfreeze_epoch
        if frozen == self.frozen:
            return
        for p in self.params:
            p.requires_grad_(not frozen)
        if frozen:
            self.hooks = [m.register_forward_pre_hook(_keep_eval) for m in self.norms]
            until = f"until epoch {self.unfreeze_epoch + 1}" if self.unfreeze_epoch is not None else "for the whole run"
            log.info("model.freeze=backbone: %d parameter tensors frozen %s (BatchNorm statistics kept); "
                     "training only the classifier (%s)", len(self.params), until, ", ".join(self.head))
        else:
            for hook in self.hooks:
                hook.remove()
            self.hooks = []
            log.info("epoch %d: backbone unfrozen (model.unfreeze_epoch=%d); all parameters train", epoch + 1,
                     self.unfreeze_epoch)
        self.frozen = frozen
