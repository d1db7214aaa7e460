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


@pytest.fixture(scope="module")
def api_run(tmp_path_factory):
    """(data root, run directory, summary) of one train() call."""
    from imgcls import train

    base = tmp_path_factory.mktemp("api")
    data = make_tree(base / "data", {"a": (8, 4), "b": (8, 4)})
    out = base / "run"
    summary = train({"data": {"root": str(data), "img_size": 16, "num_workers": 0},
                     "model": {"name": "resnet10t"}, "output": {"dir": str(out), "progress_bar": False}},
                    {"train.epochs": 1, "train.batch_size": 8, "train.device": "cpu", "train.amp": "none"})
    return data, out, summary


@pytest.mark.slow
def test_train_then_classifier_predicts_the_rows_infer_py_writes(api_run, tmp_path):
    from imgcls import Classifier, train

    data, out, summary = api_run
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




def test_arguments_of_another_type_raise_our_type_error_before_any_work(tmp_path):
    from imgcls import Classifier, load_config, train
    from imgcls.core.errors import ConfigError, InputTypeError

    for call, match in ((lambda: train("quickstart", 5), "overrides = 5"), (lambda: train(5), "config = 5"),
                        (lambda: train("quickstart", ["train.epochs=1", 3]), "KEY=VALUE strings"),
                        (lambda: train("quickstart", resume=7), "resume = 7"),
                        (lambda: Classifier.load(None), "path = None"), (lambda: Classifier.load(3.5), "path = 3.5")):
        with pytest.raises(InputTypeError, match=match) as caught:
            call()
        assert isinstance(caught.value, TypeError) and isinstance(caught.value, ConfigError)
    assert load_config("quickstart", "train.epochs=4").train.epochs == 4  # one string is one override
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_predict_and_embed_take_bytes_pil_images_arrays_and_tensors_and_refuse_other_types(api_run):
    """main: predict(bytes) listed every byte as a path, a PIL image or an array raised a bare TypeError, predict([])
    answered a row of an empty name."""
    import numpy as np
    from PIL import Image

    from imgcls import Classifier
    from imgcls.core.errors import InputTypeError

    data, out, _ = api_run
    png = sorted((data / "val" / "a").glob("*.png"))[0]
    pixels = np.asarray(Image.open(png).convert("RGB"))
    with Classifier.load(out / "best.pt", device="cpu") as model:
        want = model.predict(str(png))[0]["prob"]
        assert model.predict([]) == [] and model.embed([])[0] == []
        rows = model.predict([png.read_bytes(), Image.open(png), pixels, pixels.astype(np.float32) / 255,
                              torch.from_numpy(pixels).permute(2, 0, 1).float() / 255, str(png),
                              np.stack([pixels, pixels]), np.full(pixels.shape, np.nan, np.float32)])
        assert [r["path"] for r in rows] == ["<image 0>", "<image 1>", "<image 2>", "<image 3>", "<image 4>",
                                             str(png), "<image 6.0>", "<image 6.1>", "<image 7>"]
        assert [r["prob"] for r in rows[:-1]] == pytest.approx([want] * 8, abs=1e-5)
        assert "not finite" in rows[-1]["error"] and rows[-1]["label"] is None
        names, vectors = model.embed([png.read_bytes(), str(png)])
        assert names == ["<image 0>", str(png)] and np.allclose(vectors[0], vectors[1], atol=1e-5)
        for bad, match in ((None, "images is None"), (5, "images is 5"), ([str(png), 3.5], "item 1 is 3.5"),
                           ({"a": 1}, "images is {'a': 1}")):
            with pytest.raises(InputTypeError, match=match):
                model.predict(bad)
