"""The Python API (imgcls/): train from a config dict, load the checkpoint, predict infer.py's rows (the
console command: tests/config_cli/test_package.py)."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tree, run_script


def test_load_config_takes_a_dict_and_names_a_wrong_key():
    from imgcls import load_config
    from imgcls.core.errors import ConfigError

    cfg = load_config({"model": {"name": "resnet10t"}, "train": {"epochs": 3}}, {"data.img_size": 48})
    assert (cfg.model.name, cfg.train.epochs, cfg.data.img_size) == ("resnet10t", 3, 48)
    with pytest.raises(ConfigError, match="train.epoch"):
        load_config("base", {"train.epoch": 3})


@pytest.mark.slow
def test_train_then_classifier_predicts_the_rows_infer_py_writes(tmp_path):
    from imgcls import Classifier, train

    data = make_tree(tmp_path / "data", {"a": (8, 4), "b": (8, 4)})
    out = tmp_path / "run"
    summary = train({"data": {"root": str(data), "img_size": 16, "num_workers": 0},
                     "model": {"name": "resnet10t"}, "output": {"dir": str(out), "progress_bar": False}},
                    {"train.epochs": 1, "train.batch_size": 8, "train.device": "cpu", "train.amp": "none"})
    assert summary["epochs_completed"] == 1 and (out / "best.pt").exists()
    images = str(data / "val")
    with Classifier.load(out / "best.pt", device="cpu") as model:
        assert model.classes == ["a", "b"]
        rows = model.predict(images)
        paths, vectors = model.embed(images)
    assert paths == [r["path"] for r in rows] and vectors.shape[0] == len(rows)
    assert torch.allclose(torch.from_numpy(vectors).norm(dim=1), torch.ones(len(rows)), atol=1e-5)
    done = run_script("infer.py", images, "--checkpoint", str(out / "best.pt"), "--device", "cpu",
                      "--output", str(tmp_path / "rows.json"))
    assert done.returncode == 0, done.stderr[-2000:]
    expected = json.loads((tmp_path / "rows.json").read_text())
    assert [(r["path"], r["label"]) for r in rows] == [(r["path"], r["label"]) for r in expected]
    assert [r["prob"] for r in rows] == pytest.approx([r["prob"] for r in expected], abs=1e-6)
    from imgcls.core.errors import ConfigError

    with pytest.raises(ConfigError, match="holds checkpoints of another run"):  # usage errors raise, as exit 2
        train({"data": {"root": str(data)}, "output": {"dir": str(out)}}, {"train.epochs": 1})


