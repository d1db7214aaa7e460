"""eval.py --knn K / --linear-probe: the model's pooled pre-logits features of the training split (the
memory bank, the probe's fit set) and of the evaluated split, through the evaluation loader and
preprocessing, scored without the classifier head (embedding/representation.py)."""
from __future__ import annotations

import logging
import sys
from typing import Optional

from data.build import build_eval_loader_for
from data.listing.sources import train_source
from embedding.embedder import Embedder, embedding_module
from embedding.representation import knn_top1, linear_probe_top1, split_features
from prediction.predictor import Predictor
from runtime.device import pin_memory_for

log = logging.getLogger(__name__)


def representation_figures(predictor: Predictor, evaluated_index, knn: Optional[int], linear_probe: bool) -> dict:
    """{"knn_top1", "knn_k", "linear_probe_top1", "memory_bank"} for what was asked (empty: nothing asked)."""
    if not knn and not linear_probe:
        return {}
    loaded = predictor.model_file
    cfg = loaded.cfg
    model = embedding_module(loaded, predictor.runtime.device, predictor.device_input.channels_last, fold=False)
    embedder = Embedder(loaded, predictor.runtime, model, predictor.device_input, predictor.transform, digest="")
    bank = train_source(cfg.data, loaded.classes, loaded.data_source)
    pin = pin_memory_for(cfg.data.pin_memory, embedder.runtime.device)

    def features(index):
        loader = build_eval_loader_for(index, embedder.transform, embedder.transform.img_size, cfg.train.batch_size,
                                       cfg.data.num_workers, pin, prefetch_factor=cfg.data.prefetch_factor)
        return split_features(embedder, loader)

    print(f"features of the memory bank: {bank.described} ({len(bank.index)} image(s))", file=sys.stderr)
    train, train_labels = features(bank.index)
    queries, labels = features(evaluated_index)
    figures = {"memory_bank": bank.described, "memory_bank_size": len(train)}
    if knn:
        figures.update(knn_top1=knn_top1(train, train_labels, queries, labels, knn, len(loaded.classes)), knn_k=knn)
    if linear_probe:
        figures["linear_probe_top1"] = linear_probe_top1(train, train_labels, queries, labels)
    return figures
