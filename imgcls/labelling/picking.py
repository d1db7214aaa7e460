"""`imgcls label pick`'s work: score an unlabelled pool with a model file and write the K images to label next.

One pass of the Predictor (no augmentation: the eval preprocessing) gives each pool image its calibrated
probabilities, its pooled pre-logits embedding (the tap the embedder reads) and, with `--skip-foreign`, the
reject score. Left out before the strategy chooses, each counted: files that cannot be read, images listed in
`--exclude` (the labelled CSV), near duplicates of labelled images (cosine similarity of the embeddings at least
`duplicate_similarity`), and with `--skip-foreign` the images the reject option calls `unknown`. A pool larger
than `max_pool` is scored on a seeded random subset of that size (the top K of a huge pool picks poorly, and
scoring all of it costs hours). The picks are a function of (model file, pool, seed)."""
from __future__ import annotations

import csv
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from imgcls.core.errors import ConfigError, DataTreeError
from imgcls.data.datasets import expand_inputs, inference_batches
from imgcls.data.listing import read_csv_rows
from imgcls.labelling.strategies import Selection, is_young, select
from imgcls.model_files.predictor import Predictor, TrustOptions
from imgcls.models.feature_tap import FeatureTap

log = logging.getLogger(__name__)

PICK_COLUMNS = ["path", "label", "prob", "score", "reason"]

DEFAULT_MAX_POOL = 20000        # pool images scored at most (a seeded random subset of a larger pool)
DEFAULT_DUPLICATE_SIMILARITY = 0.9995 # cosine similarity to a labelled image's embedding: a near duplicate
BATCH_SIZE = 32


@dataclass
class PickOptions:
    budget: int
    strategy: str = "default"
    seed: int = 0
    max_pool: int = DEFAULT_MAX_POOL
    skip_foreign: bool = False
    duplicate_similarity: float = DEFAULT_DUPLICATE_SIMILARITY
    device: str = "auto"
    num_workers: int = 0


@dataclass
class ScoredPool:
    paths: list[str]
    probs: np.ndarray                       # [N, C] calibrated probabilities (rows of unreadable files: zeros)
    vectors: np.ndarray                     # [N, D] L2-normalised embeddings
    readable: np.ndarray                    # [N] bool
    foreign: np.ndarray                     # [N] bool: the reject option's `unknown`
    errors: dict = field(default_factory=dict)


def labelled_paths(exclude_csv: Optional[str], classes: list[str]) -> list[str]:
    """The files a `path,label` CSV names (relative to its folder), checked against the model's classes (a list
    of another task's labels is a usage error)."""
    if not exclude_csv:
        return []
    rows = read_csv_rows(exclude_csv, "path", "label")
    known = set(classes)
    strange = sorted({row.label for row in rows if row.label not in known})
    if strange:
        raise ConfigError(f"--exclude {exclude_csv}: label(s) {', '.join(strange[:5])} are not classes of the "
                          f"checkpoint ({', '.join(classes[:10])}): a labelled list of another task or model")
    base = Path(exclude_csv).parent
    return [row.path if os.path.isabs(row.path) else str(base / row.path) for row in rows]


def pool_subset(paths: list[str], max_pool: int, seed: int) -> list[str]:
    """At most `max_pool` of `paths`: a seeded random subset, in pool order."""
    if len(paths) <= max_pool:
        return paths
    keep = np.sort(np.random.default_rng(seed).choice(len(paths), size=max_pool, replace=False))
    return [paths[i] for i in keep]


def open_predictor(checkpoint: str, options: PickOptions) -> Predictor:
    predictor = Predictor.open(checkpoint, options.device, None, topk=1 << 20,
                               trust=TrustOptions(reject=options.skip_foreign), for_serving=False)
    if predictor.task.label_format != "class":  # one class per image
        raise ConfigError(f"--checkpoint {checkpoint}: a {predictor.task.title} model; label pick chooses images "
                          f"for single-label models (data.task=multiclass)")
    return predictor


def score_paths(predictor: Predictor, paths: list[str], num_workers: int = 0) -> ScoredPool:
    """The pass: probabilities, embeddings and (when the predictor rejects) the foreign flags of `paths`."""
    tap = FeatureTap(predictor.model)
    if not tap.available:
        raise ConfigError(f"--checkpoint {predictor.model_file.path}: the model has no classifier layer to take "
                          f"embeddings before")
    features: list[torch.Tensor] = []

    def keep_features(logits, n):
        features.append(tap.take()[:n].float().cpu())

    loader = inference_batches(paths, predictor.transform, BATCH_SIZE, num_workers, predictor.runtime.device)
    try:
        preds = predictor.predict(loader, keep_features)
        rows = predictor.rows(paths, preds)
    finally:
        tap.close()
        predictor.close()
    readable = preds.valid.numpy().astype(bool)
    probs = np.zeros((len(paths), len(predictor.classes)), np.float64)
    np.put_along_axis(probs, preds.top_indices.astype(np.int64), preds.top_probs.astype(np.float64), axis=1)
    probs[~readable] = 0.0
    vectors = torch.nn.functional.normalize(torch.cat(features), dim=1).numpy() if features else np.zeros((0, 1))
    foreign = np.array([r.get("label") == "unknown" and "predicted" in r for r in rows], dtype=bool)
    return ScoredPool(paths, probs, vectors.astype(np.float32), readable, foreign, dict(preds.errors))


def near_duplicates(pool: np.ndarray, labelled: np.ndarray, similarity: float) -> np.ndarray:
    """[N] bool: pool vectors whose cosine similarity to some labelled vector is at least `similarity`."""
    found = np.zeros(len(pool), bool)
    for start in range(0, len(labelled), 2048):
        found |= (pool @ labelled[start:start + 2048].T).max(axis=1) >= similarity
    return found


@dataclass
class Candidates:
    positions: np.ndarray                  # pool positions the strategy may choose from
    counts: dict                           # why others were left out -> how many


def candidates(scored: ScoredPool, labelled_vectors: np.ndarray, similarity: float) -> Candidates:
    """The pool positions a strategy may choose (the labelled images themselves are not in the scored pool)."""
    duplicate = near_duplicates(scored.vectors, labelled_vectors, similarity) if len(labelled_vectors) else \
        np.zeros(len(scored.paths), bool)
    unreadable = ~scored.readable
    foreign = scored.foreign & scored.readable
    duplicate &= scored.readable
    keep = scored.readable & ~duplicate & ~foreign
    counts = {"unreadable": int(unreadable.sum()), "near duplicates of labelled images": int(duplicate.sum()),
              "foreign (reject option)": int(foreign.sum())}
    return Candidates(np.flatnonzero(keep), counts)


def write_picks(rows: list[dict], output: str) -> None:
    """The picks CSV, written beside its name and renamed over it (the csv module quotes commas, quotes and
    newlines in paths)."""
    target = Path(output)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=PICK_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, target)


def pick_rows(scored: ScoredPool, chosen: Selection, classes: list[str]) -> list[dict]:
    rows = []
    for position, score, reason in zip(chosen.positions.tolist(), chosen.scores.tolist(), chosen.reasons):
        best = int(np.argmax(scored.probs[position]))
        rows.append({"path": scored.paths[position], "label": classes[best],
                     "prob": f"{scored.probs[position, best]:.6f}", "score": f"{score:.6f}", "reason": reason})
    return rows


def run_pick(checkpoint: str, pool_inputs: list[str], output: str, exclude_csv: Optional[str],
             options: PickOptions) -> int:
    """Score the pool, leave out what may not be picked, choose, write `output`; returns the exit status."""
    all_paths = expand_inputs(pool_inputs)
    predictor = open_predictor(checkpoint, options)
    labelled = labelled_paths(exclude_csv, predictor.classes)
    excluded = {os.path.realpath(p) for p in labelled}
    outside = [p for p in all_paths if os.path.realpath(p) not in excluded]
    if options.budget > len(outside):
        raise ConfigError(f"--budget {options.budget}: the pool holds {len(outside)} image(s) not already labelled "
                          f"(of {len(all_paths)}); ask for at most {len(outside)}")
    if len(outside) < len(all_paths):
        print(f"left out {len(all_paths) - len(outside)} pool image(s): already labelled (--exclude)", file=sys.stderr)
    paths = pool_subset(outside, options.max_pool, options.seed)
    if len(paths) < len(outside):
        print(f"scoring a random subset of {len(paths)} of the {len(outside)} pool images (--max-pool, seed "
              f"{options.seed})", file=sys.stderr)
    known = [p for p in labelled if os.path.isfile(p)]
    scored = score_paths(predictor, paths + known, options.num_workers)
    labelled_vectors = scored.vectors[len(paths):][scored.readable[len(paths):]]
    scored = ScoredPool(paths, scored.probs[:len(paths)], scored.vectors[:len(paths)], scored.readable[:len(paths)],
                        scored.foreign[:len(paths)], {i: e for i, e in scored.errors.items() if i < len(paths)})
    if not scored.readable.any():
        channels = predictor.model_file.cfg.data.channels
        raise DataTreeError(f"none of the {len(paths)} pool image(s) could be read as the checkpoint reads its "
                            f"images (data.channels={channels}); first: {next(iter(scored.errors.values()), '')}")
    found = candidates(scored, labelled_vectors, options.duplicate_similarity)
    for reason, count in found.counts.items():
        if count:
            print(f"left out {count} pool image(s): {reason}", file=sys.stderr)
    if options.budget > len(found.positions):
        raise ConfigError(f"--budget {options.budget}: only {len(found.positions)} pool image(s) may be picked "
                          f"after leaving out {sum(found.counts.values())} (see above); ask for fewer")
    young = is_young(len(labelled), len(predictor.classes))
    chosen = select(options.strategy, scored.probs[found.positions], scored.vectors[found.positions],
                    labelled_vectors, options.budget, options.seed, young)
    chosen = Selection(found.positions[chosen.positions], chosen.scores, chosen.reasons)
    write_picks(pick_rows(scored, chosen, predictor.classes), output)
    print(f"picked {options.budget} of {len(found.positions)} candidate(s) ({options.strategy} strategy"
          f"{', young model: typicality' if young and options.strategy == 'default' else ''}); wrote {output}",
          file=sys.stderr)
    return 0
