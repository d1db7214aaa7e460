"""audit.py's fold training is quiet and flags out-of-distribution images (issue 34)."""
from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch
from conftest import make_tree, run_script, tiny_overrides
from PIL import Image

from imgcls.auditing.duplicates import chroma, grayscale_outliers
from imgcls.auditing.folds import assign_folds, copy_keys
from imgcls.auditing.outliers import (OUTLIER_Z, find_outliers, lowest_z, merge_outliers, outliers_section,
                                      outliers_summary, robust_z, robust_z_by_class)


def test_robust_z_is_not_moved_by_the_outliers_themselves():
    scores = torch.cat([torch.linspace(-1, 1, 101), torch.tensor([-100.0, -200.0])])
    z = robust_z(scores)
    assert abs(float(z[50])) < 0.05 and float(z[101]) < -100 and float(z[102]) < float(z[101])
    two = lowest_z([scores, -scores])          # the lower of the two standardised views
    assert float(two[0]) < -1 and float(two[101]) < -100 and float(two[100]) < -1


def test_find_outliers_lists_the_most_foreign_first_and_renders():
    z = torch.tensor([0.5, -9.0, float("nan"), -6.5, -5.9])
    rows = find_outliers(["a", "b", "c", "d", "e"], ["train"] * 5, ["x"] * 5, z)
    assert [r["path"] for r in rows] == ["b", "d"] and rows[0]["score"] == -9.0
    page = outliers_section({"outliers": rows}, lambda name, caption: f"<figure>{name} {caption}</figure>")
    assert "Out-of-distribution images (2)" in page and page.index(">b ") < page.index(">d ")
    assert "not searched" in outliers_section({"outliers": None}, None)
    assert outliers_summary(rows).startswith("2 out-of-distribution image(s)")


def test_a_varied_class_is_judged_against_itself_not_the_pooled_fold():
    """Class 1 sits farther from its mean and spreads 3x wider than class 0: pooled, its ordinary images fell
    below -6 (the user's 19 of 21 flags); per class only the foreign image filed under class 0 does."""
    rng = np.random.default_rng(0)
    tight = torch.tensor(rng.normal(0, 1, 100))
    varied = torch.tensor(rng.normal(-6, 3, 30))
    scores = torch.cat([tight, torch.tensor([-30.0]), varied])
    labels = [0] * 101 + [1] * 30
    pooled = lowest_z([scores])
    per_class = lowest_z([scores], labels)
    assert int((pooled[101:] < -OUTLIER_Z).sum()) >= 2                      # varied ordinary images, flagged
    assert float(per_class[100]) < -OUTLIER_Z and int((per_class < -OUTLIER_Z).sum()) == 1
    few = robust_z_by_class(torch.tensor([0.0, 1.0, 2.0, -1.0]), [0, 0, 1, 1])  # classes too small: pooled
    assert torch.allclose(few, robust_z(torch.tensor([0.0, 1.0, 2.0, -1.0])))


def test_grayscale_images_in_a_class_of_colour_ones_are_flagged_however_stored():
    colour = class_like(0)
    gray_rgb = Image.fromarray(np.stack([np.asarray(colour.convert("L"))] * 3, axis=-1))
    assert chroma(colour) > 0.2 and chroma(gray_rgb) == 0.0 and chroma(colour.convert("L")) == 0.0
    names = [f"a/{i}.png" for i in range(10)] + ["a/gray.png", "b/0.png", "b/1.png"]
    given = ["a"] * 11 + ["b"] * 2
    values = [0.3] * 10 + [0.0, 0.0, 0.0]       # class b: too few images for a rule
    rows = grayscale_outliers(names, ["train"] * 13, given, values)
    assert [r["path"] for r in rows] == ["a/gray.png"]
    assert rows[0]["reason"] == "grayscale among colour images (10 of the 11 images of a are in colour)"
    assert grayscale_outliers(names, ["train"] * 13, given, [0.0] * 13) == []     # a grayscale data set
    merged = merge_outliers(find_outliers(["a/gray.png", "a/1.png"], ["train"] * 2, ["a"] * 2,
                                          torch.tensor([-8.0, 0.0])), rows)
    assert len(merged) == 1 and merged[0]["score"] == -8.0 and "grayscale" in merged[0]["reason"]
    assert merge_outliers(None, rows)[0]["score"] is None and merge_outliers(None, []) is None
    assert "grayscale among colour images: 1" in outliers_summary(merge_outliers(None, rows))


def test_near_copies_share_a_fold():
    """A resized copy of a mislabelled image in the training folds teaches the fold model its wrong label."""
    names = [f"a/{i}.png" for i in range(8)]
    digests = [f"d{i}" for i in range(8)]
    dups = [{"split": "train", "paths": ["a/1.png", "a/6.png"]}]
    leaks = [{"train": ["a/2.png"], "val": ["a/7.png"], "splits": ["train", "val"]}]
    keys = copy_keys(names, digests, dups, leaks)
    assert keys[1] == keys[6] and keys[2] == keys[7] and keys[0] == "d0"
    for seed in range(5):
        folds = assign_folds(keys, [0] * 8, 4, seed)
        assert folds[1] == folds[6] and folds[2] == folds[7]


def class_like(label: int) -> Image.Image:
    from conftest import class_image

    return class_image(label)


def foreign_image(kind: int, size: int = 24) -> Image.Image:
    """Not like any class_image: a black-and-white checkerboard, or a grey gradient."""
    if kind == 0:
        board = (np.indices((size, size)).sum(0) // 3 % 2 * 255).astype(np.uint8)
        return Image.fromarray(np.stack([board] * 3, axis=-1))
    ramp = np.tile(np.linspace(0, 255, size, dtype=np.uint8), (size, 1))
    return Image.fromarray(np.stack([ramp] * 3, axis=-1))


@pytest.mark.slow
def test_audit_folds_are_quiet_and_flag_foreign_images(tmp_path):
    data = make_tree(tmp_path / "data", {"a": (24, 6), "b": (24, 6), "c": (24, 6)})
    foreign = []
    for kind in (0, 1):
        path = data / "train" / "a" / f"foreign{kind}.png"
        foreign_image(kind).save(path)
        foreign.append(f"train/a/foreign{kind}.png")
    class_like(1).save(data / "train" / "c" / "planted.png")
    out = tmp_path / "out"
    result = run_script("audit.py", "--config", "base", *tiny_overrides(data, tmp_path / "unused",
                                                                       **{"train.batch_size": 8, "optim.lr": 0.1}),
                        "--folds", "2", "--fold-epochs", "4", "--json", str(out / "a.json"),
                        "--html", str(out / "a.html"), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    err = result.stderr
    assert err.count("audit fold ") == 2 and "audit fold 2/2: trained on" in err
    assert "done:" not in err and "WARNING" not in err and "epoch 1/4" not in err
    report = json.loads((out / "a.json").read_text())
    flagged = [o["path"] for o in report["outliers"]]
    assert set(foreign) <= set(flagged), report["outliers"]
    assert len(flagged) <= len(foreign) + 3, report["outliers"]          # few ordinary images among them
    assert all(o["score"] is None or o["score"] < -OUTLIER_Z for o in report["outliers"])
    reasons = {o["path"]: o["reason"] for o in report["outliers"]}
    assert all("grayscale among colour images" in reasons[p] for p in foreign), reasons
    # the planted label error: a class-b image filed under c, found by cleanlab on out-of-fold probabilities
    issues = {i["path"]: i for i in report["label_issues"]}
    assert "train/c/planted.png" in issues and issues["train/c/planted.png"]["suggested"] == "b", issues
    assert any("out-of-distribution image(s)" in line for line in report["summary"])
    assert "Out-of-distribution images" in (out / "a.html").read_text()


def test_the_summary_counts_the_grayscale_images_the_report_lists(tmp_path):
    """Issue 64: with no model search (--folds 0) the grayscale rule still lists images, and the summary on
    stderr and in the HTML header counted the model's list (none) and said "no grayscale image among colour ones"
    beside a report listing them."""
    data = make_tree(tmp_path / "data", {"a": (24, 4), "b": (24, 4)})
    gray = [f"train/a/gray{i}.png" for i in range(2)]
    for name in gray:
        class_like(0).convert("L").save(data / name)
    out = tmp_path / "out"
    result = run_script("audit.py", "--config", "base", *tiny_overrides(data, tmp_path / "unused"), "--folds", "0",
                        "--json", str(out / "a.json"), "--html", str(out / "a.html"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "a.json").read_text())
    assert sorted(o["path"] for o in report["outliers"]) == gray
    line = next(line for line in report["summary"] if "out-of-distribution" in line)
    assert line.startswith("2 out-of-distribution image(s)") and "grayscale among colour images: 2" in line, line
    assert "not searched by a model" in line and "no grayscale image" not in line
    assert line in result.stderr and line in (out / "a.html").read_text()
    assert outliers_summary(None, searched=False).endswith("no grayscale image among colour ones")
