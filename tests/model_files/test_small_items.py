"""Issue 34's small items: messages that read as what they mean."""
from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO


def test_a_rejected_row_names_its_would_be_label():
    from imgcls.tasks.rows import format_predictions_table

    rows = [{"path": "a.png", "label": "unknown", "predicted": "astronaut", "prob": 0.7601, "error": None},
            {"path": "b.png", "label": "cat", "predicted": "cat", "prob": 0.9, "error": None}]
    table = format_predictions_table(rows)
    assert "unknown (would be astronaut)  0.7601" in table
    assert "cat" in table.splitlines()[2] and "would be" not in table.splitlines()[2]


def test_eval_table_has_one_column_for_recall_and_class_accuracy():
    from imgcls.tasks.metrics import format_eval_table

    metrics = {"top1": 50.0, "top5": 100.0, "loss": 1.0, "mean_class_acc": 50.0, "num_samples": 4}
    per_class = {"a": {"count": 2, "accuracy": 100.0, "precision": 50.0, "recall": 100.0, "f1": 66.67}}
    table = format_eval_table(metrics, per_class, 2)
    assert "recall% (acc)" in table and "acc%" not in table.replace("recall% (acc)", "")
    assert table.splitlines()[-1].split() == ["a", "2", "100.00", "50.00", "66.67"]


def test_tune_help_states_the_median_rule():
    out = subprocess.run([sys.executable, str(REPO / "tune.py"), "--help"], capture_output=True, text=True,
                         cwd=REPO).stdout
    assert "lowest every size reached" not in out and "median" in " ".join(out.split())


@pytest.mark.parametrize("script,args", [("audit.py", ["--config", "base", "data.builtin=digits",
                                                       "data.root={tmp}/digits", "--folds", "0"]),
                                         ("serve.py", ["--checkpoint", "{tmp}/missing.pt", "--port", "0"])])
def test_audit_and_serve_say_they_are_loading_torch_first(tmp_path, script, args):
    proc = subprocess.Popen([sys.executable, str(REPO / script), *(a.format(tmp=tmp_path) for a in args)],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=REPO)
    try:
        first = proc.stderr.readline()
    finally:
        proc.kill()
        proc.wait()
    assert first.startswith(f"{script}: ") and first.rstrip().endswith("(loading torch...)")


def test_confusion_column_labels_stay_clear_of_the_grid(tmp_path):
    import torch
    from PIL import Image

    from imgcls.commands.evaluate import LABEL_GAP, draw_confusion

    classes = ["a", "bb", "a_long_class_name"]
    path = draw_confusion(torch.tensor([[3, 1, 0], [0, 2, 2], [1, 0, 5]]), classes, tmp_path / "c.png")
    img = Image.open(path).convert("L")
    width, height = img.size
    grid_top = height - 8 - 3 * 48                          # the image ends 8 px below a 3 x 48 px grid
    band = [img.getpixel((x, y)) for x in range(width) for y in range(grid_top - LABEL_GAP + 1, grid_top)]
    assert min(band) == 255                                # nothing drawn in the gap above the grid
    labels = [img.getpixel((x, y)) for x in range(width) for y in range(grid_top - 40, grid_top - LABEL_GAP)]
    assert min(labels) < 128                               # the labels themselves are there
