"""A timm model folder (config.json + model.safetensors): timm's own `save_for_hf` layout, loadable by
`timm.create_model("local-dir:...", pretrained=True)` and uploadable to the Hugging Face hub as it is; our
training config sits beside timm's keys under `imgcls`, which timm ignores."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from imgcls.compute.device import memory_format
from imgcls.config import Config
from imgcls.core.errors import CheckpointError, ConfigError, ExportError
from imgcls.model_files.checkpoint_files import build_eval_model, preprocessing_record
from imgcls.model_files.formats.base import ModelFormat
from imgcls.model_files.metadata import TIMM_METADATA_KEY, metadata_thresholds, numbered_classes
from imgcls.model_files.model_file import ModelFile
from imgcls.model_files.stored_metadata import check_class_names, check_output_count, eval_config
from imgcls.models.factory import TORCHVISION_PREFIX, check_timm_folder

# pretrained_cfg entries that describe timm's published weights, not the ones we trained
PROVENANCE_KEYS = ("tag", "hf_hub_id", "hf_hub_filename", "url", "file", "source", "license", "origin",
                   "origin_url", "paper_ids", "paper_name", "notes", "state_dict")


def as_list(value):
    """timm's tuples as lists; anything else as it is, for the preprocessing check to name."""
    return list(value) if isinstance(value, tuple) else value


def open_timm_folder(path: Path, overrides: list[str]) -> ModelFile:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{path} is a folder without config.json: not a timm model folder (export.py "
                              f"--format timm writes one; a checkpoint is a .pt file, an ONNX model a .onnx file)")
    check_timm_folder(path)
    d = Config().data
    try:
        hf_config = json.loads(config_path.read_text())
        pretrained_cfg = hf_config["pretrained_cfg"]
        architecture = hf_config["architecture"]
        preprocessing = {"img_size": pretrained_cfg["input_size"][-1],
                         "crop_pct": pretrained_cfg.get("crop_pct", d.crop_pct),
                         "interpolation": pretrained_cfg.get("interpolation", d.interpolation),
                         "mean": as_list(pretrained_cfg.get("mean", d.mean)),
                         "std": as_list(pretrained_cfg.get("std", d.std))}
        names = hf_config.get("label_names") or pretrained_cfg.get("label_names")
        if isinstance(names, dict):  # timm allows {index: name}
            names = [names[key] for key in sorted(names, key=int)]
        count = int(hf_config.get("num_classes") or pretrained_cfg["num_classes"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, IndexError) as err:
        raise CheckpointError(f"{config_path}: not a timm config.json (needs 'architecture', 'num_classes' and "
                              f"'pretrained_cfg' with 'input_size'): {type(err).__name__}: {err}") from err
    ours = hf_config.get(TIMM_METADATA_KEY) or {}
    saved_config = ours.get("config") or {"model": {"name": architecture}}
    cfg, saved_val_limit = eval_config(saved_config, preprocessing, overrides, str(config_path))
    classes = check_class_names(list(names), str(config_path)) if names else numbered_classes(count, path)
    check_output_count(classes, count, str(config_path))

    def build(device: torch.device, channels_last: bool) -> torch.nn.Module:
        import timm

        try:
            model = timm.create_model(f"local-dir:{path}", pretrained=True)
        except (OSError, RuntimeError, ValueError, KeyError) as err:  # missing or mismatched weights, unknown model
            reason = " ".join(str(err).split())[:300]
            raise CheckpointError(f"{path}: timm cannot load this folder: {reason}") from err
        return model.to(device, memory_format=memory_format(channels_last)).eval()
    return ModelFile("timm", path, cfg, classes, ours.get("epoch"), build, saved_val_limit=saved_val_limit,
                     calibration=ours.get("calibration"),
                     thresholds=metadata_thresholds(ours, classes, config_path))


def write_timm_folder(loaded: ModelFile, folder: Path, batch: Optional[int], metadata: dict) -> None:
    """timm's own `save_for_hf`: model.safetensors and config.json with `architecture`, `num_classes`,
    `label_names` and `pretrained_cfg` (our input_size, interpolation, mean, std, crop_pct); our
    training config sits beside them under `imgcls`, which timm ignores."""
    name = loaded.cfg.model.name
    if name.startswith(TORCHVISION_PREFIX):
        raise ConfigError(f"--format timm: '{name}' is a torchvision model, which timm cannot build from a "
                          f"folder; export it as --format onnx or pt2")
    if loaded.cfg.model.norm != "batch":
        raise ConfigError(f"--format timm: this model was trained with model.norm={loaded.cfg.model.norm}, a layer "
                          f"swap timm's '{name}' does not make; export it as --format onnx or pt2")
    from timm.models import save_for_hf

    model = build_eval_model(loaded, torch.device("cpu"), channels_last=False)
    model.pretrained_cfg = {k: v for k, v in model.pretrained_cfg.items() if k not in PROVENANCE_KEYS}
    p = preprocessing_record(loaded.cfg)
    channels = loaded.cfg.data.channels
    data_config = {"input_size": (channels, p["img_size"], p["img_size"]), "interpolation": p["interpolation"],
                   "mean": tuple(p["mean"]), "std": tuple(p["std"]), "crop_pct": p["crop_pct"], "crop_mode": "center"}
    ours = {key: metadata[key] for key in ("format_version", "config", "epoch", "calibration", "thresholds")}
    try:
        save_for_hf(model, str(folder), model_config={"label_names": list(loaded.classes), TIMM_METADATA_KEY: ours},
                    model_args={"in_chans": channels} if channels != 3 else None, safe_serialization=True,
                    data_config=data_config)
    except Exception as err:  # safetensors raises its own SafetensorError for a full disk; OSError for the JSON
        reason = " ".join(str(err).split())[:300]
        raise ExportError(f"timm export to {folder} failed ({type(err).__name__}: {reason}); a full disk or a "
                          f"folder that cannot be written: free space or choose another --output") from err


FORMAT = ModelFormat("timm", "a timm model folder", open_timm_folder, folder=True, write=write_timm_folder,
                     folder_files=("config.json", "model.safetensors"))
