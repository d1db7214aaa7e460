"""Data sources: the `data.val_fraction` split of one folder (stratified, seeded, stable, recorded, reproduced by
eval.py, held to on resume), CSV lists (labels by name, missing files counted and limited, mistakes exit 2
naming the row or column, rows outside the root or repeated warned) and the files the data keys name (never a
FIFO or a folder)."""
from __future__ import annotations

import csv
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import class_image, make_tree, run_script, tiny_overrides

from imgcls.config import ConfigError, load_config, resume_free_keys
from imgcls.core.errors import BadDataError, DataTreeError
from imgcls.data.datasets import expand_inputs
from imgcls.data.listing import ImageIndex, held_out_count, split_index
from imgcls.data.settings import check_data_root
from imgcls.data.sources import scan_sources

METRIC_KEYS = ("top1", "top5", "loss", "mean_class_acc", "num_samples")


def fake_index(root: Path, counts: dict) -> ImageIndex:
    """An index of paths that need not exist (the split reads names only)."""
    classes = sorted(counts)
    paths, labels = [], []
    for label, name in enumerate(classes):
        paths += [str(root / name / f"{name}_{i:03d}.jpg") for i in range(counts[name])]
        labels += [label] * counts[name]
    return ImageIndex(root, classes, paths, labels)


@pytest.mark.parametrize("n, fraction, held", [(1, 0.5, 0), (2, 0.01, 1), (2, 0.99, 1), (10, 0.25, 3),
                                               (7, 0.25, 2), (100, 0.1, 10), (3, 0.5, 2)])
def test_each_class_keeps_an_image_on_each_side_where_it_has_two(n, fraction, held):
    assert held_out_count(n, fraction) == held


def test_split_is_stratified_seeded_and_the_same_on_every_machine(tmp_path):
    counts = {"ant": 10, "bee": 7, "cat": 2, "dog": 1}
    train, val, record = split_index(fake_index(Path("/data/x"), counts), Path("/data/x"), 0.25, seed=0)
    assert val.class_counts() == [3, 2, 1, 0] and train.class_counts() == [7, 5, 1, 1]
    assert sorted(train.paths + val.paths) == sorted(fake_index(Path("/data/x"), counts).paths)
    # Pinned: a pure function of (seed, relative path), so these names hold on any machine, Python or torch.
    assert record.val == ["ant/ant_002.jpg", "ant/ant_005.jpg", "ant/ant_007.jpg", "bee/bee_003.jpg",
                          "bee/bee_006.jpg", "cat/cat_000.jpg"]
    # another copy of the data elsewhere: the same split
    assert split_index(fake_index(tmp_path, counts), tmp_path, 0.25, seed=0)[2].val == record.val
    other_seed = split_index(fake_index(Path("/data/x"), counts), Path("/data/x"), 0.25, seed=1)[2]
    assert other_seed.val != record.val and len(other_seed.val) == len(record.val)
    # a new image of one class moves no file of another class
    grown = split_index(fake_index(Path("/data/x"), {**counts, "ant": 11}), Path("/data/x"), 0.25, seed=0)[2]
    assert [k for k in grown.val if not k.startswith("ant/")] == [k for k in record.val if not k.startswith("ant/")]


@pytest.fixture(scope="module")
def split_run(tmp_path_factory):
    """One unsplit class-folder tree trained with data.val_fraction=0.25; class 'c' has a single image."""
    base = tmp_path_factory.mktemp("split")
    data = make_tree(base / "data", {"a": 12, "b": 11, "c": 1}, splits=("",))
    run_dir = base / "run"
    result = run_script("train.py", "--config", "base", *tiny_overrides(data, run_dir, **{
        "data.val_fraction": 0.25, "data.split_seed": 3, "train.batch_size": 4}))
    assert result.returncode == 0, result.stderr[-3000:]
    return data, run_dir


def read_list(path: Path) -> list[tuple[str, str]]:
    with path.open() as f:
        return [(row["path"], row["label"]) for row in csv.DictReader(f)]


@pytest.mark.slow
def test_split_is_written_recorded_and_eval_reproduces_best_on_the_held_out_files(split_run, tmp_path):
    data, run_dir = split_run
    val, train = read_list(run_dir / "split_val.csv"), read_list(run_dir / "split_train.csv")
    assert [label for _, label in val].count("a") == 3 and [label for _, label in val].count("b") == 3
    assert ("c/c_0000.png", "c") in train and len(train) == 18
    assert "single image, kept for training and absent from validation: c" in (run_dir / "train.log").read_text()
    best = torch.load(run_dir / "best.pt", weights_only=True)
    assert best["data_source"]["split"]["val"] == [path for path, _ in val]
    assert best["data_source"]["split"]["train"] == [path for path, _ in train]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best"]["num_samples"] == 6
    # eval.py on best.pt: exactly the held-out files, exactly training's numbers, also from a moved copy
    moved = tmp_path / "moved"
    shutil.copytree(data, moved)
    (moved / "a" / "a_9999.png").write_bytes((data / "a" / "a_0000.png").read_bytes())  # a new file: not evaluated
    report = tmp_path / "eval.json"
    result = run_script("eval.py", "--checkpoint", str(run_dir / "best.pt"), "--data", str(moved),
                        "--json", str(report))
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(report.read_text())
    assert {k: doc[k] for k in METRIC_KEYS} == summary["best"]
    assert doc["split"] == "held_out" and "held out by data.val_fraction=0.25" in result.stdout


@pytest.mark.slow
def test_resume_refuses_another_split(split_run, tmp_path):
    data, run_dir = split_run
    run_copy = tmp_path / "run"
    shutil.copytree(run_dir, run_copy)
    grown = tmp_path / "data"
    shutil.copytree(data, grown)
    class_image(1).save(grown / "b" / "b_0100.png")
    args = tiny_overrides(grown, run_copy, **{"data.val_fraction": 0.25, "data.split_seed": 3,
                                               "train.batch_size": 4, "train.epochs": 3})
    result = run_script("train.py", "--config", "base", *args, "--resume", "auto")
    assert result.returncode == 2
    assert ("data split (data.val_fraction): other files on each side (18 train / 6 val files -> 19 train"
            in result.stderr)
    # another seed is refused as a config difference (data.split_seed is not resume-free)
    assert "data.split_seed" not in resume_free_keys()


# ---------------------------------------------------------------- CSV lists


def write_csv(path: Path, rows: list, header=("path", "label")) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        if header:
            writer.writerow(header)
        writer.writerows(rows)
    return path


@pytest.fixture(scope="module")
def csv_data(tmp_path_factory) -> Path:
    """images/ (flat, names unrelated to classes) + train.csv and val.csv naming classes 'cat', 'dog', 'owl'."""
    root = tmp_path_factory.mktemp("csv") / "data"
    (root / "images").mkdir(parents=True)
    rows = {"train": [], "val": []}
    for label, name in enumerate(("cat", "dog", "owl")):
        for i in range(16):
            file = f"images/{i:03d}_{label}.png"
            class_image(label).save(root / file)
            rows["train" if i < 12 else "val"].append((file, name))
    write_csv(root / "train.csv", rows["train"])
    write_csv(root / "val.csv", rows["val"])
    return root


def csv_cfg(root: Path, **extra):
    values = {"data.format": "csv", "data.root": str(root), "data.train_csv": str(root / "train.csv"),
              "data.val_csv": str(root / "val.csv"), **extra}
    return load_config("base", [f"{k}={v}" for k, v in values.items()])


def test_csv_lists_label_by_name_and_split_like_a_folder(csv_data):
    sources = scan_sources(csv_cfg(csv_data))
    assert sources.classes == ["cat", "dog", "owl"]
    assert sources.train_index.class_counts() == [12, 12, 12] and len(sources.val_index) == 12
    assert sources.train_index.paths[0] == str(csv_data / "images/000_0.png")
    split = scan_sources(csv_cfg(csv_data, **{"data.val_csv": "null", "data.val_fraction": 0.25}))
    assert split.val_index.class_counts() == [3, 3, 3] and split.identity["split"]["val"][0].startswith("images/")
    (csv_data / "classes.txt").write_text("owl\ncat\ndog\n")
    ordered = scan_sources(csv_cfg(csv_data, **{"data.classes": str(csv_data / "classes.txt")}))
    assert ordered.classes == ["owl", "cat", "dog"] and ordered.train_index.labels[0] == 1


@pytest.mark.parametrize("rows, header, extra, message", [
    ([], None, {}, "is empty: expected a header row"),
    ([], ("path", "label"), {}, "has a header but no rows"),
    ([("images/000_0.png", "cat")], ("file", "label"), {},
     "no column 'path' (data.csv_path_column); the header has: file, label"),
    ([("images/000_0.png", "cat")], ("path", "label"), {"data.csv_label_column": "klass"},
     "no column 'klass' (data.csv_label_column)"),
    ([("images/000_0.png", "cat"), ("images/001_0.png", "")], ("path", "label"), {}, "line 3: empty 'label'"),
    ([("images/000_0.png", "cat"), ("images/000_1.png", "dog"), ("images/000_2.png", "emu")], ("path", "label"), {},
     "line 4: label 'emu' is not one of the labels of the training list (cat, dog, owl)"),
    ([("images/000_0.png", "cat"), ("images/x", "y.png", "cat")], ("path", "label"), {},  # an unquoted comma
     "line 3: 3 field(s), the header has 2 (a path or label holding a comma must be quoted"),
])
def test_csv_mistakes_are_data_errors_naming_the_row_or_column(csv_data, tmp_path, rows, header, extra, message):
    bad = write_csv(tmp_path / "val.csv", rows, header)
    with pytest.raises(DataTreeError) as err:
        scan_sources(csv_cfg(csv_data, **{"data.val_csv": str(bad), **extra}))
    assert message in str(err.value) and str(err.value).startswith("CSV list ")


def test_csv_config_mistakes_exit_2(csv_data):
    with pytest.raises(ConfigError, match="needs 'data.val_csv', or 'data.val_fraction'"):
        csv_cfg(csv_data, **{"data.val_csv": "null"})
    with pytest.raises(ConfigError, match="both set"):
        csv_cfg(csv_data, **{"data.val_fraction": 0.2})
    with pytest.raises(ConfigError, match="'data.val_fraction' = 1.0 is out of range; it must be > 0.0 and < 1.0"):
        load_config("base", ["data.val_fraction=1.0"])


def test_each_registered_source_declares_its_keys_and_no_key_twice():
    """data.format's values are the sources data/sources/__init__.py registers; each source's keys come from its own
    settings class, and a key of another source set away from its default is refused."""
    import dataclasses

    from imgcls.data.settings import SOURCE_FORMATS, SOURCE_KEYS, DataConfig
    from imgcls.data.sources import SOURCES

    assert list(SOURCES) == list(SOURCE_FORMATS)
    names = [f.name for f in dataclasses.fields(DataConfig)]
    assert len(names) == len(set(names))
    for keys in SOURCE_KEYS:
        assert {f.name for f in dataclasses.fields(keys)} <= set(names)
    with pytest.raises(ConfigError, match="'data.train_shards' / 'data.val_shards' are set but 'data.format' = csv"):
        load_config("base", ["data.format=csv", "data.train_csv=t.csv", "data.val_fraction=0.2",
                             "data.train_shards=s.tar"])


@pytest.mark.slow
def test_missing_files_are_counted_and_above_the_limit_stop_before_training(csv_data, tmp_path):
    rows = read_list(csv_data / "train.csv") + [(f"images/gone_{i}.png", "cat") for i in range(2)]
    listed = write_csv(tmp_path / "train.csv", rows)
    sources = scan_sources(csv_cfg(csv_data, **{"data.train_csv": str(listed), "data.max_bad_fraction": 0.1}))
    assert len(sources.train_index) == 36  # 2 of 38 missing: left out
    with pytest.raises(BadDataError, match="2 of 38 training"):
        scan_sources(csv_cfg(csv_data, **{"data.train_csv": str(listed)}))
    run_dir = tmp_path / "run"
    result = run_script("train.py", "--config", "base", *tiny_overrides(csv_data, run_dir, **{
        "data.format": "csv", "data.train_csv": str(listed), "data.val_csv": str(csv_data / "val.csv")}))
    assert result.returncode == 1, result.stderr[-3000:]
    assert "2 of 38 training (missing" in result.stderr and "gone_1.png" in result.stderr
    assert "Traceback" not in result.stderr and not (run_dir / "last.pt").exists()
    # a val label that training lacks, through train.py: exit 2 naming the row
    odd = write_csv(tmp_path / "val.csv", [("images/000_0.png", "cat"), ("images/000_1.png", "yak")])
    result = run_script("train.py", "--config", "base", *tiny_overrides(csv_data, run_dir, **{
        "data.format": "csv", "data.train_csv": str(csv_data / "train.csv"), "data.val_csv": str(odd)}))
    assert result.returncode == 2 and "line 3: label 'yak'" in result.stderr


@pytest.mark.slow
def test_training_from_csv_lists_and_eval_on_best_and_on_a_csv(csv_data, tmp_path):
    run_dir = tmp_path / "run"
    result = run_script("train.py", "--config", "base", *tiny_overrides(csv_data, run_dir, **{
        "data.format": "csv", "data.train_csv": str(csv_data / "train.csv"), "data.val_csv": str(csv_data / "val.csv"),
        "train.epochs": 1}))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["best"]["num_samples"] == 12
    best = torch.load(run_dir / "best.pt", weights_only=True)
    assert best["classes"] == ["cat", "dog", "owl"] and best["data_source"]["format"] == "csv"
    for extra in ([], ["--data", str(csv_data / "val.csv")]):
        report = tmp_path / "eval.json"
        result = run_script("eval.py", "--checkpoint", str(run_dir / "best.pt"), *extra, "--json", str(report))
        assert result.returncode == 0, result.stderr[-3000:]
        assert {k: json.loads(report.read_text())[k] for k in METRIC_KEYS} == summary["best"]


@pytest.mark.parametrize("sampler", ["random", "weighted"])
def test_a_csv_class_whose_files_are_all_missing_exits_2_naming_it(csv_data, tmp_path, sampler):
    listed = write_csv(tmp_path / "train.csv", read_list(csv_data / "train.csv") + [("images/ghost/1.png", "ghost")])
    with pytest.raises(DataTreeError, match="class\\(es\\) with no existing image file: ghost"):
        scan_sources(csv_cfg(csv_data, **{"data.train_csv": str(listed), "data.sampler": sampler,
                                          "data.max_bad_fraction": 0.5}))


def test_csv_rows_leaving_the_root_and_repeated_rows_are_warned_with_counts(csv_data, tmp_path, caplog):
    rows = read_list(csv_data / "train.csv")  # 36 rows: lines 2-37
    outside = (str(csv_data / rows[0][0]), rows[0][1])  # absolute, but inside data.root
    class_image(1).save(csv_data.parent / "loose.png")
    climbing = ("../loose.png", "dog")
    listed = write_csv(tmp_path / "train.csv", rows + [outside, climbing, rows[2]])
    with caplog.at_level(logging.WARNING):
        sources = scan_sources(csv_cfg(csv_data, **{"data.train_csv": str(listed)}))
    assert len(sources.train_index) == 39
    assert "1 row(s) name files outside" in caplog.text and "line 39 '../loose.png'" in caplog.text
    assert "2 row(s) repeat a path listed before" in caplog.text and "line 38" in caplog.text


def test_infer_inputs_take_a_csv_lists_paths(csv_data):
    # infer.py's inputs: a CSV list stands for the files of its path column (relative to the CSV's folder)
    listed = [str(csv_data / path) for path, _ in read_list(csv_data / "val.csv")]
    assert expand_inputs([str(csv_data / "val.csv"), str(csv_data / "images" / "000_0.png")]) == listed + [
        str(csv_data / "images" / "000_0.png")]


def test_a_val_fraction_split_with_no_validation_image_exits_2_before_training(tmp_path):
    """One image per class stays in training: the split held out nothing and a full run trained before the
    empty validation failed it."""
    data = make_tree(tmp_path / "data", {"a": 1, "b": 1, "c": 1}, splits=("all",)) / "all"
    cfg = load_config("base", [f"data.root={data}", "data.val_fraction=0.2"])
    with pytest.raises(DataTreeError, match="data.val_fraction=0.2: .*validation side empty"):
        scan_sources(cfg)


# ---------------------------------------------------------------- files the config names

@pytest.mark.parametrize("fmt", ["folder", "csv", "webdataset"])
def test_a_fifo_named_by_a_data_key_exits_2_saying_it_is_a_fifo(three_class_jpegs, tmp_path, fmt):
    """data.classes on a FIFO hung for ever; data.train_csv on a FIFO said 'no such file'."""
    tree = three_class_jpegs
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    values = {"folder": {"data.root": tree, "data.classes": fifo},
              "csv": {"data.format": "csv", "data.root": tree, "data.train_csv": fifo, "data.val_fraction": 0.5},
              "webdataset": {"data.format": "webdataset", "data.root": "null", "data.classes": fifo,
                             "data.train_shards": "x.tar", "data.val_shards": "y.tar"}}[fmt]
    cfg = load_config("base", [f"{k}={v}" for k, v in values.items()])
    key = "data.train_csv" if fmt == "csv" else "data.classes"
    with pytest.raises(ConfigError, match=f"'{key}' = {fifo}: a named pipe \\(FIFO\\); it must name a regular file"):
        check_data_root(cfg)
    with pytest.raises(DataTreeError, match="a named pipe"):  # and the readers themselves never open one
        scan_sources(cfg)


def test_a_folder_named_as_the_class_list_says_so(three_class_jpegs):
    cfg = load_config("base", [f"data.root={three_class_jpegs}", f"data.classes={three_class_jpegs}"])
    with pytest.raises(ConfigError, match="a folder; it must name a regular file"):
        check_data_root(cfg)


def test_webdataset_with_a_missing_root_does_not_speak_of_csv_lists(tmp_path):
    classes = tmp_path / "classes.txt"
    classes.write_text("a\nb\n")
    cfg = load_config("base", ["data.format=webdataset", f"data.root={tmp_path / 'nope'}", f"data.classes={classes}",
                               "data.train_shards=x.tar", "data.val_shards=y.tar"])
    with pytest.raises(ConfigError) as err:
        check_data_root(cfg)
    assert "no such folder" in str(err.value) and "CSV" not in str(err.value)
    fifo = tmp_path / "root"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="'data.root' = .*: not a folder \\(a named pipe \\(FIFO\\)\\)"):
        check_data_root(load_config("base", [f"data.root={fifo}"]))
