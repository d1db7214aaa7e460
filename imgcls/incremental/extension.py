"""A class-incremental run's set-up (`incremental.base`, docs/incremental.md): the base checkpoint's classes
first, in their order, then the new data's other classes (sorted); a class name both old and new is an old
class with more images. The run takes the base's normalisation (its backbone was trained with it), its
training split gains the exemplar memory (`incremental.memory`), and a new run starts from the base's weights
with the new classes' head rows imprinted: each the new class's mean L2-normalised embedding under the base
model, scaled to the old rows' mean norm (Qi et al. 2018), with the old rows' mean bias.

The objective (distillation on the old classes, the old / new split of validation, weight aligning in best.pt)
is `objectives.incremental`."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

import imgcls.compute.distributed as dist_utils
import imgcls.data.sources.source_csv as source_csv
from imgcls.core.errors import ConfigError, DataTreeError
from imgcls.data.images import check_bad_fraction
from imgcls.data.labels import label_format
from imgcls.data.listing import ImageIndex, scan_split
from imgcls.data.sources import DataSources, scan_sources
from imgcls.incremental.memory import (MEMORY_FILE, Exemplar, changed, choose_memory, embeddings, read_memory,
                                       write_memory)
from imgcls.model_files.model_file import ModelFile
from imgcls.models.feature_tap import classifier_name
from imgcls.objectives.incremental import base_teacher, check_same_base_everywhere, checked_base

log = logging.getLogger(__name__)

# imprinting averages at most this many training images of each new class (the first in the split's order)
IMPRINT_IMAGES = 256


@dataclass
class Extension:
    base: ModelFile
    source: str
    memory: list[Exemplar]

    @property
    def old_classes(self) -> list[str]:
        return list(self.base.classes)

    def summary(self) -> dict:
        counts: dict[str, int] = {}
        for e in self.memory:
            counts[e.label] = counts.get(e.label, 0) + 1
        return {"memory": {"file": MEMORY_FILE, "exemplars": len(self.memory), "classes_with_exemplars": len(counts)}}


def with_base_normalisation(cfg, base: ModelFile):
    """`cfg` with the base's mean and std (said when the config named others)."""
    d, b = cfg.data, base.cfg.data
    if list(d.mean) != list(b.mean) or list(d.std) != list(b.std):
        log.info("incremental: data.mean / data.std are the base's (%s / %s): its backbone was trained with them",
                 list(b.mean), list(b.std))
    return dataclasses.replace(cfg, data=dataclasses.replace(d, mean=list(b.mean), std=list(b.std)))


def prepare_extension(cfg, run_dir: Path, runtime, resuming: bool) -> tuple[object, Extension]:
    """The resolved config (the base's normalisation) and the extension: on a new run rank 0 chooses the
    memory and writes memory.csv, which every rank trains on; a resumed run reads it back (refusing exemplars whose
    bytes changed). Every rank must have opened the same base file."""
    base = checked_base(cfg)
    check_same_base_everywhere(cfg.incremental.base, base)
    cfg = with_base_normalisation(cfg, base)
    c = cfg.incremental

    def memory() -> list[Exemplar]:
        listed = Path(run_dir) / MEMORY_FILE
        if resuming:
            exemplars = read_memory(listed) if listed.is_file() else []
            problems = changed(exemplars)
            if problems:
                raise ConfigError(f"--resume: exemplars in {listed} changed since the run started: "
                                  f"{'; '.join(problems[:5])}; the run cannot continue as it began (start a new one)")
            return exemplars
        exemplars = []
        if c.memory_per_class > 0:
            model = base_teacher(base, c.base, runtime.device).model
            exemplars = choose_memory(base, model, Path(c.base).expanduser(), c.memory_per_class, runtime.device,
                                      64, cfg.data.num_workers)
        write_memory(exemplars, Path(run_dir))
        log.info("incremental: %d exemplar(s) of %d old class(es) in %s", len(exemplars), len(base.classes), listed)
        return exemplars

    exemplars = dist_utils.run_on_main(runtime.dist.is_main, memory, share_result=True)
    return cfg, Extension(base, c.base, exemplars)


def union_classes(old: list[str], found: list[str]) -> list[str]:
    return list(old) + sorted(set(found) - set(old))


def relabelled(index: ImageIndex, classes: list[str], split: str) -> ImageIndex:
    """`index` labelled in `classes` (a superset of its own, in another order)."""
    unknown = sorted(set(index.classes) - set(classes))
    if unknown:
        raise DataTreeError(f"the {split} split holds classes neither the base nor the training split has: "
                            f"{', '.join(unknown[:10])}; every {split} class must be an old class or a new training "
                            f"class")
    position = {name: i for i, name in enumerate(classes)}
    return dataclasses.replace(index, classes=list(classes), labels=[position[index.classes[label]]
                                                                     for label in index.labels])


def with_exemplars(index: ImageIndex, memory: list[Exemplar]) -> ImageIndex:
    have = {str(Path(p).absolute()) for p in index.paths}
    added = [e for e in memory if e.path not in have]
    position = {name: i for i, name in enumerate(index.classes)}
    return dataclasses.replace(index, paths=list(index.paths) + [e.path for e in added],
                               labels=list(index.labels) + [position[e.label] for e in added])


def scan_extended(extension: Extension):
    """The data scan of an extension (build_run_data's `scan`): the splits labelled in the union of classes, the
    exemplars added to the training split. A class-folder tree's validation split may hold every class."""

    def scan(cfg) -> DataSources:
        d = cfg.data
        if d.format == "folder" and d.val_fraction is None and not d.classes:
            root = Path(d.root).expanduser()
            train, val = scan_split(root / d.train_split), scan_split(root / d.val_split)
            sources = DataSources(train, val, None, {"format": "folder"})
        elif d.format == "csv" and d.val_fraction is None and not d.classes:
            sources = scan_csv_lists(d, extension.old_classes)
        else:
            sources = scan_sources(cfg)
        classes = union_classes(extension.old_classes, sources.train_index.classes)
        train = with_exemplars(relabelled(sources.train_index, classes, "training"), extension.memory)
        return dataclasses.replace(sources, train_index=train,
                                   val_index=relabelled(sources.val_index, classes, "validation"))

    return scan


def scan_csv_lists(d, old: list[str]) -> DataSources:
    """data.format=csv: the training list's classes after the base's, and a validation list that may name
    every class (an old class need not be in the training list)."""
    rows = source_csv.read_list(d, d.train_csv)
    classes = union_classes(old, label_format(d).classes_of(rows, f"CSV list {d.train_csv}"))
    known_as = "the base's classes and the training list's labels"
    train, missing = label_format(d).csv_index(d.train_csv, source_csv.csv_base(d, d.train_csv), rows, classes,
                                               known_as)
    if missing:
        check_bad_fraction(missing, len(rows), f"training (missing, from {d.train_csv})", d.max_bad_fraction)
    val = source_csv.load_csv_list(d, d.val_csv, source_csv.read_list(d, d.val_csv), classes, known_as, "validation")
    digest = source_csv.index_digest
    identity = {"format": "csv", "train_csv_sha256": digest(train, source_csv.csv_base(d, d.train_csv)),
                "val_csv_sha256": digest(val, source_csv.csv_base(d, d.val_csv))}
    return DataSources(train, val, None, identity)


def initialise(model: torch.nn.Module, extension: Extension, train_index: ImageIndex, device: torch.device,
               num_workers: int) -> None:
    """A new run's starting weights: the base's, its head's rows for the old classes, imprinted rows for the new."""
    head = classifier_name(model)
    if head is None:
        raise ConfigError(f"'incremental.base' = {extension.source}: cannot find the classifier of "
                          f"{type(model).__name__}, so its rows cannot be extended")
    base_state = extension.base.state_dict
    own = model.state_dict()
    old = len(extension.old_classes)
    weights = {k: v for k, v in base_state.items() if k in own and own[k].shape == v.shape}
    for name in (f"{head}.weight", f"{head}.bias"):
        if name in base_state:
            merged = own[name].clone()
            merged[:old] = base_state[name]
            weights[name] = merged
    missing = sorted(set(own) - set(weights))
    if missing:
        raise ConfigError(f"'incremental.base' = {extension.source}: its weights do not fit this model: "
                          f"{', '.join(missing[:5])}")
    imprint(weights, head, extension, train_index, device, num_workers)
    model.load_state_dict(weights, strict=True)


def imprint(weights: dict, head: str, extension: Extension, train_index: ImageIndex, device: torch.device,
            num_workers: int) -> None:
    """The new rows of `weights`: each new class's normalised mean embedding x the old rows' mean norm; the
    old rows' mean bias."""
    old = len(extension.old_classes)
    weight = weights[f"{head}.weight"]
    if weight.shape[0] <= old:
        return
    model = base_teacher(extension.base, extension.source, device).model
    scale = weight[:old].float().flatten(1).norm(dim=1).mean()
    for label in range(old, weight.shape[0]):
        paths = [p for p, y in zip(train_index.paths, train_index.labels) if y == label][:IMPRINT_IMAGES]
        features, _ = embeddings(model, extension.base, paths, device, 64, num_workers)
        if len(features):
            mean = torch.nn.functional.normalize(features.mean(dim=0), dim=0)
            weight[label] = (mean * scale).to(weight.dtype).view_as(weight[label])
    bias = weights.get(f"{head}.bias")
    if bias is not None:
        bias[old:] = bias[:old].mean()
    log.info("incremental: %d new head row(s) imprinted from the new classes' mean embeddings", weight.shape[0] - old)

