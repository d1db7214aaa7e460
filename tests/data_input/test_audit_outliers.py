"""audit.py's fold training is quiet and flags out-of-distribution images (issue 34)."""
from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import make_tree, run_script, tiny_overrides
from auditing.outliers import OUTLIER_Z, find_outliers, lowest_z, outliers_section, outliers_summary, robust_z


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
    assert all(o["score"] < -OUTLIER_Z for o in report["outliers"])
    assert any("out-of-distribution image(s)" in line for line in report["summary"])
    assert "Out-of-distribution images" in (out / "a.html").read_text()
