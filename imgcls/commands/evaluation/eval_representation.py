"""eval.py --knn K / --linear-probe: the model's pooled pre-logits features of the training split (the
memory bank, the probe's fit set) and of the evaluated split, through the evaluation loader and
preprocessing, scored without the classifier head (embedding/representation.py)."""
from __future__ import annotations

import logging
import os
import sys
from typing import Optional

from imgcls.data.build import build_eval_loader_for
from imgcls.data.listing.sources.registry import scan_sources, train_source
from imgcls.core.errors import ConfigError
from imgcls.model_files.formats import format_of
from imgcls.model_files.loading import load_model_file
from imgcls.embedding.embedder import Embedder, embedding_module
from imgcls.embedding.representation import knn_top1, linear_probe_top1, split_features
from imgcls.prediction.predictor import Predictor, prediction_runtime
from imgcls.runtime.device import DeviceInput, pin_memory_for

log = logging.getLogger(__name__)


def representation_figures(predictor: Predictor, evaluated_index, knn: Optional[int], linear_probe: bool) -> dict:
    """{"knn_top1", "knn_k", "linear_probe_top1", "memory_bank"} for what was asked (empty: nothing asked)."""
    if not knn and not linear_probe:
        return {}
    loaded = predictor.model_file
    model = embedding_module(loaded, predictor.runtime.device, predictor.device_input.channels_last, fold=False)
    embedder = Embedder(loaded, predictor.runtime, model, predictor.device_input, predictor.transform, digest="")
    bank = train_source(loaded.cfg.data, loaded.classes, loaded.data_source)
    figures = figures_of(embedder, bank.index, bank.described, evaluated_index, len(loaded.classes), knn, linear_probe)
    figures.pop("num_samples")  # the classifier's evaluation counts the same images
    return figures


def figures_of(embedder: Embedder, bank_index, bank_described: str, evaluated_index, num_classes: int,
               knn: Optional[int], linear_probe: bool) -> dict:
    cfg = embedder.model_file.cfg
    pin = pin_memory_for(cfg.data.pin_memory, embedder.runtime.device)

    def features(index):
        loader = build_eval_loader_for(index, embedder.transform, embedder.transform.img_size, cfg.train.batch_size,
                                       cfg.data.num_workers, pin, prefetch_factor=cfg.data.prefetch_factor)
        return split_features(embedder, loader)

    print(f"features of the memory bank: {bank_described} ({len(bank_index)} image(s))", file=sys.stderr)
    train, train_labels = features(bank_index)
    queries, labels = features(evaluated_index)
    figures = {"memory_bank": bank_described, "memory_bank_size": len(train), "num_samples": len(queries)}
    if knn:
        figures.update(knn_top1=knn_top1(train, train_labels, queries, labels, knn, num_classes), knn_k=knn)
    if linear_probe:
        figures["linear_probe_top1"] = linear_probe_top1(train, train_labels, queries, labels)
    return figures


def pretrained_features_only(checkpoint: str, data_root: Optional[str], overrides: list[str], knn: Optional[int],
                             linear_probe: bool) -> Optional[dict]:
    """eval.py --knn / --linear-probe with a timm folder whose head is not the data's (pretrained weights with
    another class list): the features alone, on the data's own classes, its training and validation splits
    found as train.py finds them. None when that is not the case (the classifier's evaluation stands)."""
    if not (knn or linear_probe):
        return None
    check_embeddable(checkpoint)
    if not os.path.isdir(checkpoint):  # a timm folder is a folder
        return None
    loaded = load_model_file(checkpoint, overrides)
    if loaded.kind != "timm":
        return None
    if data_root is not None:
        loaded.cfg.data.root = data_root
    sources = scan_sources(loaded.cfg)
    if set(sources.classes) == set(loaded.classes):
        return None
    log.info("%s: its %d-class head is not the data's %d classes: features only (no top1)", checkpoint,
             len(loaded.classes), len(sources.classes))
    runtime = prediction_runtime(loaded, None, None)
    cfg = loaded.cfg
    model = embedding_module(loaded, runtime.device, cfg.train.channels_last, fold=False)
    embedder = Embedder(loaded, runtime, model, DeviceInput.from_config(cfg, runtime.device, runtime.amp_dtype),
                        loaded.eval_transform(), digest="")
    figures = figures_of(embedder, sources.train_index, f"{cfg.data.root} ({cfg.data.train_split})",
                         sources.val_index, len(sources.classes), knn, linear_probe)
    return {**figures, "checkpoint": str(loaded.path), "model_format": loaded.kind, "classes": sources.classes,
            "features_only": True}


def features_line(figures: dict) -> str:
    return "   ".join(f"{name} {figures[key]:.2f}%" for key, name in
                      (("knn_top1", f"knn_top1 (k={figures.get('knn_k')})"), ("linear_probe_top1", "linear_probe_top1"))
                      if key in figures)


def check_embeddable(checkpoint: str) -> None:
    """ConfigError (exit 2) before the evaluation for a model file whose features cannot be read: a .pt2
    program, an ONNX file without the `embedding` output."""
    kind = format_of(checkpoint).name
    if kind == "pt2" or (kind == "onnx" and os.path.isfile(checkpoint)
                         and load_model_file(checkpoint).build_embedding is None):
        raise ConfigError(f"--knn / --linear-probe: {checkpoint} gives logits only; evaluate the checkpoint, a timm "
                          f"folder, or an ONNX file written by export.py --embedding")


def report_features_only(figures: dict, json_path: Optional[str]) -> None:
    from imgcls.core.outputs import write_json

    print(f"{figures['checkpoint']} (features only, {figures['num_samples']} image(s)): {features_line(figures)}")
    if json_path:
        write_json(figures, json_path)
        print(f"wrote {json_path}")
