"""Semi-supervised training (objectives/semi.py, data/unlabeled.py): the unlabelled stream's positions (the same
images and seeds at any world size, resumable from a batch number), FlexMatch's class-wise thresholds, a FixMatch
run's figures and state, the refusals before any work, and offline self-training (infer.py --pseudo-labels, then
data.extra_train_csv)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from conftest import exit_code, make_cfg, make_tree

from imgcls.core.errors import ConfigError

CLASSES = ["a", "b", "c"]


@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> tuple[Path, Path]:
    """(labelled tree: 8 train / 3 val per class, unlabelled pool: 30 images in class-named sub-folders)."""
    base = tmp_path_factory.mktemp("semi")
    data = make_tree(base / "data", {c: (8, 3) for c in CLASSES})
    pool = make_tree(base / "pool", {c: 10 for c in CLASSES}, splits=("any",), seed=1)
    return data, pool


def test_two_processes_read_the_images_one_process_reads_at_twice_the_batch_and_a_resume_continues_there():
    from imgcls.data.unlabeled import UnlabeledStream

    def batches(stream, count):
        it, out = iter(stream), []
        for _ in range(count):
            out.append([next(it) for _ in range(stream.batch)])
        return out

    one = batches(UnlabeledStream(10, seed=3, batch=6), 5)
    ranks = [batches(UnlabeledStream(10, seed=3, batch=3, rank=r, world_size=2), 5) for r in (0, 1)]
    for k in range(5):
        assert sorted(ranks[0][k] + ranks[1][k]) == sorted(one[k])  # (image, global position) pairs
    assert batches(UnlabeledStream(10, seed=3, batch=6, start=3), 2) == one[3:5]
    seen = [image for batch in one for image, _ in batch]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))  # each round: all once
    assert seen[:10] != seen[10:20]  # a new order each round


def test_flexmatch_thresholds_follow_each_classs_learning_status_with_and_without_warmup():
    from imgcls.objectives.semi import ClassThresholds

    for warmup, expected in ((True, [0.5, 0.2, 0.0]), (False, [1.0, 1 / 3, 0.0])):
        state = ClassThresholds(6, 3, warmup, torch.device("cpu"))
        state.labels.copy_(torch.tensor([-1, -1, -1, 0, 0, 1]))
        assert state.thresholds(0.9).tolist() == pytest.approx([0.9 * e for e in expected])
    # image 0 twice in one batch (a round's end and the next one's start): its later prediction counts
    state.update(torch.tensor([0, 1, 5, 0]), torch.tensor([2, 2, 2, 1]), torch.tensor([True, False, True, True]))
    assert state.labels.tolist() == [1, -1, -1, 0, 0, 2]


@pytest.mark.slow
def test_a_fixmatch_run_logs_the_share_above_threshold_and_keeps_its_stream_in_last_pt(trees, tmp_path):
    from imgcls.training.trainer import run

    data, pool = trees
    out = tmp_path / "run"
    cfg = make_cfg(data, out, **{"semi.method": "fixmatch", "data.unlabeled": str(pool), "semi.ratio": 2,
                                 "semi.threshold": 0.5, "output.log_interval": 1, "train.accum_steps": 2,
                                 "train.batch_size": 4, "train.epochs": 1, "calibration.temperature": "none"})
    assert run(cfg) == 0
    ckpt = torch.load(out / "last.pt", map_location="cpu", weights_only=True)
    steps = ckpt["step"]
    assert steps == 3  # 24 images, batch 4, accumulation 2: 3 steps an epoch
    semi = ckpt["semi"]
    assert semi["method"] == "fixmatch" and semi["images"] == 30
    assert semi["batches_taken"] == 6  # one unlabelled batch per micro-batch
    summary = json.loads((out / "summary.json").read_text())["semi"]
    assert summary["unlabeled_seen"] == 6 * 2 * 4
    assert 0 < summary["above_threshold"] <= summary["unlabeled_seen"]
    assert sum(summary["pseudo_labels"].values()) == summary["above_threshold"]
    assert set(summary["pseudo_labels"]) == set(CLASSES)
    log = (out / "train.log").read_text()
    assert "unlabelled images" in log and "above the threshold; pseudo-labels:" in log


def test_semi_refusals_before_any_work(trees, tmp_path):
    from imgcls.config import load_config
    from imgcls.objectives.registry import check_objective

    data, pool = trees
    with pytest.raises(ConfigError, match="needs 'data.unlabeled'"):
        make_cfg(data, tmp_path / "r", **{"semi.method": "fixmatch"})
    with pytest.raises(ConfigError, match="do not combine"):
        make_cfg(data, tmp_path / "r", **{"semi.method": "fixmatch", "data.unlabeled": str(pool),
                                         "distill.teacher": "resnet18"})
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no images found"):
        check_objective(make_cfg(data, tmp_path / "r", **{"semi.method": "fixmatch", "data.unlabeled": str(empty)}))
    with pytest.raises(ConfigError, match="has 3 channel"):  # RGB files where data.channels=1
        check_objective(make_cfg(data, tmp_path / "r", **{"semi.method": "flexmatch", "data.unlabeled": str(pool),
                                                         "data.channels": 1}))
    tags = load_config("base", ["data.format=csv", f"data.train_csv={tmp_path / 't.csv'}", "data.val_fraction=0.2",
                                "data.task=multilabel", "semi.method=fixmatch", f"data.unlabeled={pool}"])
    with pytest.raises(ConfigError, match="pseudo-labels for tags are a different method"):
        check_objective(tags)


def test_the_training_folder_as_unlabelled_data_warns(trees, tmp_path, caplog):
    from imgcls.objectives.registry import check_objective

    data, _ = trees
    check_objective(make_cfg(data, tmp_path / "r", **{"semi.method": "fixmatch", "data.unlabeled": str(data)}))
    assert "holds the training folder" in caplog.text


def test_unreadable_unlabelled_files_are_replaced_and_counted(tmp_path):
    from imgcls.config import load_config
    from imgcls.data.unlabeled import TwoViews, UnlabeledDataset, list_unlabeled

    pool = make_tree(tmp_path / "pool", {"x": 4}, splits=("any",))
    (pool / "any" / "x" / "broken.png").write_bytes(b"not an image")
    d = load_config("base", ["data.img_size=16", f"data.unlabeled={pool}", "semi.method=fixmatch"]).data
    paths, _ = list_unlabeled(d)
    broken = next(i for i, p in enumerate(paths) if p.endswith("broken.png"))
    weak, strong, index, replaced = UnlabeledDataset(paths, TwoViews(d), seed=0)[(broken, 7)]
    assert replaced == broken and index != broken
    assert weak.shape == strong.shape == (3, 16, 16) and not torch.equal(weak, strong)
    again = UnlabeledDataset(paths, TwoViews(d), seed=0)[(broken, 7)]
    assert all(torch.equal(a, b) for a, b in zip((weak, strong), again[:2]))  # a function of (seed, position)
    listed = tmp_path / "unlabelled.csv"
    listed.write_text("path\n" + "".join(f"{Path(p).relative_to(tmp_path)}\n" for p in paths) + "gone.png\n")
    d = load_config("base", [f"data.unlabeled={listed}", "semi.method=fixmatch", "data.max_bad_fraction=0.5"]).data
    assert list_unlabeled(d)[0] == [str(tmp_path / Path(p).relative_to(tmp_path)) for p in paths]  # gone.png left out


def write_shard(tar_path: Path, files: list[str], labels: bool = True) -> Path:
    """A WebDataset shard of `files` (keys 000000, ...; a .cls label beside each image when `labels`)."""
    import io
    import tarfile

    with tarfile.open(tar_path, "w") as tar:
        for k, path in enumerate(files):
            members = [(f"{k:06d}{Path(path).suffix}", Path(path).read_bytes())]
            members += [(f"{k:06d}.cls", b"0")] if labels else []
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return tar_path


def test_unlabelled_shards_are_read_by_offset_as_their_files_are(trees, tmp_path, caplog):
    from imgcls.config import load_config
    from imgcls.data.unlabeled import ShardMembers, TwoViews, UnlabeledDataset, check_unlabeled, list_unlabeled

    _, pool = trees
    d = load_config("base", ["data.img_size=16", f"data.unlabeled={pool}", "semi.method=fixmatch"]).data
    files, _ = list_unlabeled(d)
    write_shard(tmp_path / "u-000000.tar", files[:17])
    write_shard(tmp_path / "u-000001.tar", files[17:], labels=False)
    d = load_config("base", ["data.img_size=16", f"data.unlabeled={tmp_path}/u-{{000000..000001}}.tar",
                             "semi.method=fixmatch"]).data
    members = check_unlabeled(d)
    assert isinstance(members, ShardMembers) and len(members) == len(files) == 30
    assert members[17] == "u-000001.tar/000000.png"
    by_file, by_member = UnlabeledDataset(files, TwoViews(d), seed=0), UnlabeledDataset(members, TwoViews(d), seed=0)
    for key in ((0, 5), (17, 40), (29, 3)):
        assert all(torch.equal(a, b) for a, b in zip(by_file[key][:2], by_member[key][:2]))
    classes = tmp_path / "classes.txt"
    classes.write_text("a\nb\nc\n")
    check_unlabeled(load_config("base", [f"data.unlabeled={tmp_path}/u-{{000000..000001}}.tar", "semi.method=fixmatch",
                                         "data.format=webdataset", f"data.train_shards={tmp_path}/u-000001.tar",
                                         f"data.val_shards={tmp_path}/u-000000.tar", f"data.classes={classes}"]).data)
    assert "holds 1 of the training shards" in caplog.text
    for value, words in ((f"{tmp_path}/u-000009.tar", "no shard file"), ("https://x.org/u-0.tar", "not a local file"),
                         (str(write_shard(tmp_path / "labels.tar", [])), "no images found")):
        d = load_config("base", [f"data.unlabeled={value}", "semi.method=fixmatch"]).data
        with pytest.raises(ConfigError, match=words):
            check_unlabeled(d)


def test_pseudo_labels_from_infer_become_extra_training_rows(trees, tmp_path, finished_run):
    import infer
    from imgcls.data.sources import scan_sources

    data, pool = trees
    every, out = tmp_path / "all.csv", tmp_path / "pseudo.csv"
    common = [str(pool), "--checkpoint", str(finished_run / "best.pt"), "--num-workers", "0"]
    assert exit_code(lambda: infer.main([*common, "--output", str(every)])) == 0
    with every.open() as f:
        probs = sorted(float(r["prob"]) for r in csv.DictReader(f))
    threshold = probs[len(probs) // 2]
    argv = [*common, "--pseudo-labels", str(out), "--pseudo-threshold", str(threshold)]
    assert exit_code(lambda: infer.main(argv)) == 0
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == sum(1 for p in probs if p >= threshold) >= len(probs) // 2
    assert all(float(r["prob"]) >= threshold and float(r["threshold"]) == threshold for r in rows)
    assert all(Path(r["path"]).is_absolute() and r["label"] in CLASSES for r in rows)
    inside = [str(pool), "--checkpoint", str(finished_run / "best.pt"), "--pseudo-labels", str(pool / "p.csv")]
    assert exit_code(lambda: infer.main(inside)) == 2  # never into the folder it reads
    plain = scan_sources(make_cfg(data, tmp_path / "r"))
    extra = scan_sources(make_cfg(data, tmp_path / "r", **{"data.extra_train_csv": str(out)}))
    assert len(extra.train_index) == len(plain.train_index) + len(rows)
    assert len(extra.val_index) == len(plain.val_index)  # never validated on
    assert "extra_train_csv_sha256" in extra.identity


def test_tune_search_takes_the_semi_keys(tmp_path):
    from imgcls.tuning.search import load_space

    space = tmp_path / "space.yaml"
    space.write_text("semi.threshold: {low: 0.7, high: 0.98}\nsemi.ratio: [3, 7]\nsemi.method: [fixmatch, flexmatch]\n")
    dims = load_space(str(space), "base", [f"data.unlabeled={tmp_path}", "semi.method=fixmatch"])
    assert [d.key for d in dims] == ["semi.threshold", "semi.ratio", "semi.method"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("semi.threshold: {low: 0.5, high: 1.5}\n")
    with pytest.raises(ConfigError, match="semi.threshold"):
        load_space(str(bad), "base", [f"data.unlabeled={tmp_path}", "semi.method=fixmatch"])
