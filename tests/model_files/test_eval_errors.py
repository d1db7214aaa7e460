"""eval.py's misclassified images (issue 34): a CSV and an HTML gallery beside --json, worst first."""
from __future__ import annotations

import csv

import pytest
import torch
from conftest import make_tree, run_script, train_tiny

from imgcls.commands.evaluate import misclassified, write_errors
from imgcls.evaluation.rejection import SplitOutputs


def test_rows_are_the_wrong_predictions_most_confidently_wrong_first(tmp_path):
    make_tree(tmp_path / "d", {"a": 2, "b": 2}, splits=("val",))
    paths = sorted(str(p) for p in (tmp_path / "d" / "val").rglob("*.png"))
    logits = torch.tensor([[3.0, 0.0], [0.0, 1.0], [0.0, 4.0], [0.0, 2.0]])
    labels = torch.tensor([0, 0, 1, 0])   # samples 1 and 3 are wrong; 3 more confidently
    rows = misclassified(SplitOutputs(logits, labels, torch.arange(4), None), paths, ["a", "b"], None)
    assert [r["path"] for r in rows] == [paths[3], paths[1]]
    assert rows[0]["label"] == "a" and rows[0]["predicted"] == "b"
    assert rows[0]["prob_label"] == pytest.approx(float(torch.tensor([0.0, 2.0]).softmax(0)[0]), abs=1e-4)
    csv_path, html_path = write_errors(rows, tmp_path / "eval.json")
    assert [r["path"] for r in csv.DictReader(csv_path.open())] == [paths[3], paths[1]]
    page = html_path.read_text()
    assert page.count("data:image/jpeg;base64,") == 2 and page.index(paths[3]) < page.index(paths[1])


@pytest.mark.slow
def test_eval_py_writes_the_errors_beside_its_json(tmp_path):
    data, best = train_tiny(tmp_path, {"a": (12, 8), "b": (12, 8), "c": (12, 8)})
    out = tmp_path / "eval.json"
    result = run_script("eval.py", "--checkpoint", str(best), "--json", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    rows = list(csv.DictReader((tmp_path / "eval_errors.csv").open()))
    assert "misclassified image(s) to" in result.stdout
    import json

    doc = json.loads(out.read_text())
    assert len(rows) == round(doc["num_samples"] * (100 - doc["top1"]) / 100)
    probs = [float(r["prob_label"]) for r in rows]
    assert probs == sorted(probs)
    assert (tmp_path / "eval_errors.html").read_text().count("<figure>") == len(rows)


def test_only_a_single_label_task_lists_misclassified_images():
    """eval.py asks the task: a multi-label model has no one top-1 label to be wrong about, so no _errors files."""
    from imgcls.tasks import get_task

    assert get_task("multiclass").supports("misclassified images")
    assert not get_task("multilabel").supports("misclassified images")
