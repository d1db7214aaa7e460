"""Model files whose stored metadata the program must refuse (exit 2, naming the field, its value and what is
allowed), for every path that opens a model file: a tiny ONNX graph built by hand (no training), with
export.py's metadata and one field spoilt."""
from __future__ import annotations

import copy
from pathlib import Path

CLASSES = ["a", "b", "c"]
IMG_SIZE = 16

# (case, the spoilt metadata as changes, what the refusal names)
BAD_METADATA = [
    ("fewer classes than outputs", {"classes": ["a", "b"]}, "'classes' names 2 class(es), but the model has 3"),
    ("NaN threshold", {"thresholds": [float("nan"), 0.5, 0.5]}, "'thresholds' = thresholds[0] = nan"),
    ("threshold above 1", {"thresholds": [0.5, 1.5, 0.5]}, "'thresholds' = thresholds[1] = 1.5"),
    ("string thresholds", {"thresholds": "0.5"}, "'thresholds' = '0.5' is not a list"),
    ("string threshold", {"thresholds": ["0.5", 0.5, 0.5]}, "'thresholds' = thresholds[0] = '0.5'"),
    ("std 0", {"preprocessing.std": [0, 0, 0]}, "'data.std' = [0.0, 0.0, 0.0]: every value must be within"),
    ("crop_pct -1", {"preprocessing.crop_pct": -1}, "'data.crop_pct' = -1.0 is out of range"),
    ("crop_pct 0", {"preprocessing.crop_pct": 0}, "'data.crop_pct' = 0.0 is out of range"),
    ("img_size 0", {"preprocessing.img_size": 0}, "'data.img_size' = 0 is out of range"),
    ("unknown interpolation", {"preprocessing.interpolation": "lanczos"},
     "'data.interpolation' = 'lanczos' is not allowed; expected 'bilinear' | 'bicubic' | 'nearest'"),
    ("string mean", {"preprocessing.mean": "0.5"}, "'data.mean' = '0.5' is not allowed; expected 'auto' or a list of float"),
    ("NaN reject threshold", {"calibration.thresholds": {"energy": float("nan")}},
     "reject threshold (energy) nan is not a finite number"),
]


def good_metadata() -> dict:
    """What export.py stores for a 3-class single-label model at 16 px (model_files.metadata.export_metadata)."""
    from imgcls.config import Config

    cfg = Config()
    cfg.model.name, cfg.data.img_size = "resnet10t", IMG_SIZE
    preprocessing = {"img_size": IMG_SIZE, "resize": 18, "crop_pct": 0.875, "mean": [0.485, 0.456, 0.406],
                     "std": [0.229, 0.224, 0.225], "interpolation": "bilinear", "train_img_size": IMG_SIZE}
    return {"format_version": 1, "classes": list(CLASSES), "preprocessing": preprocessing, "config": cfg.to_dict(),
            "epoch": 1, "batch": None, "calibration": {"temperature": 1.0, "thresholds": {"energy": 1.0}},
            "thresholds": None}


def spoilt(changes: dict) -> dict:
    """good_metadata with `changes` (dotted keys one level deep) applied."""
    metadata = copy.deepcopy(good_metadata())
    for key, value in changes.items():
        if "." in key:
            section, name = key.split(".")
            metadata[section][name] = value
        else:
            metadata[key] = value
    return metadata


def write_onnx(path: Path, metadata: dict, outputs: int = len(CLASSES)) -> Path:
    """A dynamic-batch ONNX classifier (global average pool, then a [3, outputs] MatMul) with `metadata` in its
    metadata_props as export.py writes them."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from imgcls.model_files.metadata import onnx_metadata_props

    weights = numpy_helper.from_array(np.arange(3 * outputs, dtype=np.float32).reshape(3, outputs) / 10, "weights")
    graph = helper.make_graph(
        [helper.make_node("GlobalAveragePool", ["images"], ["pooled"]),
         helper.make_node("Flatten", ["pooled"], ["flat"]),
         helper.make_node("MatMul", ["flat", "weights"], ["logits"])], "tiny",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, IMG_SIZE, IMG_SIZE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", outputs])], [weights])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    for key, value in onnx_metadata_props(metadata).items():
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(path))
    return path
