"""Hostile inputs of the second adversarial sweep (issue 28): shard folders reused, damaged shards, CSV rows
that split or name nothing, files the config names that are FIFOs, file links across classes, non-finite
validations and model outputs, model files that disagree with themselves or are hostile, exports over
existing files, and the small tools' edge cases. Each test failed before its fix.
"""
from __future__ import annotations

import csv
import logging
import os
from pathlib import Path

import pytest

import data.shards as shards
from conftest import class_image, make_tree
from core.config import ConfigError, check_data_root, load_config
from core.errors import BadDataError, DataTreeError
from data.listing.folder import scan_split
from data.listing.sources import scan_sources


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """3 classes x 4 train / 2 val JPEGs, 16 px: the data of every test here that trains nothing."""
    return make_tree(tmp_path_factory.mktemp("h2") / "tree", {"a": (4, 2), "b": (4, 2), "c": (4, 2)}, size=(16, 16),
                     ext=".jpg")


def write_csv(path: Path, rows: list[list[str]], header=("path", "label")) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def tree_rows(tree: Path, split: str = "train") -> list[list[str]]:
    return [[str(p.relative_to(tree)), p.parent.name] for p in sorted((tree / split).glob("*/*.jpg"))]


# ---------------------------------------------------------------- bug 1, 8 (--to a file), 12: the shard writer

def test_shard_writer_refuses_a_folder_of_old_shards_and_overwrite_replaces_them_all(tree, tmp_path, capsys):
    """A second write into sh2 left old shards 2-7 beside the new 0-1, and a brace pattern trained on both."""
    out = tmp_path / "sh2"
    assert shards.main(["--from", str(tree / "train"), "--to", str(out), "--shard-size", "2"]) == 0
    assert len(list(out.glob("shard-*.tar"))) == 6
    with pytest.raises(ConfigError, match="not empty.*--overwrite"):
        shards.main(["--from", str(tree / "val"), "--to", str(out), "--shard-size", "4"])
    assert len(list(out.glob("shard-*.tar"))) == 6  # nothing touched
    capsys.readouterr()
    assert shards.main(["--from", str(tree / "val"), "--to", str(out), "--shard-size", "4", "--overwrite"]) == 0
    said = capsys.readouterr().out
    assert sorted(p.name for p in out.glob("shard-*.tar")) == ["shard-000000.tar", "shard-000001.tar"]
    assert "6 samples of 3 classes in 2 shard(s)" in said and "shard-000000.tar..shard-000001.tar" in said
    assert "removed the 7 file(s)" in said
    assert shards.count_samples(sorted(str(p) for p in out.glob("shard-*.tar"))) == [4, 2]
    # --overwrite replaces shards only, never a folder of other things
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="notes.txt"):
        shards.main(["--from", str(tree / "val"), "--to", str(out), "--overwrite"])
    assert (out / "notes.txt").read_text() == "mine"


def test_shard_writer_to_a_file_and_from_a_csv_of_missing_files_exit_2(tree, tmp_path):
    target = tmp_path / "file.tar"
    target.write_bytes(b"x")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        shards.main(["--from", str(tree / "train"), "--to", str(target)])
    ghosts = write_csv(tmp_path / "ghosts.csv", [[f"nowhere/{i}.jpg", "abcd"[i]] for i in range(4)])
    with pytest.raises(DataTreeError, match="none of its 4 row"):
        shards.main(["--from", str(ghosts), "--to", str(tmp_path / "out")])
    assert not list((tmp_path / "out").glob("*.tar"))


# ---------------------------------------------------------------- bug 11: a damaged shard

@pytest.fixture(scope="module")
def shard_set(tree, tmp_path_factory) -> Path:
    """12 samples in 3 shards of 4, then shard 1 cut at half its bytes."""
    out = tmp_path_factory.mktemp("shardset") / "sh"
    assert shards.main(["--from", str(tree / "train"), "--to", str(out), "--shard-size", "4"]) == 0
    cut = out / "shard-000001.tar"
    data = cut.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    return out


def test_a_cut_shard_is_named_and_counted_under_the_bad_file_policy(shard_set, caplog):
    """webdataset's reader stopped at the cut without a word: 24 samples cut at 50% counted as 14."""
    spec = str(shard_set / "shard-{000000..000002}.tar")
    assert shards.shard_damage(str(shard_set / "shard-000000.tar")) is None
    assert "cut short" in shards.shard_damage(str(shard_set / "shard-000001.tar"))
    with pytest.raises(BadDataError, match=r"(?s)in damaged shards, more than data.max_bad_fraction=0.01.*shard-000001.tar \(cut short"):
        shards.shard_index(spec, ["a", "b", "c"], None, "data.train_shards", 0.01)
    with caplog.at_level(logging.WARNING):
        index = shards.shard_index(spec, ["a", "b", "c"], None, "data.train_shards", 0.5)
    assert [Path(u).name for u in index.urls] == ["shard-000000.tar", "shard-000002.tar"] and index.total == 8
    assert "1 damaged shard(s) left out" in caplog.text and "shard-000001.tar: cut short" in caplog.text


# ---------------------------------------------------------------- bug 6 and the CSV weak spots

def csv_cfg(tree: Path, train_csv: Path, **extra):
    values = {"data.format": "csv", "data.root": str(tree), "data.train_csv": str(train_csv),
              "data.val_csv": str(write_csv(train_csv.with_name("val.csv"), tree_rows(tree, "val")))} | extra
    return load_config("base", [f"{k}={v}" for k, v in values.items()])


def test_csv_rows_with_extra_fields_are_refused_naming_the_line(tree, tmp_path):
    """An unquoted comma in a path made a class named 'y.jpg'."""
    path = tmp_path / "train.csv"
    path.write_text("path,label\n" + "".join(f"{p},{c}\n" for p, c in tree_rows(tree)) + "a/x,y.jpg,a\n")
    with pytest.raises(DataTreeError, match=r"line 14: 3 field\(s\), the header has 2 .*quoted"):
        scan_sources(csv_cfg(tree, path))


@pytest.mark.parametrize("sampler", ["random", "weighted"])
def test_a_csv_class_whose_files_are_all_missing_exits_2_naming_it(tree, tmp_path, sampler):
    path = write_csv(tmp_path / "train.csv", tree_rows(tree) + [["train/ghost/1.jpg", "ghost"]])
    with pytest.raises(DataTreeError, match="class\\(es\\) with no existing image file: ghost"):
        scan_sources(csv_cfg(tree, path, **{"data.sampler": sampler, "data.max_bad_fraction": 0.5}))


def test_csv_rows_leaving_the_root_and_repeated_rows_are_warned_with_counts(tree, tmp_path, caplog):
    rows = tree_rows(tree)
    outside = [str(tree / rows[0][0]), rows[0][1]]
    class_image(1, (16, 16)).save(tree.parent / "loose.jpg")
    climbing = ["../loose.jpg", "b"]
    path = write_csv(tmp_path / "train.csv", rows + [outside, climbing, rows[2]])
    with caplog.at_level(logging.WARNING):
        sources = scan_sources(csv_cfg(tree, path))
    assert len(sources.train_index) == 15
    # the absolute row lies inside data.root; '../loose.jpg' does not
    assert "1 row(s) name files outside" in caplog.text and "line 15 '../loose.jpg'" in caplog.text
    assert "2 row(s) repeat a path listed before" in caplog.text and "line 14" in caplog.text


# ---------------------------------------------------------------- bug 7: files the config names

@pytest.mark.parametrize("fmt", ["folder", "csv", "webdataset"])
def test_a_fifo_named_by_a_data_key_exits_2_saying_it_is_a_fifo(tree, tmp_path, fmt):
    """data.classes on a FIFO hung for ever; data.train_csv on a FIFO said 'no such file'."""
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


def test_fifos_named_as_config_checkpoint_classes_or_weights_say_so_without_reading(tmp_path):
    """Each of these was opened and read: a FIFO blocked for ever (--classes) or was called missing."""
    from core.config import resolve_config_path
    from core.errors import CheckpointError, ModelError
    from core.safe_load import load_checkpoint
    from model_files.loading import read_classes_file
    from models.factory import read_weights_file

    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="a named pipe \\(FIFO\\); it must name a regular YAML file"):
        resolve_config_path(str(fifo))
    with pytest.raises(CheckpointError, match="a named pipe \\(FIFO\\); a checkpoint is a regular file"):
        load_checkpoint(fifo)
    with pytest.raises(ConfigError, match="--classes .*a named pipe"):
        read_classes_file(fifo, 3)
    with pytest.raises(ModelError, match="'model.weights' = .*a named pipe"):
        read_weights_file(fifo)


def test_a_folder_named_as_the_class_list_says_so(tree):
    cfg = load_config("base", [f"data.root={tree}", f"data.classes={tree}"])
    with pytest.raises(ConfigError, match="a folder; it must name a regular file"):
        check_data_root(cfg)


# ---------------------------------------------------------------- bug 10: file links

def test_file_links_out_of_the_class_folder_are_left_out_and_listed(tmp_path, caplog):
    root = make_tree(tmp_path / "data", {"a": 3, "b": 2}, splits=("train",))
    train = root / "train"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    class_image(0).save(elsewhere / "stranger.png")
    os.symlink("../b/b_0000.png", train / "a" / "fromb.png")            # into another class
    os.symlink(elsewhere / "stranger.png", train / "a" / "outside.png")  # out of the tree
    os.symlink("a_0000.png", train / "a" / "again.png")                  # a second name in its own class
    with caplog.at_level(logging.WARNING):
        index = scan_split(train)
    assert index.class_counts() == [3, 2]
    assert not any(Path(p).name in ("fromb.png", "outside.png", "again.png") for p in index.paths)
    assert f"{train / 'a' / 'fromb.png'} (a link to a file outside {train / 'a'})" in index.skipped
    assert f"{train / 'a' / 'outside.png'} (a link to a file outside {train / 'a'})" in index.skipped
    assert f"{train / 'a' / 'again.png'} (a second name of a file already read)" in index.skipped
    assert "fromb.png" in caplog.text


# ---------------------------------------------------------------- config weak spots

@pytest.mark.parametrize("override, words", [
    ("data.val_fraction=1", ["'data.val_fraction' = 1.0 is out of range; it must be > 0.0 and < 1.0"]),
    ("data.val_fraction=0", ["'data.val_fraction' = 0.0 is out of range; it must be > 0.0 and < 1.0"]),
    ("optim.lr=nan", ["'optim.lr'", "NaN and infinity are refused"]),
    ("train.clip_grad_norm=-inf", ["'train.clip_grad_norm'", "NaN and infinity are refused"]),
])
def test_config_ranges_and_non_finite_words_say_the_true_rule(override, words):
    with pytest.raises(ConfigError) as err:
        load_config("base", [override])
    for w in words:
        assert w in str(err.value)


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


# ---------------------------------------------------------------- bug 3: a diverged validation is never best

@pytest.fixture(scope="module")
def train_root(tmp_path_factory) -> Path:
    # 24 training images, batch 8: 3 optimizer steps per epoch
    return make_tree(tmp_path_factory.mktemp("h2train") / "data", {"a": (8, 2), "b": (8, 2), "c": (8, 2)},
                     size=(16, 16))


def test_nonfinite_numbers_are_never_an_improvement():
    from tasks import is_improvement
    from rundir.state import TrainState

    assert not is_improvement(float("nan"), None, "loss", 0.0)
    assert not is_improvement(float("-inf"), 1.0, "loss", 0.0)
    state = TrainState()
    diverged = {"top1": 33.3, "top5": 100.0, "loss": float("nan"), "mean_class_acc": 33.3, "num_samples": 6}
    assert not state.record_validation(0, diverged, "top1", 0.0, patience=None)
    assert state.best_value is None and state.best_metrics == {} and state.bad_epochs == 1
    assert state.record_validation(1, dict(diverged, loss=1.0), "top1", 0.0, patience=None)
    assert state.best_epoch == 2


@pytest.mark.slow
@pytest.mark.parametrize("metric", ["loss", "top1"])
def test_a_run_whose_first_validation_is_nan_keeps_best_pt_for_the_finite_epoch(train_root, tmp_path, monkeypatch,
                                                                               metric):
    """`optim.lr=1000000`: epoch 1 logged `loss nan ... best` and best.pt held `summary.best.loss: null`."""
    import json

    import torch

    import training_run.trainer as trainer
    from conftest import make_cfg

    calls = []

    def first_pass_diverged(*args, **kwargs):
        sums, unreadable = real_evaluate(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            sums.loss_sum.fill_(float("nan"))
        return sums, unreadable

    real_evaluate = trainer.evaluate
    monkeypatch.setattr(trainer, "evaluate", first_pass_diverged)
    out = tmp_path / "run"
    assert trainer.run(make_cfg(train_root, out, **{"early_stop.metric": metric})) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best_epoch"] == 2 and summary["best"]["loss"] is not None
    assert torch.load(out / "best.pt", weights_only=True)["epoch"] == 2
    log = (out / "train.log").read_text()
    assert "epoch 1: validation is not finite (loss nan): the model has diverged, so this epoch is never best" in log
    assert "loss nan" in log and "(6 samples)" in log
    assert not [line for line in log.splitlines() if "epoch 1/2" in line and line.endswith("best")]


# ---------------------------------------------------------------- model files: one tiny trained run

def exit_and_line(main, args, capsys) -> tuple[int, str]:
    from commands.cli import run_main

    with pytest.raises(SystemExit) as exited:
        run_main(lambda: main(args))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return exited.value.code, err.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(data root, best.pt) of one 1-epoch run of resnet10t at 16 px on 3 classes."""
    from conftest import train_tiny

    return train_tiny(tmp_path_factory.mktemp("h2model"), {"a": (8, 2), "b": (8, 2), "c": (8, 2)})


@pytest.mark.slow
def test_nan_weights_are_an_error_naming_the_model_file_in_infer_and_eval(trained, tmp_path, capsys):
    """A .pt whose first conv weight is NaN printed 'classified 4 of 4' with prob nan, exit 0."""
    import torch

    import eval as eval_script
    import infer

    data, checkpoint = trained
    saved = torch.load(checkpoint, weights_only=True)
    first_conv = next(k for k, v in saved["model"].items() if v.ndim == 4)
    saved["model"][first_conv] = torch.full_like(saved["model"][first_conv], float("nan"))
    broken = tmp_path / "nan.pt"
    torch.save(saved, broken)
    out = tmp_path / "rows.csv"
    code, line = exit_and_line(infer.main, [str(data / "val"), "--checkpoint", str(broken), "--num-workers", "0",
                                            "--output", str(out)], capsys)
    assert code == 1 and line.startswith(f"error: {broken}: the model's outputs are not finite")
    assert "for 6 of 6 image(s)" in line and not out.exists()
    code, line = exit_and_line(eval_script.main, ["--checkpoint", str(broken), "--data", str(data)], capsys)
    assert code == 1 and f"{broken}: the model's outputs are not finite" in line


@pytest.mark.slow
def test_an_export_never_overwrites_silently_nor_writes_into_a_run_directory(trained, tmp_path, capsys):
    import export

    data, checkpoint = trained
    run_dir = checkpoint.parent
    before = sorted(p.name for p in run_dir.iterdir())
    for fmt, output in (("timm", run_dir), ("onnx", run_dir / "model.onnx"), ("timm", run_dir / "sub" / "..")):
        code, line = exit_and_line(export.main, ["--checkpoint", str(checkpoint), "--format", fmt, "--output",
                                                 str(output)], capsys)
        assert code == 2 and "is a run directory (it holds last.pt)" in line, line
    assert sorted(p.name for p in run_dir.iterdir()) == before
    onnx_out = tmp_path / "m.onnx"
    assert export.main(["--checkpoint", str(checkpoint), "--format", "onnx", "--output", str(onnx_out)]) == 0
    first = onnx_out.read_bytes()
    code, line = exit_and_line(export.main, ["--checkpoint", str(checkpoint), "--format", "onnx", "--output",
                                             str(onnx_out)], capsys)
    assert code == 2 and f"--output {onnx_out} exists; pass --overwrite" in line
    assert onnx_out.read_bytes() == first
    assert export.main(["--checkpoint", str(checkpoint), "--format", "onnx", "--output", str(onnx_out),
                        "--overwrite"]) == 0
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    code, line = exit_and_line(export.main, ["--checkpoint", str(checkpoint), "--format", "timm", "--output",
                                             str(busy), "--overwrite"], capsys)
    assert code == 2 and "holds other files (notes.txt)" in line
    assert sorted(p.name for p in busy.iterdir()) == ["notes.txt"]


# ---------------------------------------------------------------- bug 2: a hostile .pt2

class Marker:
    """Unpickling this creates the file `path` (what a hostile payload would do, harmlessly)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def rewrite_zip(source: Path, target: Path, replace: dict) -> None:
    import zipfile

    with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            for suffix, change in replace.items():
                if info.filename.endswith(suffix):
                    data = change(data)
            dst.writestr(info.filename, data)


@pytest.fixture(scope="module")
def plain_pt2(tmp_path_factory) -> Path:
    import torch

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()).eval()
    path = tmp_path_factory.mktemp("pt2") / "plain.pt2"
    torch.export.save(torch.export.export(model, (torch.zeros(1, 3, 16, 16),)), str(path),
                      extra_files={"imgcls.json": '{"classes": ["a", "b", "c"]}'})
    return path


@pytest.mark.parametrize("how", ["use_pickle", "sample_inputs"])
def test_a_pt2_that_would_unpickle_is_refused_before_anything_in_it_runs(plain_pt2, tmp_path, how):
    """A weight marked use_pickle (or sample inputs a plain load refuses) ran its payload in infer.py."""
    import json
    import pickle

    from core.errors import CheckpointError
    from model_files.loading import load_model_file

    marker = tmp_path / "ran"
    payload = pickle.dumps(Marker(str(marker)))

    def pickled_weight(data: bytes) -> bytes:
        config = json.loads(data)
        config["config"]["0.weight"]["use_pickle"] = True
        return json.dumps(config).encode()

    evil = tmp_path / "evil.pt2"
    if how == "use_pickle":
        rewrite_zip(plain_pt2, evil, {"model_weights_config.json": pickled_weight, "data/weights/weight_0":
                                      lambda _: payload})
    else:
        rewrite_zip(plain_pt2, evil, {"data/sample_inputs/model.pt": lambda _: payload})
    with pytest.raises(CheckpointError, match="refused before loading, nothing in it was run"):
        load_model_file(evil)
    assert not marker.exists()


# ---------------------------------------------------------------- bugs 5 and 8: timm folders, foreign ONNX

@pytest.fixture
def timm_folder(tmp_path) -> Path:
    from conftest import write_pretrained_folder

    folder = tmp_path / "timm_model"
    write_pretrained_folder(folder, num_classes=3, label_names=["a", "b", "c"])
    return folder


def edit_config(folder: Path, **changes) -> None:
    import json

    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def refusals(folder: Path) -> list[str]:
    """The messages of infer/eval's loader and of model.pretrained=true model.name=local-dir:FOLDER."""
    from core.errors import ModelError
    from model_files.loading import load_model_file
    from models.factory import load_pretrained

    said = []
    for load in (lambda: load_model_file(folder),
                 lambda: load_pretrained(load_config("base", [f"model.name=local-dir:{folder}",
                                                              "model.pretrained=true"]).model)):
        with pytest.raises(ModelError) as err:
            load()
        said.append(str(err.value))
    return said


def test_a_timm_folder_whose_config_disagrees_with_its_weights_exits_2_naming_it(timm_folder):
    """num_classes 7 over 3-class weights silently got a random classifier."""
    edit_config(timm_folder, num_classes=7)
    for said in refusals(timm_folder):
        assert "config.json: num_classes 7 but model_args.num_classes 3" in said
    edit_config(timm_folder, num_classes=3, label_names=["a", "b"])
    for said in refusals(timm_folder):
        assert "num_classes 3 but 2 label_names" in said
    # a folder without model_args (an older timm): the classifier's shape tells
    edit_config(timm_folder, num_classes=7, label_names=[f"n{i}" for i in range(7)], model_args={})
    for said in refusals(timm_folder):
        assert "config.json (architecture and num_classes 7) and model.safetensors disagree" in said
        assert "[3, " in said and "(config.json: [7, " in said


def test_timm_folders_with_cut_mismatched_or_pickled_weights_exit_2_in_one_line(timm_folder):
    import pickle

    import torch
    from safetensors.torch import load_file, save_file

    weights = timm_folder / "model.safetensors"
    state = {k: v.clone() for k, v in load_file(str(weights)).items()}  # not mapped: the file is cut below
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    for said in refusals(timm_folder):
        assert "damaged or truncated safetensors file" in said
    conv = next(k for k, v in state.items() if v.ndim == 4)
    save_file(dict(state, **{conv: torch.zeros(5, *state[conv].shape[1:])}), str(weights))
    for said in refusals(timm_folder):
        assert f"disagree on" in said and conv in said
    weights.unlink()
    (timm_folder / "pytorch_model.bin").write_bytes(pickle.dumps(Marker(str(timm_folder / "ran")), protocol=2))
    for said in refusals(timm_folder):
        assert "was refused" in said and "pytorch_model.bin" in said
    assert not (timm_folder / "ran").exists()


def test_a_foreign_onnx_with_a_fixed_non_square_input_exits_2(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    from core.errors import CheckpointError
    from model_files.loading import load_model_file

    graph = helper.make_graph(
        [helper.make_node("GlobalAveragePool", ["images"], ["pooled"]),
         helper.make_node("Flatten", ["pooled"], ["logits"])], "foreign",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 64, 48])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "foreign.onnx"
    onnx.save(model, str(path))
    with pytest.raises(CheckpointError, match="fixed 64x48 \\(height x width\\) inputs"):
        load_model_file(path)


# ---------------------------------------------------------------- bug 9 and the tune.py weak spots

@pytest.mark.slow
def test_tune_sweeps_small_batches_whose_memory_probe_would_be_one_sample(train_root, tmp_path, capsys):
    """`--batch-sizes 2,4` probed memory at batch 1 and died in BatchNorm ('Expected more than 1 value per
    channel'), exit 1, no table."""
    import json
    from argparse import Namespace

    from commands.tune_run import run_sweep
    from conftest import tiny_overrides

    cfg = load_config("base", tiny_overrides(train_root, tmp_path / "run"))
    out = tmp_path / "t.json"
    args = Namespace(steps=2, warmup_steps=0, target_loss=None, checkpointing=False, json=str(out), plot=None)
    assert run_sweep(cfg, args, [2, 4]) == 0
    assert [row["effective_batch"] for row in json.loads(out.read_text())["rows"]] == [2, 4]
    assert "verdict" in capsys.readouterr().out


def test_tune_refuses_a_one_image_batch_that_batchnorm_cannot_train_on():
    from commands.tune_run import check_sizes

    with pytest.raises(ConfigError, match="--batch-sizes: 1 is one image per process, and BatchNorm cannot train"):
        check_sizes([1, 2], 24, 1)
    with pytest.raises(ConfigError, match="--batch-sizes: 2 is one image per process"):
        check_sizes([2, 4], 24, 2)
    check_sizes([1, 2], 24, 1, norm="group")


def test_tune_refuses_warmup_at_least_as_long_as_the_steps():
    from argparse import Namespace

    from commands.tune import check_arguments

    base = dict(batch_sizes=None, target_loss=None, lr_range=None, checkpointing=False, json=None, plot=None)
    with pytest.raises(ConfigError, match="--warmup-steps 100 is not below --steps 2"):
        check_arguments(Namespace(steps=2, warmup_steps=100, **base))
    with pytest.raises(ConfigError, match="--warmup-steps 100 is not below --steps 100"):
        check_arguments(Namespace(steps=None, warmup_steps=100, **base))
    check_arguments(Namespace(steps=4, warmup_steps=3, **base))


@pytest.mark.slow
def test_tune_on_sigterm_writes_the_table_and_json_of_the_sizes_so_far(train_root, tmp_path):
    import json
    import signal
    import subprocess
    import sys

    from conftest import REPO, tiny_overrides, wait_for

    out, err = tmp_path / "t.json", tmp_path / "stderr.txt"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, str(REPO / "tune.py"), "--config", "base",
                                 *tiny_overrides(train_root, tmp_path / "run"), "--batch-sizes", "4,8",
                                 "--steps", "400", "--json", str(out)], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=stderr, text=True, start_new_session=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
        wait_for(proc, lambda: "s in all" in err.read_text(), "the sweep's first points")
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, err.read_text()[-2000:]
    assert "verdict" in stdout and "(interrupted: the sizes so far)" in stdout
    doc = json.loads(out.read_text())
    assert doc["interrupted"] is True and [row["effective_batch"] for row in doc["rows"]] == [4]
