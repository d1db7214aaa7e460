"""The exemplar memory of a class-incremental run: up to `incremental.memory_per_class` images of each old class,
chosen by herding (iCaRL, Rebuffi et al. 2017) on the base model's L2-normalised embeddings of the files the base
run trained on (its recorded data source), and of the base run's own memory when it was an extension itself, so
the memory carries over (A, then A+B, then A+B+C). The choice is written to the run directory as `memory.csv`
(`path`, `label`, `sha256` of the file's bytes); a resumed run reads it back and refuses files whose bytes
changed. The exemplars join the training split, so the run's data fingerprint covers them.

Base files that are gone are said and left out; when no old-class file is left, the run continues with
distillation alone."""
from __future__ import annotations

import csv
import io
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from imgcls.compute.device import DeviceInput
from imgcls.core.errors import CheckpointError, ConfigError, DataTreeError
from imgcls.core.files import write_text_atomic
from imgcls.core.safe_load import load_checkpoint
from imgcls.data.build import build_eval_loader_for, eval_transform
from imgcls.data.listing import ImageIndex, scan_split
from imgcls.data.settings import eval_size
from imgcls.data.sources import train_source
from imgcls.model_files.model_file import ModelFile
from imgcls.models.feature_tap import features_and_logits
from imgcls.objectives.teacher import file_sha256

log = logging.getLogger(__name__)

MEMORY_FILE = "memory.csv"
COLUMNS = ("path", "label", "sha256")
# herding looks at most this many files of a class (the first in the source's order): a bounded start-up
MAX_CANDIDATES = 2000


@dataclass(frozen=True)
class Exemplar:
    path: str    # absolute
    label: str   # the class name
    sha256: str  # of the file's bytes


def read_memory(path: Path) -> list[Exemplar]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and set(COLUMNS) - set(rows[0]):
        raise DataTreeError(f"{path}: not an exemplar list (columns {', '.join(COLUMNS)})")
    return [Exemplar(r["path"], r["label"], r["sha256"]) for r in rows]


def write_memory(exemplars: list[Exemplar], run_dir: Path) -> None:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    writer.writerows((e.path, e.label, e.sha256) for e in exemplars)
    write_text_atomic(out.getvalue(), Path(run_dir) / MEMORY_FILE)


def changed(exemplars: list[Exemplar]) -> list[str]:
    """The exemplars whose file is gone or whose bytes differ from the recorded digest ("path (why)")."""
    problems = []
    for e in exemplars:
        if not Path(e.path).is_file():
            problems.append(f"{e.path} (gone)")
        elif file_sha256(Path(e.path)) != e.sha256:
            problems.append(f"{e.path} (its bytes changed)")
    return problems


def carried_memory(base_path: Path, classes: list[str]) -> list[Exemplar]:
    """The base run's own memory (when it was an extension): its files still there with the same bytes."""
    listed = base_path.parent / MEMORY_FILE
    if not listed.is_file():
        return []
    exemplars = [e for e in read_memory(listed) if e.label in classes]
    problems = changed(exemplars)
    if problems:
        log.warning("incremental: %d of the base run's %d exemplars are gone or changed and are left out: %s",
                    len(problems), len(exemplars), "; ".join(problems[:5]))
    bad = {p.rsplit(" (", 1)[0] for p in problems}
    return [e for e in exemplars if e.path not in bad]


def base_training_files(opened: ModelFile) -> list[tuple[str, str]]:
    """(path, class name) of the base run's training files that are still there, by its recorded data source:
    a class-folder tree's training split (the old classes it holds), or the source's training data."""
    d, classes = opened.cfg.data, list(opened.classes)
    try:
        if d.format == "folder" and not (opened.data_source or {}).get("split"):
            index = scan_split(Path(d.root).expanduser() / d.train_split)
        else:
            index = train_source(d, classes, opened.data_source).index
    except (DataTreeError, ConfigError, OSError, TypeError) as err:
        log.warning("incremental: the base run's training files cannot be read (%s): no exemplars from them", err)
        return []
    return [(str(Path(p).absolute()), index.classes[label]) for p, label in zip(index.paths, index.labels)
            if index.classes[label] in classes]


def recorded_counts(base_path: Path) -> Optional[dict]:
    """The per-class training file counts the base run's last.pt recorded (None: not there)."""
    last = base_path.parent / "last.pt"
    if not last.is_file():
        return None
    try:
        fingerprint = load_checkpoint(last).get("data_fingerprint") or {}
    except CheckpointError:
        return None
    counts = (fingerprint.get("train") or {}).get("classes")
    return counts if isinstance(counts, dict) else None


def say_changes(base_path: Path, candidates: list[tuple[str, str]]) -> None:
    recorded = recorded_counts(base_path)
    if recorded is None:
        return
    now: dict[str, int] = {}
    for _, label in candidates:
        now[label] = now.get(label, 0) + 1
    differ = [f"{c}: {recorded.get(c, 0)} -> {now.get(c, 0)}" for c in sorted(set(recorded) | set(now))
              if recorded.get(c, 0) != now.get(c, 0)]
    if differ:
        log.warning("incremental: the base run's training files changed since it trained (files per class: %s); "
                    "the exemplars are chosen from the files there now%s", ", ".join(differ[:10]),
                    "" if candidates else " (none: distillation alone)")


def herding(features: torch.Tensor, count: int) -> list[int]:
    """iCaRL's herding: rows picked one by one so that the mean of the picked rows stays nearest the class mean."""
    mean = features.mean(dim=0)
    picked: list[int] = []
    running = torch.zeros_like(mean)
    available = torch.ones(len(features), dtype=torch.bool)
    for k in range(1, min(count, len(features)) + 1):
        distance = ((mean - (running + features) / k) ** 2).sum(dim=1)
        distance[~available] = float("inf")
        best = int(distance.argmin())
        picked.append(best)
        available[best] = False
        running += features[best]
    return picked


def embeddings(model: torch.nn.Module, opened: ModelFile, paths: list[str], device: torch.device,
               batch_size: int, num_workers: int) -> tuple[torch.Tensor, list[int]]:
    """The base model's L2-normalised pre-logit features of `paths` (its eval preprocessing), and the positions
    of the readable ones (one row each)."""
    d = opened.cfg.data
    index = ImageIndex(Path("/"), ["_"], list(paths), [0] * len(paths))
    loader = build_eval_loader_for(index, eval_transform(d), eval_size(d), batch_size, num_workers, False)
    prepare = DeviceInput(device, tuple(d.mean), tuple(d.std), False, None)
    rows, kept = [], []
    with torch.no_grad():
        for images, _, valid, indices in loader:
            features, _ = features_and_logits(model, prepare.prepare(images))
            features = torch.nn.functional.normalize(features.float(), dim=1).cpu()
            rows.append(features[valid])
            kept.extend(int(i) for i in indices[valid])
    width = rows[0].shape[1] if rows else 1
    return (torch.cat(rows) if rows else torch.zeros(0, width)), kept


def choose_memory(opened: ModelFile, model: torch.nn.Module, base_path: Path, per_class: int,
                  device: torch.device, batch_size: int, num_workers: int) -> list[Exemplar]:
    """Up to `per_class` exemplars of each of the base's classes, by herding; in class order, then pick order."""
    classes = list(opened.classes)
    carried = carried_memory(base_path, classes)
    candidates = base_training_files(opened)
    say_changes(base_path, candidates + [(e.path, e.label) for e in carried])
    seen = {p for p, _ in candidates}
    candidates += [(e.path, e.label) for e in carried if e.path not in seen]
    chosen: list[Exemplar] = []
    for name in classes:
        paths = [p for p, label in candidates if label == name][:MAX_CANDIDATES]
        if not paths:
            continue
        features, kept = embeddings(model, opened, paths, device, batch_size, num_workers)
        for row in herding(features, per_class):
            path = paths[kept[row]]
            chosen.append(Exemplar(path, name, file_sha256(Path(path))))
    missing = [c for c in classes if not any(e.label == c for e in chosen)]
    if missing:
        log.warning("incremental: no exemplar for %d old class(es) (%s): their files are gone; those classes "
                    "are kept by distillation alone", len(missing), ", ".join(missing[:10]))
    return chosen
