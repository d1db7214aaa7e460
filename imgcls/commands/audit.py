"""audit.py's work: the data audit and its argument checks.

audit.py's usage checks, torch-free: a mistake exits 2 before torch is imported or any work starts.

audit.py's work: list the data as training reads it, hash every image in loader workers, find the
duplicates, leaks and likely label errors (and, with data.unlabeled, its copies of held-out images), summarise
balance and shape, and write the JSON, the HTML page and the clean training list. Nothing under the data root is
written."""
from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import imgcls.auditing.report as stats_mod
from imgcls.auditing.audit_data import UNLABELED_SPLIT, read_audit_data, unlabeled_items
from imgcls.auditing.duplicates import (by_split, clean_training_names, compute_facts, find_copies, grayscale_outliers,
                                        hash_view_words)
from imgcls.auditing.folds import (align_classes, check_same_classes, copy_keys, cross_validated_probs,
                                   find_label_issues, open_model, predict_probs, unseen_by_checkpoint)
from imgcls.auditing.outliers import find_outliers, merge_outliers, outliers_summary
from imgcls.auditing.report import render
from imgcls.core.errors import ConfigError
from imgcls.core.files import write_json
from imgcls.data.transforms import reads_bands
from imgcls.tasks import task_of
from imgcls.training.optim import check_optimizer


def check_checkpoint_task(model_task, data_task, checkpoint: str) -> None:
    """--checkpoint's model must be of the data's task (tasks.Task): a multi-label (sigmoid) model's scores are
    no class distribution for the single-label label-error search (it named 18 'label errors' from one)."""
    if model_task.name != data_task.name:
        raise ConfigError(f"--checkpoint {checkpoint}: a {model_task.title} model, but the data is "
                          f"{data_task.title} (data.task); pass a model trained on this task, or --folds K")

log = logging.getLogger("audit")


LABELLED_SPLITS = ("train", "val")


class Progress:
    """A tqdm bar on stderr for a long phase (output.progress_bar: auto shows it on a terminal)."""

    def __init__(self, cfg, total: int, what: str):
        from tqdm import tqdm

        setting = cfg.output.progress_bar
        show = sys.stderr.isatty() if setting == "auto" else bool(setting)
        self.bar = tqdm(total=total, desc=what, unit="img" if what == "hashing" else "fold", disable=not show,
                        file=sys.stderr, leave=False)

    def __call__(self, n: int = 1) -> None:
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()


def label_search(cfg, data, facts, checkpoint: Optional[str], opened, work: Path, copies: tuple = ([], [], [])
                 ) -> tuple[list[dict], Optional[str], str, float, Optional[list]]:
    """(label issues named, their source, a note for the reader, seconds, the out-of-distribution images found
    by the fold models: None when not searched). `copies`: find_copies' (duplicates, leaks, conflicts), whose
    near copies share a fold."""
    started = time.perf_counter()
    if not task_of(cfg).supports("label errors"):
        return [], None, ("not searched: the label-error search (cleanlab on out-of-sample class probabilities) "
                          "is for single-label data; duplicates, leaks, unreadable files and the tag counts are "
                          "checked"), 0.0, None
    pool = [i for i, (item, f) in enumerate(zip(data.items, facts))
            if f.error is None and item.split in LABELLED_SPLITS]
    outliers = None
    if checkpoint:
        loaded, model, device, amp = opened
        unseen = unseen_by_checkpoint([data.items[i].name for i in pool], [data.items[i].split for i in pool],
                                      loaded.data_source)
        pool = [i for i, keep in zip(pool, unseen) if keep]
        bs = loaded.cfg.train.batch_size if isinstance(loaded.cfg.train.batch_size, int) else 64
        probs, _ = predict_probs(model, loaded.cfg, [data.items[i].file for i in pool], bs, cfg.data.num_workers,
                                 device, amp, len(loaded.classes))
        probs = align_classes(probs, loaded.classes, data.classes)
        source = f"checkpoint {checkpoint}"
        note = (f"predictions of {checkpoint} on the {len(pool)} images it did not train on; a model's predictions "
                f"on its own training images hide their label errors, so those are not searched")
    else:
        folds, epochs = cfg.audit.folds, cfg.audit.fold_epochs or cfg.train.epochs
        import torch

        bar = Progress(cfg, folds, "folds")
        z = torch.full((len(pool),), float("nan"))
        keys = copy_keys([data.items[i].name for i in pool], [facts[i].sha256 for i in pool], copies[0], copies[1])
        probs = cross_validated_probs(cfg, [data.items[i].file for i in pool], [data.items[i].label for i in pool],
                                      keys, data.classes, work, folds, epochs, on_fold=lambda _: bar(), outlier_z=z)
        bar.close()
        outliers = find_outliers([data.items[i].name for i in pool], [data.items[i].split for i in pool],
                                 [data.classes[data.items[i].label] for i in pool], z)
        source = f"{folds}-fold cross-validation, {epochs} epoch(s) per fold"
        note = (f"out-of-sample predictions for the {len(pool)} training and validation images: each from a "
                f"{cfg.model.name} trained {epochs} epoch(s) on the other {folds - 1} fold(s)")
    checked = probs.isfinite().all(dim=1)  # not a class of copies of one image, which no fold held out
    if not bool(checked.all()):
        note += (f"; {int((~checked).sum())} image(s) not checked: every image of their class is a copy of one "
                 f"image, which no fold can hold out from its own training")
    pool, probs = [i for i, keep in zip(pool, checked.tolist()) if keep], probs[checked]
    issues = find_label_issues([data.items[i].label for i in pool], probs.numpy())
    named = [{"path": data.items[pool[x["position"]]].name, "split": data.items[pool[x["position"]]].split,
              "given": data.classes[x["given"]], "suggested": data.classes[x["suggested"]], "score": x["score"],
              "rule": x["rule"]}
             for x in issues]
    return named, source, note, time.perf_counter() - started, outliers


def grayscale_of(cfg, data, facts) -> list[dict]:
    """auditing.duplicates's grayscale images among colour ones, of the readable single-label images."""
    rows = [(item, f) for item, f in zip(data.items, facts) if f.error is None and not isinstance(item.label, tuple)]
    return grayscale_outliers([i.name for i, _ in rows], [i.split for i, _ in rows],
                              [data.classes[i.label] for i, _ in rows], [f.chroma for _, f in rows])


def summary_lines(report: dict) -> list[str]:
    leaks, dups, issues = report["leaks"], report["duplicates"], report["label_issues"]
    conflicts = report["label_conflicts"]
    lines = [f"{len(leaks)} leak group(s) across splits ({sum(g['count'] for g in leaks)} images)"
             + (": the same image in training and validation makes the validation accuracy a lie; remove one "
                "copy (--write-clean-csv drops the training side)" if leaks else ""),
             f"{len(dups)} duplicate group(s) inside splits ({sum(len(g['paths']) - 1 for g in dups)} extra copies)",
             f"{len(conflicts)} label conflict(s)" + (": copies of one image filed under different labels; decide "
                                                       "each one's label (--write-clean-csv leaves them out)"
                                                       if conflicts else ""),
             f"{len(issues)} likely label error(s)" + (f" ({report['label_issues_source']}); check the first ones "
                                                       f"and fix their labels" if issues else
                                                       "" if report["label_issues_source"] else
                                                       " (not searched: --folds 0 and no --checkpoint)"),
             f"{len(report['unreadable'])} unreadable file(s)"]
    return lines


def copies_of(cfg, data, facts) -> tuple[list[dict], list[dict], list[dict]]:
    """find_copies' (duplicates, leaks, label conflicts) of the readable images."""
    return find_copies(data.items, facts, by_split(data.items, facts), cfg.audit.near_threshold,
                       cfg.audit.pixel_threshold, lambda item: label_text(cfg, data, item.label))


HELD_OUT_SPLITS = ("val", "test")


def unlabeled_copies(cfg, data, facts, extra) -> dict:
    """data.unlabeled's copies of held-out (validation, test) images, found as leaks between splits are (one
    grouping, the same near_threshold and pixel check): {"source", "images", "leaks", "copies", "unreadable"}."""
    bar = Progress(cfg, len(extra), "hashing unlabelled")
    extra_facts = compute_facts([item.file for item in extra], cfg.data.num_workers, bar, cfg.data.channels,
                                cfg.data.value_range)
    bar.close()
    held_out = [i for i, item in enumerate(data.items) if item.split in HELD_OUT_SPLITS]
    items, all_facts = [data.items[i] for i in held_out] + extra, [facts[i] for i in held_out] + extra_facts
    _, leaks, _ = find_copies(items, all_facts, by_split(items, all_facts), cfg.audit.near_threshold,
                              cfg.audit.pixel_threshold, lambda item: "")
    leaks = [leak for leak in leaks if UNLABELED_SPLIT in leak["splits"] and len(leak["splits"]) > 1]
    unreadable = [{"path": item.name, "split": UNLABELED_SPLIT, "reason": f.error.replace(item.file, item.name)}
                  for item, f in zip(extra, extra_facts) if f.error is not None]
    return {"source": cfg.data.unlabeled, "images": len(extra), "leaks": leaks,
            "copies": sum(len(leak[UNLABELED_SPLIT]) for leak in leaks), "unreadable": unreadable}


def unlabeled_summary(section: dict) -> str:
    copies = section["copies"]
    n = sum(len(leak[split]) for leak in section["leaks"] for split in HELD_OUT_SPLITS if split in leak)
    return (f"{copies} unlabelled image(s) of {section['images']} (data.unlabeled) are copies of {n} held-out "
            f"image(s)" + (": semi-supervised training would learn their pseudo-labels, which inflates the "
                          "validation accuracy; remove them from data.unlabeled" if copies else "")
            + f"; {len(section['unreadable'])} unlabelled file(s) unreadable")


def build_report(cfg, data, facts, extra_unreadable, issues, source, note, timings, copies=None) -> dict:
    splits = by_split(data.items, facts)
    threshold = cfg.audit.near_threshold
    duplicates, leaks, conflicts = copies if copies is not None else copies_of(cfg, data, facts)
    unreadable = data.unreadable + extra_unreadable
    labels_by_split: dict[str, list[int]] = {}
    for item in data.items:
        labels_by_split.setdefault(item.split, []).append(item.label)
    counts = stats_mod.class_counts(labels_by_split, data.classes)
    balance = stats_mod.balance(counts["train"], cfg.audit.min_class_images)
    readable = [i for positions in splits.values() for i in positions]
    image_stats = stats_mod.image_stats([(facts[i].width, facts[i].height) for i in readable],
                                        [facts[i].mode for i in readable], [facts[i].format for i in readable],
                                        [data.items[i].name for i in readable], cfg.data.img_size)
    report = {"unreadable": [u["path"] for u in unreadable], "unreadable_details": unreadable,
              "duplicates": duplicates, "leaks": leaks, "label_conflicts": conflicts, "label_issues": issues, "label_issues_source": source,
              "label_issues_note": note, "class_counts": counts, "balance": balance, "image_stats": image_stats,
              "near_threshold": threshold, "pixel_threshold": cfg.audit.pixel_threshold, "classes": data.classes,
              "timings": timings, "hash_view": hash_view_words(cfg.data.channels, cfg.data.value_range)}
    report["advice"] = stats_mod.advice(balance, image_stats, cfg.data.img_size)
    report["summary"] = summary_lines(report)
    if reads_bands(cfg.data.channels, cfg.data.value_range):
        report["summary"].append(f"hashes and thumbnails: {report['hash_view']}")
    return report


def write_text_atomic(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def label_text(cfg, data, label) -> str:
    """A label as the lists write it: the class name, or (multi-label) the tags joined by data.label_delimiter."""
    if isinstance(label, tuple):
        return cfg.data.label_delimiter.join(data.classes[c] for c in label)
    return data.classes[label]


def emptied_classes(data, facts, kept) -> list[str]:
    """Classes with readable training images of which the clean list keeps none."""
    def tags(label):
        return set(label) if isinstance(label, tuple) else {label}

    had = set().union(*[tags(item.label) for item, f in zip(data.items, facts)
                        if item.split == "train" and f.error is None] or [set()])
    left = set().union(*[tags(item.label) for item in kept] or [set()])
    return [data.classes[c] for c in sorted(had - left)]


def clean_csv_text(cfg, data, facts, report: dict) -> tuple[str, int, list[str]]:
    """(the CSV text, rows kept, the classes it leaves without a training image)."""
    import csv
    import io

    dropped = [i["path"] for i in report["label_issues"] if i["split"] == "train"][:cfg.audit.drop_label_issues]
    kept = clean_training_names(data.items, facts, report["duplicates"], report["leaks"], dropped,
                                report["label_conflicts"])
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["path", "label"])
    # relative to data.root when there is one (use the list with the same data.root), else absolute paths
    writer.writerows((item.name if cfg.data.root else os.path.abspath(item.file), label_text(cfg, data, item.label))
                     for item in kept)
    return buf.getvalue(), len(kept), emptied_classes(data, facts, kept)


def run_audit(cfg, checkpoint: Optional[str] = None, json_path: Optional[str] = None,
              html_path: Optional[str] = None, clean_csv: Optional[str] = None) -> int:
    if not checkpoint and cfg.audit.folds:  # the folds train: their optimizer is checked before the hashing
        check_optimizer(cfg.optim)
    from imgcls.data.build import prepare_root

    prepare_root(cfg)
    bad_limit = cfg.data.max_bad_fraction
    cfg.data.max_bad_fraction = 1.0  # the audit lists every unreadable file where training would stop at the limit
    with tempfile.TemporaryDirectory(prefix="imgcls-audit-") as scratch:
        work = Path(scratch)
        data = read_audit_data(cfg, work / "samples")
        extra = unlabeled_items(cfg.data, work / "unlabeled") if cfg.data.unlabeled else None
        opened = None
        if checkpoint:  # a file that is no model, or a model of other classes: exit 2 before the hashing
            opened = open_model(Path(checkpoint), cfg.train.device)
            check_checkpoint_task(opened[0].task, task_of(cfg), checkpoint)
            check_same_classes(opened[0].classes, data.classes)
        bar = Progress(cfg, len(data.items), "hashing")
        started = time.perf_counter()
        facts = compute_facts([item.file for item in data.items], cfg.data.num_workers, bar, cfg.data.channels,
                              cfg.data.value_range)
        bar.close()
        hashing_s = time.perf_counter() - started
        failed = [{"path": item.name, "split": item.split, "reason": f.error.replace(item.file, item.name)}
                  for item, f in zip(data.items, facts) if f.error is not None]
        readable = len(data.items) - len(failed)
        issues, source, note, label_s, outliers = [], None, "", 0.0, None
        copies = copies_of(cfg, data, facts)
        if readable and (checkpoint or cfg.audit.folds >= 2):
            issues, source, note, label_s, outliers = label_search(cfg, data, facts, checkpoint, opened, work,
                                                                   copies)
        timings = {"images": len(data.items), "hashing_s": round(hashing_s, 3),
                   "hashing_images_per_s": round(len(data.items) / max(hashing_s, 1e-9), 1),
                   "label_search_s": round(label_s, 3), "loader_workers": cfg.data.num_workers}
        report = build_report(cfg, data, facts, failed, issues, source, note, timings, copies)
        report["outliers"] = merge_outliers(outliers, grayscale_of(cfg, data, facts))
        # the merged list, as the JSON and the HTML section list it: grayscale rows are found without a model
        report["summary"].append(outliers_summary(report["outliers"], searched=outliers is not None))
        if extra is not None:
            report["unlabeled"] = unlabeled_copies(cfg, data, facts, extra)
            report["summary"].append(unlabeled_summary(report["unlabeled"]))
        if len(report["unreadable"]) > bad_limit * max(1, len(data.items) + len(data.unreadable)):
            report["advice"].insert(0, f"{len(report['unreadable'])} unreadable file(s) exceed "
                                       f"data.max_bad_fraction={bad_limit}: training would stop (exit 1); remove "
                                       f"or fix them (or use --write-clean-csv)")
        kept, emptied, text = None, [], None
        if clean_csv:
            text, kept, emptied = clean_csv_text(cfg, data, facts, report)
            report["clean_csv"] = {"path": clean_csv, "rows": kept, "classes_left_empty": emptied}
        write_json(report, json_path)
        if html_path:
            files = {item.name: item.file for item in data.items + (extra or [])}
            write_text_atomic(html_path, render(report, files, f"Data audit: {len(data.items)} images, "
                                                              f"{len(data.classes)} classes"))
        if clean_csv:
            write_text_atomic(clean_csv, text)
    print_summary(report, json_path, html_path, clean_csv, kept, cfg)
    if emptied:
        print(f"warning: {clean_csv} holds no training image of class(es) {', '.join(emptied)}: every one was a "
              f"leak, a copy or a label conflict; training on it would not know these classes", file=sys.stderr)
    if not readable:
        print("error: no image could be read", file=sys.stderr)
        return 1
    return 0


def print_summary(report: dict, json_path, html_path, clean_csv, kept: Optional[int], cfg) -> None:
    out = sys.stderr
    print("audit:", file=out)
    for line in report["summary"]:
        print(f"  {line}", file=out)
    for leak in report["leaks"][:5]:
        sides = "  ==  ".join(f"{s}: {', '.join(leak[s][:3])}{' ...' if len(leak[s]) > 3 else ''}"
                              for s in leak["splits"])
        print(f"    leak: {sides}  ({leak['count']} images, distance {leak['distance']})", file=out)
    for leak in report.get("unlabeled", {}).get("leaks", [])[:5]:
        sides = "  ==  ".join(f"{s}: {', '.join(leak[s][:3])}{' ...' if len(leak[s]) > 3 else ''}"
                              for s in leak["splits"])
        print(f"    unlabelled copy: {sides}  (distance {leak['distance']})", file=out)
    for conflict in report["label_conflicts"][:5]:
        pairs = ", ".join(f"{p} ({label})" for p, label in list(zip(conflict["paths"], conflict["labels"]))[:4])
        print(f"    conflict: {pairs}{' ...' if len(conflict['paths']) > 4 else ''}", file=out)
    for issue in report["label_issues"][:5]:
        print(f"    label: {issue['path']}  given {issue['given']}, suggested {issue['suggested']} "
              f"(p={issue['score']:.3f})", file=out)
    b = report["balance"]
    ratio = "n/a" if b["imbalance_ratio"] is None else f"{b['imbalance_ratio']:.1f}"
    print(f"  training images per class: {min(report['class_counts']['train'].values())}.."
          f"{max(report['class_counts']['train'].values())} (imbalance ratio {ratio})", file=out)
    for line in report["advice"]:
        print(f"  advice: {line}", file=out)
    written = [p for p in (json_path, html_path) if p]
    if written:
        print(f"  wrote {', '.join(written)}", file=out)
    if clean_csv:
        root = f" data.root={cfg.data.root}" if cfg.data.root else ""
        print(f"  wrote {clean_csv}: {kept} training images without the copies; train on it with "
              f"data.format=csv{root} data.train_csv={clean_csv} and the same validation data", file=out)
