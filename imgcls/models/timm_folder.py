"""A timm model folder (`config.json` + weights, as `timm.models.save_for_hf` writes it; `local-dir:` model
names and exported timm folders) checked against itself before timm loads it.

timm builds the model its config.json describes and, when a classifier in the weights has another shape,
drops it and starts a random one (an INFO line "expected if adapted"); other shape differences, a cut
safetensors file or a hostile pickle end in a traceback. Here the weights' names and shapes are read
(safetensors: the header only; other files by `torch.load(weights_only=True)`) and compared with the model
config.json builds on the meta device (no memory), so every such folder ends in one line, exit 2.
"""
from __future__ import annotations

from pathlib import Path

import torch

from imgcls.core.errors import CheckpointError, ModelError

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
