"""export.py --format litert: a .tflite model (litert-torch, a fixed batch) with the metadata in its metadata
table, checked against the checkpoint before it is renamed into place; infer.py, eval.py and serve.py run it
with the checkpoint's rows; hostile and mismatched .tflite files are refused (exit 2); a failed check leaves
nothing.

Run by test_edge_exports.py under the opt-in marker litert: the [litert] extra is not in [all] (litert-torch pins
older pydantic, anyio and typing_extensions); .ci/run adds it before its second run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import export_in_process, train_tiny
from executorch_checks import CLASSES, four_band_multilabel, read_checkpoint_model

import eval as eval_script
import export
import imgcls.model_files.export as export_module
import infer
from imgcls.cli import run_main
from imgcls.model_files.checkpoint_files import read_checkpoint
from imgcls.model_files.formats.litert import METADATA_NAME, with_metadata
from imgcls.model_files.loading import load_model_file
from imgcls.model_files.metadata import export_metadata
from imgcls.serving.model import ServedModel


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    base = tmp_path_factory.mktemp("litert")
    data, checkpoint = train_tiny(base, {name: (8, 6) for name in CLASSES}, **{"data.img_size": 32})
    model = base / "exports" / "m.tflite"
    printed = export_in_process(checkpoint, model, "litert", "--batch-size", "4")
    return data, checkpoint, model, printed


def _infer_rows(data: Path, model: Path, out: Path) -> dict:
    assert infer.main([str(data / "val"), "--checkpoint", str(model), "--output", str(out), "--num-workers", "0"]) == 0
    return {row["path"]: row for row in json.loads(out.read_text())}


def test_the_tflite_carries_the_metadata_and_nothing_else_is_left(exported):
    _, checkpoint, model, printed = exported
    assert [p.name for p in model.parent.iterdir()] == ["m.tflite"]
    assert "(litert, batch 4, 3 classes" in printed and "limit 1e-04" in printed
    reference = read_checkpoint(checkpoint)
    opened = load_model_file(model)
    assert opened.kind == "litert" and opened.classes == CLASSES and opened.fixed_batch == 4
    for key in ("img_size", "crop_pct", "interpolation", "mean", "std"):
        assert getattr(opened.cfg.data, key) == getattr(reference.cfg.data, key)
    assert opened.calibration["temperature"] == pytest.approx(reference.calibration["temperature"])


def test_infer_eval_and_serve_give_the_checkpoints_answers(exported, tmp_path):
    data, checkpoint, model, _ = exported
    want = _infer_rows(data, checkpoint, tmp_path / "ckpt.json")
    got = _infer_rows(data, model, tmp_path / "tflite.json")  # 18 images in padded batches of 4
    assert got.keys() == want.keys() and len(want) == 18
    for path, row in want.items():
        assert got[path]["label"] == row["label"] and got[path]["top2_label"] == row["top2_label"]
        assert got[path]["prob"] == pytest.approx(row["prob"], abs=1e-4)
    results = {}
    for name, path in (("checkpoint", checkpoint), ("tflite", model)):
        out = tmp_path / f"{name}.json"
        assert eval_script.main(["--checkpoint", str(path), "--json", str(out)]) == 0
        results[name] = json.loads(out.read_text())
    assert results["tflite"]["model_format"] == "litert" and results["tflite"]["num_samples"] == 18
    assert results["tflite"]["confusion"] == results["checkpoint"]["confusion"]
    served = ServedModel.load(str(model), topk=5, max_batch=4)
    paths = sorted(want)[:3]
    rows = served.classify([served.decode(Path(p).read_bytes()) for p in paths], paths)
    assert [r["label"] for r in rows] == [want[p]["label"] for p in paths]


def _without_our_metadata(content: bytes) -> bytes:
    import flatbuffers
    from ai_edge_litert import schema_py_generated as schema

    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs(content, 0))
    model.metadata = [m for m in model.metadata if m.name != METADATA_NAME.encode()]
    builder = flatbuffers.Builder(len(content))
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def test_hostile_and_mismatched_files_are_refused_naming_why(exported, tmp_path, capsys):
    data, checkpoint, model, _ = exported
    content = model.read_bytes()
    metadata = export_metadata(read_checkpoint(checkpoint), 4)
    cases = {
        "truncated.tflite": (content[:len(content) // 2], "not a valid Flatbuffer"),
        "checkpoint.tflite": (checkpoint.read_bytes(), "no TFL3 identifier"),
        "empty.tflite": (b"", "no TFL3 identifier"),
        "other_classes.tflite": (with_metadata(content, {**metadata, "classes": ["a", "b"]}),
                                 "'classes' names 2 class(es), but the model has 3 outputs"),
        "foreign.tflite": (_without_our_metadata(content), "without imgcls metadata"),
    }
    for name, (blob, reason) in cases.items():
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(SystemExit) as exited:
            run_main(lambda: infer.main([str(data / "val"), "--checkpoint", str(tmp_path / name)]))
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert exited.value.code == 2 and reason in line and name in line, (name, line)


def test_dynamic_batch_is_refused_and_a_failed_check_leaves_nothing(exported, tmp_path, capsys, monkeypatch):
    _, checkpoint, _, _ = exported
    out = tmp_path / "exports" / "m.tflite"
    argv = ["--checkpoint", str(checkpoint), "--format", "litert", "--output", str(out)]
    for options, code, says in ((["--dynamic-batch"], 2, "fixed batch only"),
                                ([], 1, f"nothing was written at {out}")):
        if code == 1:
            monkeypatch.setattr(export_module, "MAX_PROB_DIFF", -1.0)  # every export now disagrees
        with pytest.raises(SystemExit) as exited:
            run_main(lambda: export.main(argv + options))
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert exited.value.code == code and says in line, line
        assert not out.parent.exists() or list(out.parent.iterdir()) == []


def test_a_four_band_multilabel_model_exports_and_runs_with_its_thresholds(exported, tmp_path):
    from imgcls.model_files.export import export_checkpoint

    _, checkpoint, _, _ = exported
    loaded = four_band_multilabel(checkpoint)
    report = export_checkpoint(loaded, "litert", tmp_path / "tags.tflite", 2)
    assert report.max_prob_diff <= 1e-4
    opened = load_model_file(tmp_path / "tags.tflite")
    assert opened.cfg.data.channels == 4 and opened.thresholds == [0.3, 0.5, 0.7]
    x = torch.randn(3, 4, 32, 32)
    with torch.inference_mode():
        want = torch.sigmoid(read_checkpoint_model(loaded)(x))
        got = opened.task.probabilities(opened.build_model(torch.device("cpu"), False)(x).numpy())
    assert torch.allclose(torch.from_numpy(got), want, atol=1e-5)
