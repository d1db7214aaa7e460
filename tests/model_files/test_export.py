"""export.py: ONNX, torch.export and timm-folder exports round-trip; eval.py and infer.py give the same
metrics and labels from each; timm's own loader reproduces the model; bad input (an output over a run
directory or an earlier export, a timm folder at odds with itself, a foreign ONNX of fixed non-square inputs)
exits as INTERFACE.md says."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
import torch
from conftest import REPO, Payload, train_tiny, write_pretrained_folder

import eval as eval_script
import export
import imgcls.model_files.export as engine_export
import imgcls.model_files.formats.base as export_formats_base
import infer
from imgcls.cli import run_main
from imgcls.core.errors import CheckpointError, ConfigError, ExportError
from imgcls.data.listing import list_images
from imgcls.data.transforms import normalize_batch
from imgcls.model_files.checkpoint_files import build_eval_model, read_checkpoint
from imgcls.model_files.loading import load_model_file

CLASSES = ["a", "b", "c"]
# (format, output name, batch option): a fixed-batch ONNX, a dynamic-batch program, a timm folder
EXPORTS = {"onnx": ("model.onnx", ["--batch-size", "4"]), "pt2": ("model.pt2", ["--dynamic-batch"]),
           "timm": ("model_timm", [])}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(data root, best.pt, {format: exported path}) of one tiny run, exported once in each format."""
    base = tmp_path_factory.mktemp("export")
    previous = os.umask(0o022)  # what test_checkpoints_and_exports_follow_the_umask checks the modes against
    try:
        data, checkpoint = train_tiny(base, {name: (12, 4) for name in CLASSES})
        exports = {}
        for fmt, (name, options) in EXPORTS.items():
            out = base / "exports" / name
            assert export.main(["--checkpoint", str(checkpoint), "--format", fmt, "--output", str(out),
                                *options]) == 0
            exports[fmt] = out
    finally:
        os.umask(previous)
    return data, checkpoint, exports


def _val_batch(data, loaded):
    transform = loaded.eval_transform()
    paths = list_images(data / "val")
    images = torch.stack([transform(p) for p in paths])
    return normalize_batch(images, loaded.cfg.data.mean, loaded.cfg.data.std), paths


def _checkpoint_probs(checkpoint, data):
    loaded = read_checkpoint(checkpoint)
    x, _ = _val_batch(data, loaded)
    with torch.inference_mode():
        return build_eval_model(loaded, torch.device("cpu"), channels_last=False)(x).softmax(1)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", list(EXPORTS))
def test_each_export_round_trips_with_its_metadata(trained, fmt):
    data, checkpoint, exports = trained
    want = _checkpoint_probs(checkpoint, data)
    opened = load_model_file(exports[fmt])
    assert opened.kind == fmt and opened.classes == CLASSES and opened.epoch == 1
    reference = read_checkpoint(checkpoint)
    for key in ("img_size", "crop_pct", "interpolation", "mean", "std"):
        assert getattr(opened.cfg.data, key) == getattr(reference.cfg.data, key)
    assert opened.cfg.data.root == str(data)  # eval.py finds the data as for the checkpoint
    x, _ = _val_batch(data, opened)
    with torch.inference_mode():
        got = opened.build_model(torch.device("cpu"), channels_last=True)(x).softmax(1)
    assert (got - want).abs().max().item() < 1e-4
    assert got.argmax(1).tolist() == want.argmax(1).tolist()
    assert opened.fixed_batch == (4 if fmt == "onnx" else None)


@pytest.mark.slow
def test_onnx_metadata_props_hold_classes_and_preprocessing(trained):
    _, checkpoint, exports = trained
    props = {p.key: p.value for p in onnx.load(str(exports["onnx"])).metadata_props}
    assert json.loads(props["imgcls.classes"]) == CLASSES
    preprocessing = json.loads(props["imgcls.preprocessing"])
    assert preprocessing == torch.load(checkpoint, weights_only=True)["preprocessing"]
    assert set(preprocessing) >= {"img_size", "resize", "mean", "std", "interpolation"}


@pytest.mark.slow
def test_timm_create_model_reproduces_the_model_from_the_folder(trained):
    """timm's own loader and its own preprocessing, nothing of ours, on the exported folder."""
    import timm
    from PIL import Image

    data, checkpoint, exports = trained
    config = json.loads((exports["timm"] / "config.json").read_text())
    assert config["architecture"] == "resnet10t" and config["num_classes"] == 3 and config["label_names"] == CLASSES
    cfg = config["pretrained_cfg"]
    assert cfg["input_size"] == [3, 16, 16] and cfg["crop_pct"] == 0.875 and cfg["interpolation"] == "bilinear"
    assert (exports["timm"] / "model.safetensors").is_file()
    model = timm.create_model(f"local-dir:{exports['timm']}", pretrained=True).eval()
    transform = timm.data.create_transform(**timm.data.resolve_data_config(model=model))
    paths = list_images(data / "val")
    x = torch.stack([transform(Image.open(p).convert("RGB")) for p in paths])
    with torch.inference_mode():
        got = model(x).softmax(1)
    want = _checkpoint_probs(checkpoint, data)
    assert (got - want).abs().max().item() < 1e-4
    assert model.pretrained_cfg["label_names"] == CLASSES


@pytest.mark.slow
def test_plain_onnxruntime_with_the_metadata_preprocessing_agrees_with_infer(trained, tmp_path):
    """A deployer's client: onnxruntime, PIL and numpy only, preprocessing read from the model's metadata."""
    import numpy as np
    import onnxruntime as ort
    from PIL import Image

    data, checkpoint, exports = trained
    session = ort.InferenceSession(str(exports["onnx"]), providers=["CPUExecutionProvider"])
    meta = session.get_modelmeta().custom_metadata_map
    classes, prep = json.loads(meta["imgcls.classes"]), json.loads(meta["imgcls.preprocessing"])
    batch = session.get_inputs()[0].shape[0]
    paths = list_images(data / "val")
    arrays = []
    for path in paths:
        img = Image.open(path).convert("RGB")
        scale = prep["resize"] / min(img.size)
        img = img.resize((round(img.width * scale), round(img.height * scale)), Image.BILINEAR)
        left, top = round((img.width - prep["img_size"]) / 2), round((img.height - prep["img_size"]) / 2)
        img = img.crop((left, top, left + prep["img_size"], top + prep["img_size"]))
        pixels = (np.asarray(img, dtype=np.float32) / 255 - prep["mean"]) / prep["std"]
        arrays.append(pixels.transpose(2, 0, 1).astype(np.float32))
    arrays += [np.zeros_like(arrays[0])] * (-len(arrays) % batch)
    logits = np.concatenate([session.run(None, {"images": np.stack(arrays[i:i + batch])})[0]
                             for i in range(0, len(arrays), batch)])[:len(paths)]
    out = tmp_path / "rows.json"
    assert infer.main([str(data / "val"), "--checkpoint", str(checkpoint), "--num-workers", "0",
                       "--output", str(out)]) == 0
    assert [classes[i] for i in logits.argmax(1)] == [r["label"] for r in json.loads(out.read_text())]


@pytest.mark.slow
def test_eval_and_infer_give_the_same_metrics_and_labels_from_every_export(trained, tmp_path):
    data, checkpoint, exports = trained
    results = {}
    for name, path in {"checkpoint": checkpoint, **exports}.items():
        doc_path, rows_path = tmp_path / f"{name}.json", tmp_path / f"{name}_rows.json"
        assert eval_script.main(["--checkpoint", str(path), "--json", str(doc_path), "data.num_workers=0"]) == 0
        assert infer.main([str(data / "val"), "--checkpoint", str(path), "--batch-size", "3", "--topk", "3",
                           "--num-workers", "0", "--output", str(rows_path)]) == 0
        results[name] = json.loads(doc_path.read_text()), json.loads(rows_path.read_text())
    want_doc, want_rows = results["checkpoint"]
    for name, (doc, rows) in results.items():
        assert doc["model_format"] == name
        for key in ("top1", "top5", "mean_class_acc", "num_samples", "confusion", "classes"):
            assert doc[key] == want_doc[key], (name, key)
        assert doc["loss"] == pytest.approx(want_doc["loss"], abs=1e-5)
        assert [r["label"] for r in rows] == [r["label"] for r in want_rows]
        assert [r["top3_label"] for r in rows] == [r["top3_label"] for r in want_rows]
        assert [r["prob"] for r in rows] == pytest.approx([r["prob"] for r in want_rows], abs=1e-4)


@pytest.mark.slow
def test_a_fixed_batch_onnx_model_sets_infer_batch(trained, caplog):
    data, _, exports = trained
    assert infer.main([str(data / "val" / "a"), "--checkpoint", str(exports["onnx"]), "--batch-size", "3",
                       "--num-workers", "0"]) == 0
    assert "fixed batch of 4: using --batch-size 4, not 3" in caplog.text


@pytest.mark.slow
def test_checkpoints_and_exports_follow_the_umask(trained):
    _, checkpoint, exports = trained
    files = [checkpoint, checkpoint.parent / "last.pt", exports["onnx"], exports["pt2"],
             *sorted(exports["timm"].iterdir())]
    assert {p.name for p in exports["timm"].iterdir()} >= {"config.json", "model.safetensors"}
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: "0o644" for p in files}


@pytest.mark.slow
def test_eval_and_infer_state_the_batch_a_fixed_batch_export_runs(trained, capsys, caplog):
    data, _, exports = trained
    assert eval_script.main(["--checkpoint", str(exports["onnx"]), "--batch-size", "5", "data.num_workers=0"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert ": batch 4 (fixed by the export)," in header
    assert ", precision fp32," in header            # full precision named as such, not by train.amp's `none`
    assert "exported for a fixed batch of 4: using --batch-size 4, not 5" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO"):
        assert infer.main([str(data / "val"), "--checkpoint", str(exports["onnx"]), "--num-workers", "0"]) == 0
    assert "classifying 12 file(s) in batches of 4 (fixed by the export) on cpu (fp32)" in caplog.text


@pytest.mark.slow
def test_top5_is_named_top5_everywhere_with_k_beside_it(trained, capsys, tmp_path):
    _, checkpoint, _ = trained
    doc_path = tmp_path / "eval.json"
    assert eval_script.main(["--checkpoint", str(checkpoint), "--json", str(doc_path), "data.num_workers=0"]) == 0
    table = capsys.readouterr().out
    assert "top5 (k=3) " in table and "top3" not in table
    doc = json.loads(doc_path.read_text())
    summary = json.loads((checkpoint.parent / "summary.json").read_text())
    assert doc["top5_k"] == summary["top5_k"] == 3
    assert doc["top5"] == summary["best"]["top5"] == 100.0  # 3 classes: the true class is always in the top 3
    assert " top5 (k=3) 100.00 " in (checkpoint.parent / "train.log").read_text()


@pytest.mark.slow
def test_onnx_without_our_metadata_gets_numbered_or_named_classes(trained, tmp_path, caplog, capsys):
    data, _, exports = trained
    model = onnx.load(str(exports["onnx"]))
    del model.metadata_props[:]
    foreign = tmp_path / "foreign.onnx"
    onnx.save(model, str(foreign))
    out = tmp_path / "rows.json"
    args = [str(data / "val" / "b"), "--checkpoint", str(foreign), "--num-workers", "0", "--output", str(out)]
    assert infer.main(args) == 0
    assert "records no class names: using class_0 .. class_2 (pass --classes FILE" in caplog.text
    assert "no imgcls metadata" in caplog.text and "img_size 16 (the model's input size)" in caplog.text
    assert {r["label"] for r in json.loads(out.read_text())} <= {"class_0", "class_1", "class_2"}
    names = tmp_path / "names.txt"
    names.write_text("a\nb\nc\n")
    assert infer.main([*args, "--classes", str(names)]) == 0
    assert {r["label"] for r in json.loads(out.read_text())} <= set(CLASSES)
    names.write_text("a\nb\n")
    with pytest.raises(ConfigError, match="2 name.*3 outputs"):
        infer.main([*args, "--classes", str(names)])


def _exit(main, args, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exited:
        run_main(lambda: main(args))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return exited.value.code, err.strip().splitlines()[-1]


@pytest.mark.slow
def test_bad_model_files_exit_2_with_one_line(trained, tmp_path, capsys):
    data, checkpoint, exports = trained
    model = onnx.load(str(exports["onnx"]))
    model.opset_import[0].version = 99
    future = tmp_path / "future.onnx"
    onnx.save(model, str(future))
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a model")
    plain = tmp_path / "plain.pt"
    torch.save({"weights": torch.zeros(2)}, plain)
    not_timm = tmp_path / "folder"
    not_timm.mkdir()
    expected = {future: "stamped with ONNX opset 99, and this onnxruntime runs opsets up to",
                garbage: "cannot load this model", plain: "not a checkpoint written by train.py",
                not_timm: "without config.json: not a timm model folder"}
    for path, message in expected.items():
        code, line = _exit(infer.main, [str(data / "val"), "--checkpoint", str(path)], capsys)
        assert code == 2 and message in line, line
        code, line = _exit(eval_script.main, ["--checkpoint", str(path)], capsys)
        assert code == 2 and message in line, line
    code, line = _exit(export.main, ["--checkpoint", str(exports["onnx"]), "--format", "pt2", "--output",
                                     str(tmp_path / "x.pt2")], capsys)
    assert code == 2 and "is an ONNX model; export.py takes a checkpoint written by train.py" in line
    code, line = _exit(export.main, ["--checkpoint", str(checkpoint), "--format", "onnx", "--output",
                                     str(tmp_path / "x.pt2")], capsys)
    assert code == 2 and "must end in .onnx" in line


@pytest.mark.slow
def test_a_torchvision_model_cannot_be_a_timm_folder(trained, tmp_path, capsys):
    _, checkpoint, _ = trained
    ckpt = torch.load(checkpoint, weights_only=True)
    ckpt["config"]["model"]["name"] = "tv:resnet18"
    tv_checkpoint = tmp_path / "tv.pt"
    torch.save(ckpt, tv_checkpoint)
    code, line = _exit(export.main, ["--checkpoint", str(tv_checkpoint), "--format", "timm", "--output",
                                     str(tmp_path / "folder")], capsys)
    assert code == 2 and "'tv:resnet18' is a torchvision model" in line and "--format onnx or pt2" in line


class DataDependentGate(torch.nn.Module):
    def forward(self, x):
        if x.mean() > 0:  # control flow on a value: torch.export cannot trace it
            return x
        return -x


class GatedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.features = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), DataDependentGate())
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.features(x).mean((2, 3)))


@pytest.mark.slow
def test_an_unexportable_model_exits_1_naming_the_layer(trained, tmp_path, capsys, monkeypatch):
    _, checkpoint, _ = trained
    monkeypatch.setattr(export_formats_base, "build_eval_model", lambda *a, **k: GatedNet().eval())
    code, line = _exit(export.main, ["--checkpoint", str(checkpoint), "--format", "pt2", "--output",
                                     str(tmp_path / "gated.pt2")], capsys)
    assert code == 1 and line.startswith("error: pt2 export failed: ")
    assert "in layer 'features.1' (DataDependentGate)" in line and "if x.mean() > 0" in line


@pytest.mark.slow
def test_an_export_that_disagrees_fails(trained, monkeypatch):
    _, checkpoint, exports = trained
    monkeypatch.setattr(engine_export, "MAX_PROB_DIFF", -1.0)
    with pytest.raises(ExportError, match="disagrees with the checkpoint: max |probability difference|"):
        engine_export.check_export(read_checkpoint(checkpoint), "onnx", exports["onnx"], 4)


@pytest.mark.slow
def test_training_and_checkpoint_inference_never_import_onnx():
    code = ("import sys, train, imgcls.training.trainer, imgcls.commands.infer, imgcls.commands.evaluate, imgcls.model_files.loading; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'onnx', 'onnxruntime', 'onnxscript', 'onnx_ir'}))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.slow
def test_export_help_is_instant_and_imports_nothing_heavy():
    code = "import sys, export; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


def test_pt2_garbage_and_missing_export_are_usage_errors(tmp_path):
    garbage = tmp_path / "garbage.pt2"
    garbage.write_bytes(b"PK not really")
    with pytest.raises(CheckpointError, match="not a torch.export program"):
        load_model_file(garbage)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model_file(tmp_path / "missing.onnx")


@pytest.mark.slow
def test_onnx_metadata_naming_fewer_classes_than_outputs_exits_2(trained, tmp_path, capsys):
    """imgcls.classes shorter than the model's output: an IndexError traceback in infer.py."""
    data, _, exports = trained
    model = onnx.load(str(exports["onnx"]))
    for prop in model.metadata_props:
        if prop.key == "imgcls.classes":
            prop.value = json.dumps(CLASSES[:2])
    short = tmp_path / "short.onnx"
    onnx.save(model, str(short))
    for main, args in ((infer.main, [str(data / "val" / "b"), "--num-workers", "0"]), (eval_script.main, [])):
        code, line = _exit(main, [*args, "--checkpoint", str(short)], capsys)
        assert code == 2 and "names 2 class(es), but the model has 3 outputs" in line


@pytest.mark.slow
def test_a_timm_export_onto_a_full_disk_is_one_line(trained, tmp_path, capsys, monkeypatch):
    """safetensors' SafetensorError (no space left) was a traceback; the ONNX path said it in one line."""
    import safetensors.torch

    _, checkpoint, _ = trained

    def full_disk(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                                          "message: \"No space left on device\" })")
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    code, line = _exit(export.main, ["--checkpoint", str(checkpoint), "--format", "timm", "--output",
                                     str(tmp_path / "timm_out")], capsys)
    assert code == 1 and line.startswith("error: timm export to ") and "No space left on device" in line


def test_an_export_never_lands_on_its_own_checkpoint(tmp_path):
    from imgcls.commands.output_roles import check_export_outputs

    run = tmp_path / "run"
    run.mkdir()
    (run / "best.pt").write_bytes(b"x")
    with pytest.raises(ConfigError, match="--output .*holds the checkpoint"):
        check_export_outputs(str(run / "best.pt"), str(run), folder_output=True)
    with pytest.raises(ConfigError, match="--output .*is the checkpoint"):
        check_export_outputs(str(run / "best.pt"), str(run / "best.pt"), folder_output=False)
    check_export_outputs(str(run / "best.pt"), str(tmp_path / "model.onnx"), folder_output=False)


def test_export_offers_every_registered_export_format():
    """export.py lists its --format choices without importing torch (--help is instant); they are the formats
    registered with a writer."""
    import imgcls.cli.export as export
    from imgcls.model_files.formats import export_formats

    assert list(export.EXPORT_FORMATS) == export_formats()


@pytest.mark.slow
def test_an_export_never_overwrites_silently_nor_writes_into_a_run_directory(trained, tmp_path, capsys):
    data, checkpoint, _ = trained
    run_dir = checkpoint.parent
    before = sorted(p.name for p in run_dir.iterdir())
    for fmt, output in (("timm", run_dir), ("onnx", run_dir / "model.onnx"), ("timm", run_dir / "sub" / "..")):
        code, line = _exit(export.main, ["--checkpoint", str(checkpoint), "--format", fmt, "--output", str(output)],
                           capsys)
        assert code == 2 and "is a run directory (it holds last.pt)" in line, line
    assert sorted(p.name for p in run_dir.iterdir()) == before
    onnx_out = tmp_path / "m.onnx"
    assert export.main(["--checkpoint", str(checkpoint), "--format", "onnx", "--output", str(onnx_out)]) == 0
    first = onnx_out.read_bytes()
    code, line = _exit(export.main, ["--checkpoint", str(checkpoint), "--format", "onnx", "--output", str(onnx_out)],
                       capsys)
    assert code == 2 and f"--output {onnx_out} exists; pass --overwrite" in line
    assert onnx_out.read_bytes() == first
    assert export.main(["--checkpoint", str(checkpoint), "--format", "onnx", "--output", str(onnx_out),
                        "--overwrite"]) == 0
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    code, line = _exit(export.main, ["--checkpoint", str(checkpoint), "--format", "timm", "--output", str(busy),
                                     "--overwrite"], capsys)
    assert code == 2 and "holds other files (notes.txt)" in line
    assert sorted(p.name for p in busy.iterdir()) == ["notes.txt"]


# ---------------------------------------------------------------- timm folders and ONNX files made elsewhere

@pytest.fixture
def timm_folder(tmp_path) -> Path:
    folder = tmp_path / "timm_model"
    write_pretrained_folder(folder, num_classes=3, label_names=["a", "b", "c"])
    return folder


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def refusals(folder: Path) -> list[str]:
    """The messages of infer/eval's loader and of model.pretrained=true model.name=local-dir:FOLDER."""
    from imgcls.config import load_config
    from imgcls.core.errors import ModelError
    from imgcls.models.factory import load_pretrained

    said = []
    for load in (lambda: load_model_file(folder),
                 lambda: load_pretrained(load_config("base", [f"model.name=local-dir:{folder}",
                                                              "model.pretrained=true"]).model)):
        with pytest.raises(ModelError) as err:
            load()
        said.append(str(err.value))
    return said


def test_a_timm_folder_whose_config_disagrees_with_its_weights_exits_2_naming_it(timm_folder):
    """num_classes 7 over 3-class weights silently got a random classifier."""
    edit_config(timm_folder, num_classes=7)
    for said in refusals(timm_folder):
        assert "config.json: num_classes 7 but model_args.num_classes 3" in said
    edit_config(timm_folder, num_classes=3, label_names=["a", "b"])
    for said in refusals(timm_folder):
        assert "num_classes 3 but 2 label_names" in said
    # a folder without model_args (an older timm): the classifier's shape tells
    edit_config(timm_folder, num_classes=7, label_names=[f"n{i}" for i in range(7)], model_args={})
    for said in refusals(timm_folder):
        assert "config.json (architecture and num_classes 7) and model.safetensors disagree" in said
        assert "[3, " in said and "(config.json: [7, " in said


def test_timm_folders_with_cut_mismatched_or_pickled_weights_exit_2_in_one_line(timm_folder):
    import pickle

    from safetensors.torch import load_file, save_file

    weights = timm_folder / "model.safetensors"
    state = {k: v.clone() for k, v in load_file(str(weights)).items()}  # not mapped: the file is cut below
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    for said in refusals(timm_folder):
        assert "damaged or truncated safetensors file" in said
    conv = next(k for k, v in state.items() if v.ndim == 4)
    save_file(dict(state, **{conv: torch.zeros(5, *state[conv].shape[1:])}), str(weights))
    for said in refusals(timm_folder):
        assert "disagree on" in said and conv in said
    weights.unlink()
    (timm_folder / "pytorch_model.bin").write_bytes(pickle.dumps(Payload(timm_folder / "ran"), protocol=2))
    for said in refusals(timm_folder):
        assert "was refused" in said and "pytorch_model.bin" in said
    assert not (timm_folder / "ran").exists()


def test_a_foreign_onnx_with_a_fixed_non_square_input_exits_2(tmp_path):
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("GlobalAveragePool", ["images"], ["pooled"]),
         helper.make_node("Flatten", ["pooled"], ["logits"])], "foreign",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 64, 48])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "foreign.onnx"
    onnx.save(model, str(path))
    with pytest.raises(CheckpointError, match="fixed 64x48 \\(height x width\\) inputs"):
        load_model_file(path)
