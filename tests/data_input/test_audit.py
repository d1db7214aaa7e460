"""audit.py on generated trees with injected faults (copies, re-encoded near copies, leaks, an unreadable
file, a wrong label), in every data format; the data is unchanged after a run; the HTML page renders in a
headless Chromium; bad arguments exit 2. The pure parts (hash comparisons, folds, balance) are unit-tested."""
from __future__ import annotations

import csv
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import class_image, make_tree, run_script, tiny_overrides, train_tiny
from PIL import Image

COUNTS = {"a": (10, 4), "b": (10, 4), "c": (10, 4)}


def tree_digest(root: Path) -> str:
    """SHA-256 over every path, size, mode and content under `root`."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        h.update(f"{path.relative_to(root)}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


def inject_faults(root: Path, train: str = "train", val: str | None = "val") -> dict:
    """Faults in a make_tree tree; returns their names relative to `root` (train/val folders, or one tree)."""
    t = root / train if train else root
    shutil.copy(t / "b" / "b_0001.png", t / "b" / "copy.png")                       # exact duplicate
    Image.open(t / "c" / "c_0002.png").resize((32, 32)).save(t / "c" / "near.jpg", quality=90)  # near copy
    (t / "a" / "broken.png").write_bytes(b"\x89PNG not really")                      # unreadable
    Image.new("RGB", (24, 24), (0, 0, 200)).save(t / "a" / "wrong.png")  # an unmistakable 'c' (blue) filed under a
    prefix = f"{train}/" if train else ""
    faults = {"copy": (f"{prefix}b/b_0001.png", f"{prefix}b/copy.png"), "near": (f"{prefix}c/c_0002.png", f"{prefix}c/near.jpg"),
              "broken": f"{prefix}a/broken.png", "wrong": f"{prefix}a/wrong.png"}
    if val:
        shutil.copy(t / "a" / "a_0000.png", root / val / "a" / "leak.png")                          # exact leak
        Image.open(t / "b" / "b_0003.png").save(root / val / "b" / "leak_reencoded.jpg", quality=90)  # near leak
        faults["leak"] = (f"{train}/a/a_0000.png", f"{val}/a/leak.png")
        faults["near_leak"] = (f"{train}/b/b_0003.png", f"{val}/b/leak_reencoded.jpg")
    return faults


def audit(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return run_script("audit.py", "--config", "base", *args, timeout=timeout)


@pytest.fixture(scope="module")
def folder_audit(tmp_path_factory):
    base = tmp_path_factory.mktemp("audit_folder")
    data = make_tree(base / "data", COUNTS)
    faults = inject_faults(data)
    make_tree(data, {"a": 2, "b": 2, "c": 2}, splits=("test",), seed=7)  # a test split, with one val image
    shutil.copy(data / "val" / "c" / "c_0000.png", data / "test" / "c" / "from_val.png")
    before = tree_digest(data)
    out = base / "out"
    done = audit(*tiny_overrides(data, base / "unused", **{"train.batch_size": 4, "optim.lr": 0.1}), "--folds", "2",
                 "--fold-epochs", "4",
                 "--json", str(out / "audit.json"), "--html", str(out / "audit.html"),
                 "--write-clean-csv", str(out / "clean.csv"), "--drop-label-issues", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    return {"data": data, "faults": faults, "before": before, "after": tree_digest(data), "out": out,
            "report": json.loads((out / "audit.json").read_text()), "stderr": done.stderr}


def pairs_of(report: dict) -> set[tuple[str, str]]:
    """The train/val leaks of two-member groups as (train, val) pairs."""
    return {(leak["train"][0], leak["val"][0]) for leak in report["leaks"]
            if leak["splits"] == ["train", "val"] and leak["count"] == 2}


@pytest.mark.slow  # runs audit.py (and training) in a subprocess
def test_folder_audit_names_leaks_first_duplicates_and_unreadable_files(folder_audit):
    r, f = folder_audit["report"], folder_audit["faults"]
    assert pairs_of(r) == {f["leak"], f["near_leak"]}
    assert [(x["val"], x["test"], x["train"], x["distance"]) for x in r["leaks"] if x["splits"] == ["val", "test"]] == [
        (["val/c/c_0000.png"], ["test/c/from_val.png"], [], 0)]  # every split named, empty where no member
    assert len(r["leaks"]) == 3
    assert r["leaks"][0]["train"] == [f["leak"][0]] and r["leaks"][0]["distance"] == 0 and r["leaks"][0]["exact"]
    near = next(x for x in r["leaks"] if x["val"] == [f["near_leak"][1]])
    assert 0 < near["distance"] <= r["near_threshold"] and not near["exact"] and r["leaks"][-1] is near  # exact first
    groups = {tuple(g["paths"]): g for g in r["duplicates"]}
    assert groups[f["copy"]]["kind"] == "exact" and groups[f["copy"]]["split"] == "train"
    assert groups[f["near"]]["kind"] == "near"
    assert len(r["duplicates"]) == 2  # no distinct images grouped
    assert r["unreadable"] == [f["broken"]]
    stderr = folder_audit["stderr"]
    assert stderr.index("3 leak group(s)") < stderr.index("duplicate group(s)")  # the most serious finding first


@pytest.mark.slow  # runs audit.py (and training) in a subprocess
def test_folder_audit_ranks_the_wrong_label_first_with_its_suggested_class(folder_audit):
    r = folder_audit["report"]
    first = r["label_issues"][0]
    assert first["path"] == folder_audit["faults"]["wrong"]
    assert (first["given"], first["suggested"]) == ("a", "c") and first["score"] < 0.5
    assert [i["score"] for i in r["label_issues"]] == sorted(i["score"] for i in r["label_issues"])
    assert "2-fold" in r["label_issues_source"]


@pytest.mark.slow  # runs audit.py (and training) in a subprocess
def test_audit_reports_balance_and_shape(folder_audit):
    r = folder_audit["report"]
    assert r["class_counts"]["train"] == {"a": 12, "b": 11, "c": 11}  # broken.png is listed as training lists it
    assert r["class_counts"]["val"] == {"a": 5, "b": 5, "c": 4}
    assert r["class_counts"]["test"] == {"a": 2, "b": 2, "c": 3}
    assert r["balance"]["small_classes"] == ["a", "b", "c"]  # under audit.min_class_images=20
    stats = r["image_stats"]
    assert stats["count"] == 54 and stats["width"] == {"min": 24.0, "median": 24.0, "max": 32.0}
    assert stats["formats"] == {"PNG": 52, "JPEG": 2} and stats["modes"] == {"RGB": 54}
    assert any("fewer than 20" in line for line in r["advice"])
    assert any("below the 32 px a perceptual hash reads" in line for line in r["advice"])  # 24 px images


@pytest.mark.slow  # runs audit.py (and training) in a subprocess
def test_audit_never_changes_the_data(folder_audit):
    assert folder_audit["after"] == folder_audit["before"]


@pytest.mark.slow  # runs audit.py (and training) in a subprocess
def test_clean_csv_drops_leaked_and_duplicate_copies_and_trains_as_a_list(folder_audit):
    from imgcls.config import load_config
    from imgcls.data.sources import scan_sources

    f, out = folder_audit["faults"], folder_audit["out"]
    with open(out / "clean.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    names = {row["path"] for row in rows}
    assert f["leak"][0] not in names and f["near_leak"][0] not in names
    assert f["copy"][0] in names and f["copy"][1] not in names
    assert f["near"][0] in names and f["near"][1] not in names
    assert f["broken"] not in names and f["wrong"] not in names  # --drop-label-issues 1: the first issue
    assert len(rows) == 34 - 6  # 34 training files less the broken one, 2 leaked and 2 duplicate copies, 1 issue
    cfg = load_config("base", [f"data.root={folder_audit['data']}", "data.format=csv",
                               f"data.train_csv={out / 'clean.csv'}", "data.val_fraction=0.2"])
    assert len(scan_sources(cfg).train_index) + len(scan_sources(cfg).val_index) == len(rows)


@pytest.mark.slow  # runs audit.py (and training) in a subprocess
def test_html_report_renders_offline_in_headless_chromium(folder_audit, tmp_path):
    page = (folder_audit["out"] / "audit.html").read_text()
    assert "http://" not in page and "https://" not in page and "<script" not in page
    assert page.count('src="data:image/jpeg;base64,') >= 2 * 2 + 2 + 2 + 1  # leaks, groups, label issue
    shot = tmp_path / "shot.png"
    done = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--screenshot={shot}", "--window-size=900,1200",
                           (folder_audit["out"] / "audit.html").as_uri()], capture_output=True, text=True,
                          timeout=120)
    assert shot.is_file(), done.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    assert pixels.shape == (1200, 900, 3)
    # the thumbnails' class colours (a red, b green, c blue on a white page) are on screen
    r, g, b = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    for mask in (r - np.maximum(g, b) > 100, g - np.maximum(r, b) > 100, b - np.maximum(r, g) > 100):
        assert mask.sum() > 2000


# ---------------------------------------------------------------- other data formats (no label search)


@pytest.mark.slow  # runs audit.py (and training) in a subprocess
def test_val_fraction_audit_with_loader_workers_finds_copies_across_the_split(tmp_path):
    data = make_tree(tmp_path / "data", {"a": 12, "b": 12, "c": 12}, splits=("all",))
    data = data / "all"
    faults = inject_faults(data, train="", val=None)
    done = audit(*tiny_overrides(data, tmp_path / "unused", **{"data.val_fraction": 0.25, "data.num_workers": 2}),
                 "--folds", "0", "--json", str(tmp_path / "a.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads((tmp_path / "a.json").read_text())
    found = {tuple(g["paths"]) for g in r["duplicates"]} | pairs_of(r)
    for pair in (faults["copy"], faults["near"]):  # whichever side of the split each copy fell on
        assert pair in found or pair[::-1] in found
    assert r["unreadable"] == [faults["broken"]] and r["label_issues"] == [] and r["label_issues_source"] is None
    assert sum(r["class_counts"]["val"].values()) == 10
    assert r["timings"]["loader_workers"] == 2 and r["timings"]["images"] == 40


@pytest.mark.slow  # runs audit.py (and training) in a subprocess
def test_csv_audit_names_files_relative_to_the_root_and_lists_missing_rows(tmp_path):
    data = make_tree(tmp_path / "data", COUNTS)
    faults = inject_faults(data)
    for split in ("train", "val"):
        files = sorted(p for p in (data / split).rglob("*") if p.is_file())
        with open(tmp_path / f"{split}.csv", "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["path", "label"])
            w.writerows((p.relative_to(data).as_posix(), p.parent.name) for p in files)
            if split == "train":
                w.writerow(["train/a/gone.png", "a"])
    done = audit(*tiny_overrides(data, tmp_path / "unused", **{"data.format": "csv", "data.train_csv": tmp_path / "train.csv",
                                                               "data.val_csv": tmp_path / "val.csv"}),
                 "--folds", "0", "--json", str(tmp_path / "a.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads((tmp_path / "a.json").read_text())
    assert pairs_of(r) == {faults["leak"], faults["near_leak"]}
    assert sorted(r["unreadable"]) == sorted([faults["broken"], "train/a/gone.png"])


@pytest.mark.slow  # runs audit.py (and training) in a subprocess
def test_webdataset_audit_names_shard_samples_as_training_does(tmp_path):
    data = make_tree(tmp_path / "data", COUNTS)
    faults = inject_faults(data)
    (data / "train" / "a" / "broken.png").unlink()  # shards hold what decodes; a broken sample is injected below
    import webdataset as wds

    from imgcls.data.listing import scan_split
    from imgcls.data.shards import write_shards

    for split in ("train", "val"):
        index = scan_split(data / split)
        write_shards(index.paths, index.labels, index.classes, tmp_path / split, shard_size=20)

    with wds.TarWriter(str(tmp_path / "train" / "shard-000009.tar")) as w:
        w.write({"__key__": "broken", "png": b"not a png", "cls": "0"})
    extra = f"::{tmp_path / 'train'}/shard-000009.tar"
    before = tree_digest(tmp_path / "train")
    done = audit(*tiny_overrides(data, tmp_path / "unused", **{
        "data.format": "webdataset", "data.root": "null", "data.classes": tmp_path / "train" / "classes.txt",
        "data.train_shards": f"{tmp_path}/train/shard-{{000000..000001}}.tar{extra}",
        "data.val_shards": f"{tmp_path}/val/shard-000000.tar"}),
        "--folds", "0", "--json", str(tmp_path / "a.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads((tmp_path / "a.json").read_text())
    assert len(r["leaks"]) == 2 and all(" (sample " in leak["train"][0] and leak["train"][0].endswith(")")
                                        for leak in r["leaks"])
    assert {leak["distance"] == 0 for leak in r["leaks"]} == {True, False}
    assert {g["kind"] for g in r["duplicates"]} == {"exact", "near"}
    assert r["unreadable"] == [f"{tmp_path / 'train'}/shard-000009.tar (sample 0)"]
    assert tree_digest(tmp_path / "train") == before
    assert faults  # the faults were written into the shards


# ---------------------------------------------------------------- --checkpoint


@pytest.mark.slow  # runs audit.py (and training) in a subprocess
def test_checkpoint_label_search_uses_only_images_it_did_not_train_on(tmp_path):
    import torch

    root = tmp_path / "data" / "train"  # one class-folder tree, split by data.val_fraction
    _, best = train_tiny(tmp_path, {"a": 12, "b": 12, "c": 12}, **{"data.val_fraction": 0.34, "data.root": root})
    split = torch.load(best, weights_only=True)["data_source"]["split"]
    assert split["val"] and split["train"]
    done = audit(*tiny_overrides(root, tmp_path / "unused", **{"data.val_fraction": 0.34}), "--checkpoint", str(best),
                 "--json", str(tmp_path / "a.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads((tmp_path / "a.json").read_text())
    assert r["label_issues_source"] == f"checkpoint {best}"
    assert "did not train on" in r["label_issues_note"] and f"the {len(split['val'])} images" in r["label_issues_note"]
    assert {i["path"] for i in r["label_issues"]} <= set(split["val"])


# ---------------------------------------------------------------- usage errors


@pytest.mark.parametrize("args, words", [
    (["--folds", "1"], "'audit.folds' = 1"),
    (["--near-threshold", "65"], "'audit.near_threshold' = 65"),
    (["--drop-label-issues", "3"], "only shapes --write-clean-csv"),
    (["--checkpoint", "nothing.pt"], "--checkpoint nothing.pt: no such file"),
    (["audit.fold=2"], "audit.folds"),
])
@pytest.mark.slow  # runs audit.py (and training) in a subprocess
def test_bad_arguments_exit_2_before_any_work_naming_the_fix(tmp_path, args, words):
    data = make_tree(tmp_path / "data", {"a": 2, "b": 2})
    done = audit(f"data.root={data}", *args, "--json", str(tmp_path / "a.json"), timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert words in done.stderr
    assert not (tmp_path / "a.json").exists()


# ---------------------------------------------------------------- pure parts


def test_copy_groups_join_exact_and_confirmed_near_copies_once_per_group():
    from imgcls.auditing.duplicates import copy_groups, hash_array, near_pairs

    h = hash_array([0b0, 0b111, 0xFFFF_0000_0000_0000, 0b1])
    assert near_pairs(h, h, 3, same=True) == [(0, 1, 3), (0, 3, 1), (1, 3, 2)]
    ok = [True] * 4
    assert copy_groups(["x", "y", "x", "z"], hash_array([0, (1 << 40) - 1, 0xFF, 0xFFFF_FFFF << 32]), 1, ok) == [
        {"members": [0, 2], "exact": True, "distance": 0}]  # equal bytes group whatever the pHash
    assert copy_groups(["p", "q", "r", "s"], h, 3, ok) == [{"members": [0, 1, 3], "exact": False, "distance": 3}]
    # the confirmation decides: 1 is no copy of 0 or 3, though its hash is near
    refuse_1 = lambda i, cols: (cols != 1) & (i != 1)  # noqa: E731
    assert copy_groups(["p", "q", "r", "s"], h, 3, ok, refuse_1) == [{"members": [0, 3], "exact": False,
                                                                       "distance": 1}]


def test_images_too_small_for_phash_match_by_content_only():
    from imgcls.auditing.audit_data import AuditItem
    from imgcls.auditing.duplicates import ImageFacts, find_copies

    def item(name, split):
        return AuditItem(name=name, file=name, label=0, split=split)

    # near hashes (1 bit apart) of distinct files: a pair when both are 16 px or larger, never when one is 8 px
    facts = [ImageFacts("s0", 0b0, 64, 48), ImageFacts("s1", 0b1, 40, 40), ImageFacts("s2", 0b0, 8, 8),
             ImageFacts("s3", 0b1, 8, 8), ImageFacts("s2", 0b0, 8, 8)]
    items = [item("a.png", "train"), item("b.png", "train"), item("c.png", "train"), item("d.png", "val"),
             item("e.png", "val")]
    dups, leaks, _ = find_copies(items, facts, {"train": [0, 1, 2]}, 6, None, lambda x: "0")
    assert [g["paths"] for g in dups] == [["a.png", "b.png"]]
    _, leaks, _ = find_copies(items, facts, {"train": [0, 1, 2], "val": [3, 4]}, 6, None, lambda x: "0")
    assert [(x["train"], x["val"], x["exact"]) for x in leaks] == [(["c.png"], ["e.png"], True)]


def test_folds_are_stratified_seeded_and_keep_copies_together():
    from imgcls.auditing.folds import assign_folds, unseen_by_checkpoint

    digests = [f"d{i}" for i in range(40)] + ["d0", "d1"]
    labels = [i % 2 for i in range(40)] + [0, 1]
    folds = assign_folds(digests, labels, 4, seed=0)
    assert folds == assign_folds(digests, labels, 4, seed=0) and folds != assign_folds(digests, labels, 4, seed=1)
    assert folds[40] == folds[0] and folds[41] == folds[1]
    for label in (0, 1):
        per_fold = np.bincount([f for f, l, d in zip(folds, labels, digests) if l == label and d not in ("d0", "d1")]
                               + [folds[label]], minlength=4)
        assert per_fold.max() - per_fold.min() <= 1
    assert unseen_by_checkpoint(["x", "y"], ["train", "val"], {"split": {"train": ["x"]}}) == [False, True]
    assert unseen_by_checkpoint(["x", "y"], ["train", "val"], {"format": "folder"}) == [False, True]


def test_checkpoint_classes_are_matched_by_name_and_a_difference_is_a_usage_error():
    import torch

    from imgcls.auditing.folds import align_classes, check_same_classes
    from imgcls.core.errors import ConfigError

    probs = torch.tensor([[0.7, 0.2, 0.1]])
    assert align_classes(probs, ["b", "c", "a"], ["a", "b", "c"])[0].tolist() == pytest.approx([0.1, 0.7, 0.2])
    with pytest.raises(ConfigError, match=r"not in the model: \['d'\]; not in the data: \['c'\]"):
        check_same_classes(["a", "b", "c"], ["a", "b", "d"])


def test_label_issues_rank_by_self_confidence_and_suggest_the_argmax():
    from imgcls.auditing.folds import find_label_issues

    labels = [i % 3 for i in range(60)]
    probs = np.full((60, 3), 0.05)
    probs[np.arange(60), labels] = 0.9
    probs[4] = [0.02, 0.08, 0.9]   # given 1 (4 % 3), as sure of 2 as the 2s are: p(given) 0.08
    probs[7] = [0.01, 0.04, 0.95]  # given 1: p(given) 0.04
    probs[5] = [0.1, 0.3, 0.6]     # given 2 and less sure of it than the other 2s: not an issue
    issues = find_label_issues(labels, probs)
    assert [(i["position"], i["suggested"]) for i in issues][:2] == [(7, 2), (4, 2)]
    assert issues[0]["score"] == pytest.approx(0.04)


def test_an_under_confident_fold_model_still_names_the_image_it_files_under_another_class():
    """The audit's 2-fold, 4-epoch case: the fold model put the planted image in class c at 0.576 (its given
    class a at 0.234) while c's own images averaged 0.63; cleanlab's confident learning alone found nothing."""
    from cleanlab.filter import find_label_issues as cleanlab_find

    from imgcls.auditing.folds import find_label_issues

    rng = np.random.default_rng(0)
    labels = [i % 3 for i in range(45)]
    probs = np.full((45, 3), 0.0)
    for i, label in enumerate(labels):
        own = rng.uniform(0.5, 0.76)
        probs[i] = (1 - own) / 2
        probs[i, label] = own
    probs[3] = [0.234, 0.19, 0.576]            # given 0, predicted 2 at 2.5x
    probs[6] = [0.40, 0.25, 0.35]              # given 0, predicted 0: no issue
    probs[9] = [0.30, 0.36, 0.34]              # given 0, predicted 1 at 1.2x: a hard image, not named
    assert probs[[i for i, label in enumerate(labels) if label == 2], 2].mean() > 0.576
    assert 3 not in cleanlab_find(np.array(labels), probs, filter_by="prune_by_noise_rate")
    issues = {i["position"]: i for i in find_label_issues(labels, probs)}
    assert (issues[3]["suggested"], issues[3]["rule"]) == (2, "disagreement")
    assert issues[3]["score"] == pytest.approx(0.234) and 6 not in issues and 9 not in issues


def test_balance_advice_names_the_weighted_sampler_and_small_classes():
    from imgcls.auditing.report import advice, balance, image_stats

    b = balance({"cat": 300, "dog": 10, "eel": 50}, min_images=20)
    assert b["imbalance_ratio"] == 30 and b["small_classes"] == ["dog"]
    s = image_stats([(640, 480), (50, 40), (1000, 200)], ["RGB", "L", "RGB"], ["JPEG"] * 3, ["p", "q", "r"], 224)
    assert s["outliers"] == {"small": ["q"], "extreme_aspect": ["r"]} and s["modes"] == {"RGB": 2, "L": 1}
    lines = advice(b, s, 224)
    assert not any("perceptual hash" in line for line in lines)  # median 640 x 200 px
    assert any("data.sampler=weighted" in line and "mean_class_acc" in line for line in lines)
    assert any("fewer than 20" in line and "dog" in line for line in lines)


@pytest.mark.slow
def test_multilabel_lists_are_audited_for_leaks_and_duplicates_and_counted_per_tag(tmp_path):
    """data.task=multilabel: the tag lists are read as training reads them; an exact leak and an in-split copy
    are found, classes are counted per tag, the clean list keeps the tags, and the label-error search says
    it is single-label only."""
    from multilabel_data import TAGS, make_tag_list

    root = tmp_path / "data"
    train_csv = make_tag_list(root, 24, name="train.csv")
    val_csv = make_tag_list(root, 8, name="val.csv", seed=1)
    rows = list(csv.reader(train_csv.open()))
    shutil.copy(root / rows[1][0], root / "images" / "leaked.png")       # a training image in validation
    shutil.copy(root / rows[2][0], root / "images" / "again.png")        # and one twice in training
    with val_csv.open("a", newline="") as f:
        csv.writer(f).writerow(["images/leaked.png", rows[1][1]])
    with train_csv.open("a", newline="") as f:
        csv.writer(f).writerow(["images/again.png", rows[2][1]])
    report, clean = tmp_path / "a.json", tmp_path / "clean.csv"
    done = audit("data.task=multilabel", "data.format=csv", f"data.root={root}", f"data.train_csv={train_csv}",
                 f"data.val_csv={val_csv}", "data.num_workers=0", "--json", str(report),
                 "--write-clean-csv", str(clean))
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(report.read_text())
    assert [(x["train"], x["val"], x["exact"]) for x in doc["leaks"]] == [([rows[1][0]], ["images/leaked.png"], True)]
    assert [sorted(g["paths"]) for g in doc["duplicates"]] == [sorted([rows[2][0], "images/again.png"])]
    tagged = [r[1].split() for r in rows[1:]] + [rows[2][1].split()]
    assert doc["class_counts"]["train"] == {t: sum(t in tags for tags in tagged) for t in TAGS}
    assert doc["label_issues"] == [] and "single-label" in doc["label_issues_note"]
    kept = list(csv.reader(clean.open()))
    assert kept[0] == ["path", "label"] and len(kept) == 1 + 24 - 1  # the leaked training copy is dropped
    assert dict(kept[1:])[rows[3][0]] == rows[3][1]                  # tags as the list wrote them


# ---------------------------------------------------------------- copies as groups, label conflicts, small images


def smooth_image(seed: int, size: int = 32) -> Image.Image:
    """A smooth photo-like RGB image (a few blurred blobs): its copies stay copies pixel by pixel."""
    from PIL import ImageFilter

    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    return Image.fromarray(small).resize((size, size), Image.Resampling.BICUBIC).filter(ImageFilter.GaussianBlur(1))


def test_many_copies_of_one_image_are_one_leak_group_not_pairs(tmp_path):
    """3,600 near-identical images made 1.8 million leak pairs (a 326 MB JSON): now one group per set of
    copies, with its members per split and a count."""
    root = tmp_path / "data"
    base = smooth_image(0)
    for split, n in (("train", 40), ("val", 30)):
        for cls in ("a", "b"):
            (root / split / cls).mkdir(parents=True)
        for i in range(n):  # distinct bytes: each a little brighter than the last
            from PIL import ImageEnhance

            ImageEnhance.Brightness(base).enhance(1 + i / 1000).save(root / split / "a" / f"{split}_{i}.png")
        for i in range(4):
            smooth_image(100 + i + (10 if split == "val" else 0)).save(root / split / "b" / f"{split}_other_{i}.png")
    report = tmp_path / "a.json"
    done = audit(*tiny_overrides(root, tmp_path / "unused"), "--folds", "0", "--json", str(report))
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(report.read_text())
    assert len(doc["leaks"]) == 1
    leak = doc["leaks"][0]
    assert leak["count"] == 70 and len(leak["train"]) == 40 and len(leak["val"]) == 30 and leak["splits"] == ["train", "val"]
    assert sorted((g["split"], len(g["paths"])) for g in doc["duplicates"]) == [("train", 40), ("val", 30)]
    assert report.stat().st_size < 40_000
    assert "1 leak group(s) across splits (70 images)" in done.stderr


def test_copies_under_different_labels_are_a_conflict_and_the_clean_list_says_which_class_it_empties(tmp_path):
    """The same images in four classes: duplicate groups named no labels and the clean list kept class 'a'
    only, three classes gone without a word."""
    root = tmp_path / "data"
    shared = [smooth_image(s) for s in (1, 2, 3)]
    for cls in ("a", "b", "c", "d"):
        (root / "train" / cls).mkdir(parents=True)
        (root / "val" / cls).mkdir(parents=True)
        for k, img in enumerate(shared):
            img.save(root / "train" / cls / f"shared_{k}.png")
        if cls != "d":  # 'd' has nothing but the shared copies
            for k in range(3):
                smooth_image(20 + 5 * ord(cls) + k).save(root / "train" / cls / f"own_{k}.png")
        smooth_image(200 + ord(cls)).save(root / "val" / cls / "v.png")
    report, clean = tmp_path / "a.json", tmp_path / "clean.csv"
    done = audit(*tiny_overrides(root, tmp_path / "unused"), "--folds", "0", "--json", str(report),
                 "--write-clean-csv", str(clean))
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(report.read_text())
    conflicts = sorted(doc["label_conflicts"], key=lambda c: c["paths"][0])
    assert len(conflicts) == 3
    for k, conflict in enumerate(conflicts):
        assert sorted(zip(conflict["paths"], conflict["labels"])) == [
            (f"train/{c}/shared_{k}.png", c) for c in "abcd"]
    kept = list(csv.DictReader(clean.open()))
    assert sorted({row["label"] for row in kept}) == ["a", "b", "c"] and len(kept) == 9  # no shared copy kept
    assert doc["clean_csv"]["classes_left_empty"] == ["d"]
    assert "holds no training image of class(es) d" in done.stderr
    assert "3 label conflict(s)" in done.stderr


def digit_image(index: int) -> Image.Image:
    from sklearn.datasets import load_digits

    d = load_digits().images[index]
    return Image.fromarray(np.clip(d * 255 / 16, 0, 255).round().astype(np.uint8)).convert("RGB").resize(
        (32, 32), Image.Resampling.BILINEAR)


def test_near_matches_on_32px_digits_are_confirmed_pixel_by_pixel(tmp_path):
    """8x8 digits scaled to 32 px: pHash put distinct digits 2-6 bits apart (136 of 147 reported leaks were
    distinct digits). Re-encodes, brightness changes and shifts of real copies are still found."""
    from PIL import ImageEnhance

    root = tmp_path / "data"
    for split in ("train", "val"):
        for cls in range(10):
            (root / split / str(cls)).mkdir(parents=True)
    from sklearn.datasets import load_digits

    targets = load_digits().target
    for i in range(300):  # train: digits 0..299, val: digits 300..599
        split, index = ("train", i) if i < 150 else ("val", i)
        digit_image(index).save(root / split / str(targets[index]) / f"d{index}.png")
    copies = {}
    for k, index in enumerate((3, 17, 42, 77, 120)):
        img, cls = digit_image(index), targets[index]
        a = np.asarray(img)
        kinds = {"jpeg": None, "bright": ImageEnhance.Brightness(img).enhance(1.15),
                 "jpeg40": None,
                 "darker": ImageEnhance.Brightness(img).enhance(0.85), "jpeg_shift": None}
        kind = list(kinds)[k]  # (a shift of 1-2 px moves a 32 px digit's pHash past 6 bits as often as not)
        name = f"val/{cls}/copy_{kind}_{index}" + (".jpg" if kind.startswith("jpeg") else ".png")
        out = kinds[kind] or (Image.fromarray(np.pad(a, ((0, 1), (0, 0), (0, 0)), mode="edge")[1:, :])
                              if kind == "jpeg_shift" else img)
        out.save(root / name, **({"quality": 40 if kind == "jpeg40" else 80} if name.endswith(".jpg") else {}))
        copies[f"train/{cls}/d{index}.png"] = name
    report = tmp_path / "a.json"
    done = audit(*tiny_overrides(root, tmp_path / "unused"), "--folds", "0", "--json", str(report))
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(report.read_text())
    found = {(leak["train"][0], leak["val"][0]) for leak in doc["leaks"] if leak["count"] == 2}
    assert found == set(copies.items()) and len(doc["leaks"]) == len(copies)
    assert doc["duplicates"] == []  # distinct digits inside a split: none grouped


@pytest.mark.parametrize("flag, target, role", [
    ("--json", "val.csv", "data list"), ("--html", "train.csv", "data list"),
    ("--write-clean-csv", "classes.txt", "classes file"), ("--write-clean-csv", "images/x.png", "data root"),
    ("--json", "images/new/report.json", "data root")])
def test_an_output_over_an_input_exits_2_naming_both_roles(tmp_path, flag, target, role):
    """The val list became JSON, the train list HTML, the classes file a CSV: only train_csv / val_csv were
    refused as --write-clean-csv, and nothing else anywhere."""
    root = tmp_path / "data"
    (root / "images").mkdir(parents=True)
    for i in range(6):
        class_image(i % 2).save(root / "images" / f"{i}.png")
    (root / "train.csv").write_text("path,label\n" + "".join(f"images/{i}.png,{'ab'[i % 2]}\n" for i in range(4)))
    (root / "val.csv").write_text("path,label\nimages/4.png,a\nimages/5.png,b\n")
    (root / "classes.txt").write_text("a\nb\n")
    shutil.copy(root / "images" / "0.png", root / "images" / "x.png")
    before = tree_digest(root)
    done = audit("data.format=csv", f"data.root={root}", f"data.train_csv={root / 'train.csv'}",
                 f"data.val_csv={root / 'val.csv'}", f"data.classes={root / 'classes.txt'}", "--folds", "0",
                 flag, str(root / target), timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert flag in done.stderr and role in done.stderr and "Traceback" not in done.stderr
    assert tree_digest(root) == before


def test_a_checkpoint_of_the_other_task_is_refused_for_the_label_search():
    """A multi-label (sigmoid) model gave 18 'label errors' on single-label data."""
    from imgcls.commands.audit import check_checkpoint_task
    from imgcls.core.errors import ConfigError
    from imgcls.tasks import get_task

    check_checkpoint_task(get_task("multiclass"), get_task("multiclass"), "m.pt")
    with pytest.raises(ConfigError, match="--checkpoint m.pt: a multi-label model, but the data is single-label"):
        check_checkpoint_task(get_task("multilabel"), get_task("multiclass"), "m.pt")


def test_a_class_of_copies_of_one_image_trains_in_every_fold_and_is_not_held_out():
    from imgcls.auditing.folds import ALWAYS_TRAINED, assign_folds

    digests = ["x", "y", "z", "w"] + ["same"] * 6
    labels = [0, 0, 0, 0] + [1] * 6
    folds = assign_folds(digests, labels, 2, seed=0)
    assert sorted(folds[:4]) == [0, 0, 1, 1] and folds[4:] == [ALWAYS_TRAINED] * 6


@pytest.mark.slow
def test_audit_with_a_class_of_identical_copies_writes_its_report(tmp_path):
    """--folds 2 where every image of class c is one image: exit 2 naming an internal temporary CSV, no report
    (fold 1's training lacked the class). Now c trains in every fold and its labels are said to be unchecked."""
    root = make_tree(tmp_path / "data", {"a": (8, 2), "b": (8, 2), "c": (8, 2)})
    one = (root / "train" / "c" / "c_0000.png").read_bytes()
    for path in [*(root / "train" / "c").iterdir(), *(root / "val" / "c").iterdir()]:
        path.write_bytes(one)
    report = tmp_path / "a.json"
    done = audit(*tiny_overrides(root, tmp_path / "unused", **{"train.batch_size": 4, "train.epochs": 1}),
                 "--folds", "2", "--json", str(report))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "every image of class(es) c is a copy of one image" in done.stderr
    doc = json.loads(report.read_text())
    assert "10 image(s) not checked" in doc["label_issues_note"]
    assert all(issue["given"] != "c" for issue in doc["label_issues"])


@pytest.mark.slow  # runs audit.py in a subprocess
def test_unlabelled_copies_of_validation_images_are_reported_and_shard_members_are_read(tmp_path):
    """data.unlabeled (semi-supervised training) must not hold validation images: an exact and a re-encoded copy
    are named, a copy of a training image is not; shard members are audited by their bytes."""
    import tarfile

    from imgcls.auditing.audit_data import unlabeled_items
    from imgcls.config import load_config

    root, pool = tmp_path / "data", tmp_path / "pool"
    for split, n in (("train", 4), ("val", 3)):
        for k, cls in enumerate(("a", "b")):
            (root / split / cls).mkdir(parents=True)
            for i in range(n):
                smooth_image(100 * k + 10 * (split == "val") + i).save(root / split / cls / f"{i}.png")
    pool.mkdir()
    shutil.copy(root / "val" / "a" / "1.png", pool / "exact.png")
    Image.open(root / "val" / "b" / "2.png").save(pool / "reencoded.jpg", quality=90)
    shutil.copy(root / "train" / "a" / "0.png", pool / "from_train.png")
    for i in range(3):
        smooth_image(500 + i).save(pool / f"new_{i}.png")
    report = tmp_path / "a.json"
    done = audit(*tiny_overrides(root, tmp_path / "unused", **{"semi.method": "fixmatch", "data.unlabeled": str(pool)}),
                 "--folds", "0", "--json", str(report), "--html", str(tmp_path / "a.html"))
    assert done.returncode == 0, done.stderr[-3000:]
    section = json.loads(report.read_text())["unlabeled"]
    found = {(leak["unlabeled"][0], leak["val"][0], leak["exact"]) for leak in section["leaks"]}
    assert found == {(str(pool / "exact.png"), "val/a/1.png", True),
                     (str(pool / "reencoded.jpg"), "val/b/2.png", False)}
    assert section["copies"] == 2 and section["images"] == 6 and section["unreadable"] == []
    assert "2 unlabelled image(s) of 6 (data.unlabeled) are copies of 2 held-out image(s)" in done.stderr
    assert "Unlabelled copies of held-out images" in (tmp_path / "a.html").read_text()
    with tarfile.open(tmp_path / "u-0.tar", "w") as tar:
        tar.add(pool / "exact.png", "000000.png")
        tar.add(pool / "reencoded.jpg", "000001.jpg")
    d = load_config("base", [f"data.unlabeled={tmp_path / 'u-0.tar'}", "semi.method=fixmatch"]).data
    items = unlabeled_items(d, tmp_path / "scratch")
    assert [item.name for item in items] == ["u-0.tar/000000.png", "u-0.tar/000001.jpg"]
    assert Path(items[1].file).read_bytes() == (pool / "reencoded.jpg").read_bytes() and items[1].split == "unlabeled"
