"""One Predictor behind infer.py, serve.py and eval.py: the same images give the same rows through all three."""
from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import train_tiny

import eval as eval_script
import infer
from imgcls.model_files.predictor import Predictor
from imgcls.serving.model import ServedModel

CLASSES = ["a", "b", "c"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("predictor"), {name: (12, 4) for name in CLASSES})


def by_name(rows: list[dict]) -> dict:
    return {os.path.basename(r["path"]): r for r in rows}


def prediction_fields(row: dict) -> dict:
    return {k: v for k, v in row.items() if k in ("label", "prob") or k.startswith("top")}


@pytest.mark.slow
def test_infer_serve_and_eval_give_the_same_rows_for_the_same_images(trained, tmp_path):
    data, best = trained
    val = data / "val"
    files = sorted(p for p in val.rglob("*.png"))

    out = tmp_path / "infer.json"
    assert infer.main([str(val), "--checkpoint", str(best), "--output", str(out), "--num-workers", "0",
                       "--device", "cpu"]) == 0
    inferred = by_name(json.loads(out.read_text()))

    served = ServedModel.load(str(best), topk=5, max_batch=4, device_setting="cpu")
    rows = []
    for start in range(0, len(files), 4):
        chunk = files[start:start + 4]
        rows += served.classify([served.decode(p.read_bytes()) for p in chunk], [str(p) for p in chunk])
    assert by_name(rows).keys() == inferred.keys() == {p.name for p in files}
    for name, row in by_name(rows).items():
        assert prediction_fields(row) == prediction_fields(inferred[name]), name  # bit for bit: one model, one path

    predictions = tmp_path / "eval.json"
    assert eval_script.main(["--checkpoint", str(best), "--predictions", str(predictions)]) == 0
    evaluated = by_name(json.loads(predictions.read_text()))
    assert evaluated.keys() == inferred.keys()
    for name, row in evaluated.items():
        # eval.py runs the model as trained (BatchNorm not folded, to reproduce training's validation to the
        # last digit), infer.py and serve.py the folded one: the labels agree, the probabilities to rounding
        assert row["target"] == name.split("_")[0]
        assert [row[f"top{j}_label"] for j in (1, 2, 3)] == [inferred[name][f"top{j}_label"] for j in (1, 2, 3)]
        assert row["prob"] == pytest.approx(inferred[name]["prob"], abs=1e-5)


@pytest.mark.slow
def test_the_predictor_pads_a_short_batch_and_drops_the_padding(trained):
    """Rows for 3 images run in a batch shape of 4 equal the rows of the same images run alone."""
    _, best = trained
    predictor = Predictor.open(best, "cpu")
    size = predictor.transform.img_size
    images = [torch.full((3, size, size), 40 * i, dtype=torch.uint8) for i in range(3)]
    together = predictor.predict_images(images, ["x", "y", "z"], batch_shape=4)
    alone = [predictor.predict_images([image], [name])[0] for image, name in zip(images, "xyz")]
    assert [r["label"] for r in together] == [r["label"] for r in alone]
    assert [r["prob"] for r in together] == pytest.approx([r["prob"] for r in alone], abs=1e-6)
