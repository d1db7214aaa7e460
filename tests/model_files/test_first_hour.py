"""What a newcomer's first hour asked for (issue 64): eval.py's precision-recall figures (per-class average
precision, macro PR-AUC, the PR-curve PNG), infer.py --save-images, image URLs classified like files, and
exports that reject as the checkpoint does (or refuse --reject)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import train_tiny
from PIL import Image
from sklearn.metrics import average_precision_score

from imgcls.cli import run_main

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


@pytest.mark.slow
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
    # without --json, beside the reliability diagram
    report_evaluation(evaluate_checkpoint(checkpoint, str(data)), None, str(tmp_path / "rel.png"), None)
    with Image.open(tmp_path / "rel_pr.png") as img:
        assert img.format == "PNG"


# ---------------------------------------------------------------- infer.py --save-images


@pytest.mark.slow
def test_save_images_draws_each_label_and_never_writes_over_an_input(trained, tmp_path, capsys):
    from imgcls.cli.infer import main as infer_main
    from imgcls.core.errors import ConfigError

    data, checkpoint = trained
    inputs = tmp_path / "inputs"
    for folder in ("x", "y"):  # one name in two folders: two files out
        (inputs / folder).mkdir(parents=True)
        Image.open(next((data / "val" / "a").iterdir())).save(inputs / folder / "same.png")
    (inputs / "broken.png").write_bytes(b"not an image")
    out = tmp_path / "annotated"
    rows_path = tmp_path / "rows.json"
    assert infer_main([str(inputs), "--checkpoint", str(checkpoint), "--save-images", str(out), "--output",
                       str(rows_path), "--num-workers", "0", "--device", "cpu"]) == 0
    rows = json.loads(rows_path.read_text())
    written = sorted(out.iterdir())
    assert len(written) == len([row for row in rows if row["error"] is None]) == 2
    assert {p.name.split("_", 1)[1] for p in written} == {"same.png"}
    for png in written:
        with Image.open(png) as img:
            assert img.mode == "RGB" and img.size == (24, 24)
            top = np.asarray(img)[:3]  # the caption's dark band is drawn over the image's top rows
            assert (top < 80).mean() > 0.5
    assert f"wrote 2 annotated image(s) to {out}" in capsys.readouterr().err

    with pytest.raises(ConfigError, match="--save-images .*input"):
        infer_main([str(inputs), "--checkpoint", str(checkpoint), "--save-images", str(inputs / "x"),
                    "--num-workers", "0", "--device", "cpu"])
    assert sorted(p.name for p in (inputs / "x").iterdir()) == ["same.png"]


def test_save_images_renders_many_bands_as_viewable_rgb(tmp_path):
    from types import SimpleNamespace

    from imgcls.commands.infer import save_annotated
    from imgcls.data.settings import DataConfig

    bands = np.zeros((20, 30, 4), dtype=np.uint16)
    bands[..., 0] = np.arange(30, dtype=np.uint16)[None, :] * 2000
    np.save(tmp_path / "bands.npy", bands)
    loaded = SimpleNamespace(cfg=SimpleNamespace(data=DataConfig(channels=4, mean="auto", std="auto")))
    rows = [{"path": str(tmp_path / "bands.npy"), "label": "a", "prob": 0.75, "error": None}]
    out = tmp_path / "out"
    assert save_annotated(loaded, [rows[0]["path"]], rows, str(out), [rows[0]["path"]]) == 1
    with Image.open(out / "00000_bands.png") as img:
        pixels = np.asarray(img)
        assert img.mode == "RGB" and img.size == (30, 20)
        assert pixels[-1, 0].max() < pixels[-1, -1].min()  # the first band's ramp, stretched to 8 bits


# ---------------------------------------------------------------- image URLs


@pytest.fixture
def image_server(trained, tmp_path):
    """A local HTTP server on 127.0.0.1 (a free port, a thread) serving a folder: (base URL, folder)."""
    import functools
    import http.server
    import threading

    folder = tmp_path / "site"
    folder.mkdir()
    data, _ = trained
    image = next((data / "val" / "b").iterdir())
    (folder / "cat.png").write_bytes(image.read_bytes())
    (folder / "notes.txt").write_text("not an image")
    (folder / "slow.png").write_bytes(image.read_bytes())

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/huge.png":  # claims more bytes than the limit
                self.send_response(200)
                self.send_header("Content-Length", str(10**9))
                self.end_headers()
                return
            if self.path == "/slow.png":
                import time

                time.sleep(2)
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", image
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.slow
def test_urls_are_classified_like_files_and_failures_are_error_rows(trained, image_server, monkeypatch):
    import imgcls.data.urls as urls
    from imgcls import Classifier

    base, image = image_server
    _, checkpoint = trained
    monkeypatch.setattr(urls, "URL_TIMEOUT_S", 1.0)
    inputs = [f"{base}/cat.png", f"{base}/missing.png", f"{base}/notes.txt", f"{base}/huge.png",
              f"{base}/slow.png", str(image)]
    with Classifier.load(checkpoint, device="cpu") as model:
        rows = model.predict(inputs)
    assert [row["path"] for row in rows] == inputs
    by_url = dict(zip(inputs, rows))
    assert by_url[inputs[0]]["error"] is None
    assert by_url[inputs[0]]["label"] == by_url[str(image)]["label"]
    assert by_url[inputs[0]]["prob"] == by_url[str(image)]["prob"]  # the same bytes, the same decoding
    assert "HTTP 404" in by_url[f"{base}/missing.png"]["error"]
    assert by_url[f"{base}/notes.txt"]["error"] and "imgcls-urls-" not in by_url[f"{base}/notes.txt"]["error"]
    assert "over the limit of 10000000" in by_url[f"{base}/huge.png"]["error"]
    assert "within 1 s" in by_url[f"{base}/slow.png"]["error"]


@pytest.mark.slow
def test_infer_py_takes_a_url_and_saves_it_annotated_by_its_name(trained, image_server, tmp_path, capsys):
    from imgcls.cli.infer import main as infer_main
    from imgcls.data.urls import MAX_URL_BYTES
    from imgcls.serving.app import ServeSettings

    assert MAX_URL_BYTES == ServeSettings().max_bytes  # one limit on an image from the network
    base, _ = image_server
    _, checkpoint = trained
    out = tmp_path / "annotated"
    assert infer_main([f"{base}/cat.png", f"{base}/missing.png", "--checkpoint", str(checkpoint), "--save-images",
                       str(out), "--num-workers", "0", "--device", "cpu"]) == 0
    printed = capsys.readouterr()
    assert f"{base}/cat.png" in printed.out and f"{base}/missing.png" in printed.out and "HTTP 404" in printed.out
    assert [p.name for p in out.iterdir()] == ["00000_cat.png"]


# ---------------------------------------------------------------- the reject option on exports


@pytest.fixture(scope="module")
def mixed(trained, tmp_path_factory):
    """Foreign images (noise, a flat colour, upscaled grey blocks) and three validation images."""
    data, _ = trained
    images = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8)).save(images / "noise.png")
    Image.new("RGB", (24, 24), (30, 200, 90)).save(images / "flat.png")
    blocks = np.kron(rng.integers(0, 256, (8, 8), dtype=np.uint8), np.ones((3, 3), dtype=np.uint8))
    Image.fromarray(blocks).save(images / "grey_blocks.png")
    for i, path in enumerate(sorted((data / "val" / "b").iterdir())[:3]):
        Image.open(path).save(images / f"val_{i}.png")
    return images


def _call(monkeypatch, capsys, module, *argv) -> tuple[int, str]:
    import importlib
    import sys

    main = importlib.import_module(f"imgcls.cli.{module}").main
    monkeypatch.setattr(sys, "argv", [f"{module}.py", *argv])
    with pytest.raises(SystemExit) as info:
        run_main(main)
    return info.value.code, capsys.readouterr().err


def _rows(monkeypatch, capsys, tmp_path, model, images, name) -> list[dict]:
    out = tmp_path / f"{name}.json"
    code, err = _call(monkeypatch, capsys, "infer", str(images), "--checkpoint", str(model), "--reject", "--output",
                      str(out), "--num-workers", "0", "--device", "cpu")
    assert code == 0, err[-2000:]
    assert "mahalanobis_layers score <" in err
    return json.loads(out.read_text())


@pytest.mark.slow
def test_onnx_export_rejects_what_the_checkpoint_rejects(trained, mixed, tmp_path, monkeypatch, capsys):
    from imgcls.model_files.loading import load_model_file

    (_, checkpoint), images = trained, mixed
    onnx = tmp_path / "model.onnx"
    code, err = _call(monkeypatch, capsys, "export", "--checkpoint", str(checkpoint), "--format", "onnx",
                      "--output", str(onnx), "--dynamic-batch")
    assert code == 0, err[-2000:]
    record = torch.load(checkpoint, weights_only=True)["calibration"]
    exported = load_model_file(onnx).calibration
    assert record["method"] == exported["method"] == "mahalanobis_layers"
    assert exported["thresholds"]["mahalanobis_layers"] == pytest.approx(record["thresholds"]["mahalanobis_layers"])

    want = _rows(monkeypatch, capsys, tmp_path, checkpoint, images, "checkpoint")
    got = _rows(monkeypatch, capsys, tmp_path, onnx, images, "onnx")
    assert [r["path"] for r in got] == [r["path"] for r in want]
    assert [r["label"] for r in got] == [r["label"] for r in want]
    foreign = [r for r in want if "val_" not in r["path"]]
    assert all(r["label"] == "unknown" for r in foreign)  # what the export used to keep (energy)
    for a, b in zip(got, want):
        assert a["score"] == pytest.approx(b["score"], rel=1e-3, abs=1e-3)


@pytest.mark.slow
def test_a_format_without_the_score_refuses_reject(trained):
    """pt2, OpenVINO, timm and int8 ONNX exports compute logits only: --reject exits 2 naming the checkpoint's
    score; --reject-below X rejects by energy, asked for by name."""
    from types import SimpleNamespace

    from imgcls.core.errors import ConfigError
    from imgcls.model_files.checkpoint_files import read_checkpoint
    from imgcls.model_files.metadata import export_metadata
    from imgcls.model_files.predictor import TrustOptions, build_rejector, check_trust_options

    _, checkpoint = trained
    record = export_metadata(read_checkpoint(str(checkpoint)), None, carries_reject=False)["calibration"]
    assert record["method"] == "energy" and record["checkpoint_method"] == "mahalanobis_layers"
    export = SimpleNamespace(calibration=record, path="model.pt2", kind="pt2")
    with pytest.raises(ConfigError, match="--reject: model.pt2 .pt2 export. computes no mahalanobis_layers score"):
        check_trust_options(export, TrustOptions(reject=True))
    check_trust_options(export, TrustOptions(reject_below=0.5))
    assert build_rejector(export, TrustOptions(reject_below=0.5), False, False).method == "energy"
