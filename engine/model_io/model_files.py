"""Every kind of model file that eval.py and infer.py take, behind one loader: a checkpoint written by
train.py (`best.pt`, `last.pt`), an ONNX model (`.onnx`, run by onnxruntime), a torch.export program
(`.pt2`), and a timm model folder (`config.json` + `model.safetensors`). Each gives the class names,
the config to run with (the eval preprocessing in `cfg.data`) and a module that maps a normalised
float batch to logits. Also the metadata that export.py writes beside an exported model, and reads back. (`ModelFile` itself:
`engine.model_io.model_file`; a checkpoint's reading: `engine.model_io.checkpoint_files`.)

onnxruntime and timm's folder loading are imported only when such a file is opened.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Callable, Optional

import torch

from core.config import Config
from core.errors import CheckpointError, ConfigError
from core.paths import not_a_regular_file
from engine.model_io.checkpoint_files import (check_class_names, check_thresholds, eval_config,
                                             preprocessing_record, read_checkpoint)
from engine.model_io.model_file import FunctionModel, ModelFile
from engine.evaluation.trust import export_record
from engine.model_io.pt2_archive import check_pt2_archive
from engine.runtime.device import memory_format
from models.timm_folder import check_timm_folder

log = logging.getLogger(__name__)

METADATA_VERSION = 1
ONNX_METADATA_PREFIX = "imgcls."    # ONNX metadata_props keys: imgcls.classes, imgcls.preprocessing, ...
PT2_METADATA_FILE = "imgcls.json"   # the .pt2 archive's extra file holding the same metadata as JSON
TIMM_METADATA_KEY = "imgcls"        # config.json key holding our training config beside timm's own keys


def model_file_kind(path: str | Path) -> str:
    path = Path(path)
    if path.is_dir():
        return "timm"
    return {".onnx": "onnx", ".pt2": "pt2"}.get(path.suffix.lower(), "checkpoint")


def load_model_file(path: str | Path, overrides: list[str] = (), classes_file: Optional[str] = None) -> ModelFile:
    """Open any model file eval.py and infer.py take (CheckpointError / ConfigError, exit 2, when it is
    not one). `classes_file` (one name per line) names the classes of a model that records none."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    kind = model_file_kind(path)
    opener = {"checkpoint": read_checkpoint, "onnx": _open_onnx, "pt2": _open_pt2, "timm": _open_timm_folder}[kind]
    opened = opener(path, list(overrides))
    if classes_file is not None:
        opened.classes = read_classes_file(classes_file, len(opened.classes))
    return opened


def read_classes_file(path: str | Path, count: int) -> list[str]:
    """Class names, one per line (blank lines ignored); their number must match the model's outputs."""
    path = Path(path)
    problem = not_a_regular_file(path)
    if problem:
        raise ConfigError(f"--classes {path}: {problem}; it must name a regular file (one class name per line)")
    try:
        names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"--classes {path}: cannot read it ({err})") from err
    if len(names) != count:
        raise ConfigError(f"--classes {path}: {len(names)} name(s), but the model has {count} outputs")
    return check_class_names(names, f"--classes {path}")


def numbered_classes(count: int, path: Path) -> list[str]:
    log.warning("%s records no class names: using class_0 .. class_%d (pass --classes FILE, one name per line)",
                path, count - 1)
    return [f"class_{i}" for i in range(count)]


# ---------------------------------------------------------------- the metadata export.py writes


def export_metadata(loaded: ModelFile, batch: Optional[int]) -> dict:
    """What an exported model carries: the class names, the eval preprocessing, the training config (so
    eval.py finds the data and batch size as for the checkpoint), the epoch and the traced batch."""
    config = loaded.cfg.to_dict()
    config["data"]["limit_val_batches"] = loaded.saved_val_limit
    return {"format_version": METADATA_VERSION, "classes": list(loaded.classes),
            "preprocessing": preprocessing_record(loaded.cfg), "config": config, "epoch": loaded.epoch,
            "batch": batch, "calibration": export_record(loaded.calibration), "thresholds": loaded.thresholds}


def onnx_metadata_props(metadata: dict) -> dict[str, str]:
    return {ONNX_METADATA_PREFIX + key: json.dumps(value) for key, value in metadata.items()}


def _metadata_from_onnx_props(props: dict[str, str], path: Path) -> Optional[dict]:
    ours = {k[len(ONNX_METADATA_PREFIX):]: v for k, v in props.items() if k.startswith(ONNX_METADATA_PREFIX)}
    if "classes" not in ours:
        return None
    try:
        return {key: json.loads(value) for key, value in ours.items()}
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: its imgcls metadata is not valid JSON ({err})") from err


def metadata_thresholds(metadata: Optional[dict], classes: list[str], path: Path) -> Optional[list]:
    """The per-class thresholds an export of a multi-label model carries (None: none recorded)."""
    return check_thresholds((metadata or {}).get("thresholds"), len(classes), str(path))


def _from_metadata(metadata: dict, path: Path, overrides: list[str]) -> tuple[Config, list[str], Optional[int]]:
    where = f"{path}"
    classes = check_class_names(metadata.get("classes"), where)
    cfg, saved_val_limit = eval_config(metadata.get("config") or {}, metadata.get("preprocessing") or {},
                                       overrides, where)
    return cfg, classes, saved_val_limit


# ---------------------------------------------------------------- the four kinds


def onnx_session(path: Path, device: torch.device = torch.device("cpu")):
    """An onnxruntime session on `device` (the CUDA provider where installed, else the CPU); a file the
    runtime refuses (not ONNX, an opset or operator it lacks) is a CheckpointError naming why."""
    import onnxruntime as ort

    providers = ["CPUExecutionProvider"]
    if device.type == "cuda":
        if "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, ("CUDAExecutionProvider", {"device_id": device.index or 0}))
        else:
            log.warning("onnxruntime has no CUDA provider here (pip install onnxruntime-gpu): running on the CPU")
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: the runtime's own warnings are not ours to show
    # idle pool threads sleep instead of spinning, leaving the cores to infer.py's decoding workers (measured:
    # README, Smaller models)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(str(path), sess_options=options, providers=providers)
    except Exception as err:  # onnxruntime raises its own pybind types (InvalidProtobuf, Fail, InvalidGraph...)
        raise CheckpointError(f"{path}: onnxruntime {ort.__version__} cannot load this model: "
                              f"{_runtime_refusal(str(err))}") from err


_RUNTIME_SOURCE = re.compile(r"/onnxruntime_src/\S+:\d+ .*?\)\s")  # the C++ file and function signature
_OPSET = re.compile(r"Opset (\d+) is under development.*?till opset (\d+)", re.S)


def _runtime_refusal(message: str) -> str:
    """onnxruntime's reason in one line, an unsupported opset said plainly."""
    opset = _OPSET.search(message)
    if opset:
        return (f"the model is stamped with ONNX opset {opset.group(1)}, and this onnxruntime runs opsets up to "
                f"{opset.group(2)} (export with an older opset, or upgrade onnxruntime)")
    return " ".join(_RUNTIME_SOURCE.sub("", message).split())[:300]


def _onnx_function(session) -> Callable:
    input_name = session.get_inputs()[0].name

    def run(images: torch.Tensor) -> torch.Tensor:
        array = images.detach().to("cpu", torch.float32).contiguous().numpy()
        return torch.from_numpy(session.run(None, {input_name: array})[0]).to(images.device)
    return run


def _open_onnx(path: Path, overrides: list[str]) -> ModelFile:
    session = onnx_session(path)
    shape = session.get_inputs()[0].shape  # [batch, 3, H, W]; symbolic dims are strings
    if len(shape) != 4:
        raise CheckpointError(f"{path}: the model's input has shape {shape}; an image classifier takes [N, 3, H, W]")
    fixed_batch = shape[0] if isinstance(shape[0], int) else None
    metadata = _metadata_from_onnx_props(session.get_modelmeta().custom_metadata_map, path)
    if metadata is not None:
        cfg, classes, saved_val_limit = _from_metadata(metadata, path, overrides)
        outputs = _onnx_class_count(session, fixed_batch or 1, cfg.data.img_size)
        if outputs != len(classes):
            raise CheckpointError(f"{path}: its imgcls.classes names {len(classes)} class(es), but the model has "
                                  f"{outputs} outputs; the file was altered after export.py wrote it: export it "
                                  f"again")
    else:
        cfg, saved_val_limit = eval_config({}, _foreign_onnx_preprocessing(shape, path), overrides, str(path))
        classes = numbered_classes(_onnx_class_count(session, fixed_batch or 1, cfg.data.img_size), path)

    def build(device: torch.device, channels_last: bool) -> torch.nn.Module:
        run_session = session if device.type == "cpu" else onnx_session(path, device)
        return FunctionModel(_onnx_function(run_session), fixed_batch)
    return ModelFile("onnx", path, cfg, classes, metadata.get("epoch") if metadata else None, build, fixed_batch,
                     saved_val_limit, calibration=metadata.get("calibration") if metadata else None,
                     thresholds=metadata_thresholds(metadata, classes, path))


def _foreign_onnx_preprocessing(shape: list, path: Path) -> dict:
    d = Config().data
    fixed = [s for s in shape[2:] if isinstance(s, int)]
    if len(fixed) == 2 and fixed[0] != fixed[1]:
        raise CheckpointError(f"{path}: the model takes fixed {fixed[0]}x{fixed[1]} (height x width) inputs; "
                              f"images here are square (data.img_size): export it with a square or dynamic "
                              f"input size")
    square = bool(fixed)
    size = fixed[0] if square else d.img_size
    log.warning("%s has no imgcls metadata (not written by export.py): preprocessing img_size %d (%s), "
                "crop_pct %s, %s, mean %s, std %s (the config defaults otherwise; eval.py takes data.* overrides)",
                path, size, "the model's input size" if square else "the default", d.crop_pct, d.interpolation,
                d.mean, d.std)
    return {"img_size": size}


def _onnx_class_count(session, batch: int, img_size: int) -> int:
    classes = session.get_outputs()[0].shape[-1]
    if isinstance(classes, int):
        return classes
    probe = torch.zeros(batch, 3, img_size, img_size)
    return int(_onnx_function(session)(probe).shape[-1])


def _open_pt2(path: Path, overrides: list[str]) -> ModelFile:
    extra = {PT2_METADATA_FILE: ""}
    check_pt2_archive(path)
    try:
        program = torch.export.load(str(path), extra_files=extra)
    except Exception as err:  # a damaged archive or another kind of file: torch raises many types
        reason = " ".join(str(err).split())[:200]
        raise CheckpointError(f"{path}: not a torch.export program ({type(err).__name__}: {reason})") from err
    if not extra[PT2_METADATA_FILE]:
        raise CheckpointError(f"{path}: a torch.export program without {PT2_METADATA_FILE} (classes and "
                              f"preprocessing): not written by export.py")
    try:
        metadata = json.loads(extra[PT2_METADATA_FILE])
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: its {PT2_METADATA_FILE} is not valid JSON ({err})") from err
    cfg, classes, saved_val_limit = _from_metadata(metadata, path, overrides)
    fixed_batch = metadata.get("batch")

    def build(device: torch.device, channels_last: bool) -> torch.nn.Module:
        on_device = program
        if device.type != "cpu":
            from torch.export.passes import move_to_device_pass

            on_device = move_to_device_pass(program, device)
        return FunctionModel(on_device.module().__call__, fixed_batch)
    return ModelFile("pt2", path, cfg, classes, metadata.get("epoch"), build, fixed_batch, saved_val_limit,
                     calibration=metadata.get("calibration"),
                     thresholds=metadata_thresholds(metadata, classes, path))


def _open_timm_folder(path: Path, overrides: list[str]) -> ModelFile:
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
                         "mean": list(pretrained_cfg.get("mean", d.mean)),
                         "std": list(pretrained_cfg.get("std", d.std))}
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
