"""What users of other tools look for first: eval.py's precision-recall figures (per-class average precision,
macro PR-AUC, the PR-curve PNG), infer.py --save-images, and image URLs classified like files."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import train_tiny
from PIL import Image
from sklearn.metrics import average_precision_score

CLASSES = ["a", "b", "c"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(data root, best.pt) of one tiny run shared by the module."""
    return train_tiny(tmp_path_factory.mktemp("first_hour"), {name: (8, 5) for name in CLASSES})


def _probabilities(rows: list[dict]) -> np.ndarray:
    """The [N, C] probabilities of infer.py's rows (3 classes: the top-3 columns hold every class)."""
    probs = np.zeros((len(rows), len(CLASSES)))
    for i, row in enumerate(rows):
        for j in range(1, len(CLASSES) + 1):
            probs[i, CLASSES.index(row[f"top{j}_label"])] = row[f"top{j}_prob"]
    return probs


def test_eval_json_has_sklearns_average_precision_and_a_pr_figure(trained, tmp_path):
    from imgcls.commands.evaluate import evaluate_checkpoint, report_evaluation

    data, checkpoint = trained
    out, rows_path = tmp_path / "eval.json", tmp_path / "rows.json"
    report_evaluation(evaluate_checkpoint(checkpoint, str(data)), str(out), None, str(rows_path))
    doc, rows = json.loads(out.read_text()), json.loads(rows_path.read_text())
    probs = _probabilities(rows)
    targets = np.array([CLASSES.index(row["target"]) for row in rows])
    expected = {name: average_precision_score(targets == c, probs[:, c]) for c, name in enumerate(CLASSES)}
    assert doc["average_precision"] == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert {name: doc["per_class"][name]["average_precision"] for name in CLASSES} == doc["average_precision"]
    macro = average_precision_score(np.eye(len(CLASSES))[targets], probs, average="macro")
    assert doc["pr_auc_macro"] == pytest.approx(macro, rel=1e-12)
    with Image.open(tmp_path / "eval_pr.png") as img:
        img.load()
        assert img.format == "PNG" and img.width > 100 and img.height > 100
