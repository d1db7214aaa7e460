"""What an exported model carries beside its weights (the class names, the eval preprocessing, the training
config, the epoch, the traced batch, the calibration and tag thresholds), and how each format stores it."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

from imgcls.evaluation.trust import export_record
from imgcls.model_files.checkpoint_files import preprocessing_record
from imgcls.model_files.model_file import ModelFile
from imgcls.model_files.stored_metadata import ONNX_METADATA_PREFIX, check_thresholds

log = logging.getLogger(__name__)

METADATA_VERSION = 1
PT2_METADATA_FILE = "imgcls.json"   # the .pt2 archive's extra file holding the same metadata as JSON
TIMM_METADATA_KEY = "imgcls"        # config.json key holding our training config beside timm's own keys
OPENVINO_RT_INFO_KEY = "imgcls"     # the OpenVINO IR's rt_info section: imgcls/classes, ... each a JSON string


def numbered_classes(count: int, path: Path) -> list[str]:
    log.warning("%s records no class names: using class_0 .. class_%d (pass --classes FILE, one name per line)",
                path, count - 1)
    return [f"class_{i}" for i in range(count)]


def export_metadata(loaded: ModelFile, batch: Optional[int], carries_reject: bool = False) -> dict:
    """What an exported model carries: the class names, the eval preprocessing, the training config (so
    eval.py finds the data and batch size as for the checkpoint), the epoch, the traced batch and the
    calibration (`carries_reject`: the export computes the checkpoint's multi-layer reject score)."""
    config = loaded.cfg.to_dict()
    config["data"]["limit_val_batches"] = loaded.saved_val_limit
    return {"format_version": METADATA_VERSION, "classes": list(loaded.classes),
            "preprocessing": preprocessing_record(loaded.cfg), "config": config, "epoch": loaded.epoch,
            "batch": batch, "calibration": export_record(loaded.calibration, carries_reject), "thresholds": loaded.thresholds}


def onnx_metadata_props(metadata: dict) -> dict[str, str]:
    return {ONNX_METADATA_PREFIX + key: json.dumps(value) for key, value in metadata.items()}


def metadata_thresholds(metadata: Optional[dict], classes: list[str], path: Path) -> Optional[list]:
    """The per-class thresholds an export of a multi-label model carries (None: none recorded)."""
    return check_thresholds((metadata or {}).get("thresholds"), len(classes), str(path))
