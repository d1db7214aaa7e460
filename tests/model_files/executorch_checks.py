"""export.py --format executorch [--quantize int8]: a .pte program lowered to XNNPACK with the metadata inside,
checked against the checkpoint before it is renamed into place; infer.py, eval.py and serve.py run it with the
checkpoint's rows; hostile and mismatched .pte files are refused (exit 2); a failed check leaves nothing.

Run by tests/model_files/test_edge_exports.py in a pytest process of its own, as the OpenVINO checks are: the
ExecuTorch runtime's XNNPACK thread pool never lives in a worker of the suite that goes on to fork."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import export_in_process, train_tiny

import eval as eval_script
import export
import imgcls.model_files.formats.executorch as executorch_format
import infer
from imgcls import Classifier
from imgcls.cli import run_main
from imgcls.core.errors import ConfigError
from imgcls.model_files.checkpoint_files import read_checkpoint
from imgcls.model_files.formats import FORMATS
from imgcls.model_files.loading import load_model_file
from imgcls.model_files.metadata import export_metadata
from imgcls.serving.model import ServedModel

CLASSES = ["a", "b", "c"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(data root, best.pt, fp32 dynamic-batch .pte, int8 batch-2 .pte, the int8 export's lines) of one run."""
    base = tmp_path_factory.mktemp("executorch")
    data, checkpoint = train_tiny(base, {name: (8, 6) for name in CLASSES}, **{"data.img_size": 32})
    fp32, int8 = base / "exports" / "fp32.pte", base / "exports" / "int8.pte"
    export_in_process(checkpoint, fp32, "executorch", "--dynamic-batch")
    printed = export_in_process(checkpoint, int8, "executorch", "--quantize", "int8", "--batch-size", "2",
                                "--calibration-images", "6", "--min-agreement", "0.5")
    return data, checkpoint, fp32, int8, printed


def _infer_rows(data: Path, model: Path, out: Path) -> dict:
    assert infer.main([str(data / "val"), "--checkpoint", str(model), "--output", str(out), "--num-workers", "0"]) == 0
    return {row["path"]: row for row in json.loads(out.read_text())}


def test_the_pte_carries_the_metadata_and_nothing_else_is_left(exported):
    _, checkpoint, fp32, int8, _ = exported
    assert sorted(p.name for p in fp32.parent.iterdir()) == ["fp32.pte", "int8.pte"]  # no staged file left
    reference = read_checkpoint(checkpoint)
    opened = load_model_file(fp32)
    assert opened.kind == "executorch" and opened.classes == CLASSES and opened.epoch == 1
    assert opened.fixed_batch is None and load_model_file(int8).fixed_batch == 2
    for key in ("img_size", "crop_pct", "interpolation", "mean", "std", "channels"):
        assert getattr(opened.cfg.data, key) == getattr(reference.cfg.data, key)
    assert opened.calibration["temperature"] == pytest.approx(reference.calibration["temperature"])
    # more images than the program plans memory for in one call run in chunks, each image as alone
    model = opened.build_model(torch.device("cpu"), channels_last=False)
    x = torch.randn(40, 3, 32, 32)
    with torch.inference_mode():
        whole, alone = model(x), torch.cat([model(x[i:i + 1]) for i in range(0, 40, 13)])
    assert whole.shape == (40, 3) and torch.allclose(whole[::13], alone, atol=1e-5)


def test_int8_is_quantized_smaller_and_its_agreement_is_recorded(exported):
    _, _, fp32, int8, printed = exported
    assert int8.stat().st_size < 0.35 * fp32.stat().st_size
    assert "calibrated on 6 images" in printed and "XNNPACK" in printed
    agreement = re.search(r"int8 top-1 agreement with fp32 ([\d.]+)% \((\d+)/(\d+)\)", printed)
    assert agreement and int(agreement.group(3)) == 18


def test_infer_eval_and_serve_give_the_checkpoints_answers(exported, tmp_path):
    data, checkpoint, fp32, int8, printed = exported
    want = _infer_rows(data, checkpoint, tmp_path / "ckpt.json")
    got = _infer_rows(data, fp32, tmp_path / "fp32.json")
    assert got.keys() == want.keys() and len(want) == 18
    for path, row in want.items():
        assert got[path]["label"] == row["label"] and got[path]["top2_label"] == row["top2_label"]
        assert got[path]["prob"] == pytest.approx(row["prob"], abs=1e-4)
    # the int8 program differs from the checkpoint on exactly the images export.py counted as disagreeing
    agree = int(re.search(r"agreement with fp32 [\d.]+% \((\d+)/18\)", printed).group(1))
    quantized = _infer_rows(data, int8, tmp_path / "int8.json")
    assert sum(quantized[p]["label"] == row["label"] for p, row in want.items()) == agree
    results = {}
    for name, model in (("checkpoint", checkpoint), ("pte", fp32)):
        out = tmp_path / f"{name}.json"
        assert eval_script.main(["--checkpoint", str(model), "--json", str(out)]) == 0
        results[name] = json.loads(out.read_text())
    assert results["pte"]["model_format"] == "executorch" and results["pte"]["num_samples"] == 18
    assert results["pte"]["confusion"] == results["checkpoint"]["confusion"]
    served = ServedModel.load(str(fp32), topk=5, max_batch=4)
    paths = sorted(want)[:3]
    rows = served.classify([served.decode(Path(p).read_bytes()) for p in paths], paths)
    assert [r["label"] for r in rows] == [want[p]["label"] for p in paths]
    with Classifier.load(fp32, device="cpu") as model:  # the Python API
        assert {r["path"]: r["label"] for r in model.predict(str(data / "val"))} == {
            p: r["label"] for p, r in want.items()}
    # the file computes no multi-layer reject score: --reject is refused (the checkpoint's score is not the
    # energy one), and the energy score asked for by name scores every row
    with pytest.raises(ConfigError, match="computes no mahalanobis_layers score"):
        infer.main([str(data / "val"), "--checkpoint", str(fp32), "--num-workers", "0", "--reject"])
    assert infer.main([str(data / "val"), "--checkpoint", str(fp32), "--output", str(tmp_path / "reject.json"),
                       "--num-workers", "0", "--reject-below", "0.5"]) == 0
    assert all(isinstance(r["score"], float) for r in json.loads((tmp_path / "reject.json").read_text()))


def _exit_and_line(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exited:
        run_main(lambda: infer.main(argv))
    return exited.value.code, capsys.readouterr().err.strip().splitlines()[-1]


class Tiny(torch.nn.Module):
    """A 3x32x32 -> `outputs` classifier, lowered in a second: another model's program."""

    def __init__(self, outputs: int):
        super().__init__()
        self.conv, self.head = torch.nn.Conv2d(3, 4, 3, stride=8), torch.nn.Linear(4 * 4 * 4, outputs)

    def forward(self, x):
        return self.head(self.conv(x).flatten(1))


def _tiny_pte(outputs: int, metadata) -> bytes:
    model = Tiny(outputs).eval()
    program = torch.export.export(model, (torch.zeros(1, 3, 32, 32),))
    if metadata is None:  # no metadata method: a program from elsewhere
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower

        return to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch().buffer
    return executorch_format.lower_to_pte(program, metadata, "", model)


def test_hostile_and_mismatched_files_are_refused_naming_why(exported, tmp_path, capsys):
    data, checkpoint, fp32, _, _ = exported
    metadata = export_metadata(read_checkpoint(checkpoint), 1)
    cases = {
        "truncated.pte": (fp32.read_bytes()[:fp32.stat().st_size // 2], "File size is too small"),
        "checkpoint.pte": (checkpoint.read_bytes(), "Program identifier"),
        "empty.pte": (b"", "not an ExecuTorch program"),
        "other_classes.pte": (_tiny_pte(5, metadata), "'classes' names 3 class(es), but the model has 5 outputs"),
        "foreign.pte": (_tiny_pte(3, None), "without the imgcls_metadata method"),
    }
    for name, (content, reason) in cases.items():
        (tmp_path / name).write_bytes(content)
        code, line = _exit_and_line([str(data / "val"), "--checkpoint", str(tmp_path / name)], capsys)
        assert code == 2 and reason in line and name in line, (name, line)


def test_a_failed_check_leaves_nothing_at_the_output(exported, tmp_path, capsys, monkeypatch):
    """A program that disagrees with the checkpoint (another model's weights, the right metadata): exit 1, no
    file at --output, no staged file beside it."""
    _, checkpoint, _, _, _ = exported

    def write_another_model(loaded, path, batch, metadata):
        path.write_bytes(_tiny_pte(3, metadata))
    monkeypatch.setitem(FORMATS, "executorch", dataclasses.replace(FORMATS["executorch"], write=write_another_model))
    out = tmp_path / "exports" / "m.pte"
    with pytest.raises(SystemExit) as exited:
        run_main(lambda: export.main(["--checkpoint", str(checkpoint), "--format", "executorch", "--output",
                                      str(out)]))
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert exited.value.code == 1
    assert "disagrees with the checkpoint" in line and f"nothing was written at {out}" in line
    assert list((tmp_path / "exports").iterdir()) == []


def four_band_multilabel(checkpoint: Path):
    """The run's checkpoint made a 4-band multi-label model (the stem's weights take a fourth band, the task and
    tag thresholds set): what a data.channels=4, data.task=multilabel run writes, without training one."""
    loaded = read_checkpoint(checkpoint)
    stem = loaded.state_dict["conv1.0.weight"]
    loaded.state_dict["conv1.0.weight"] = torch.cat([stem, stem[:, :1]], 1)
    d = loaded.cfg.data
    d.channels, d.mean, d.std = 4, [*d.mean, 0.5], [*d.std, 0.25]
    d.task, d.format, d.train_csv, d.val_csv, d.root = "multilabel", "csv", "train.csv", "val.csv", None
    loaded.thresholds = [0.3, 0.5, 0.7]
    return loaded


def test_a_four_band_multilabel_model_exports_and_runs_with_its_thresholds(exported, tmp_path):
    from imgcls.model_files.export import export_checkpoint

    _, checkpoint, _, _, _ = exported
    loaded = four_band_multilabel(checkpoint)
    report = export_checkpoint(loaded, "executorch", tmp_path / "tags.pte", 2)
    assert report.max_prob_diff <= 1e-4 and report.num_images == 8
    opened = load_model_file(tmp_path / "tags.pte")
    assert opened.cfg.data.channels == 4 and opened.cfg.data.task == "multilabel"
    assert opened.thresholds == [0.3, 0.5, 0.7] and opened.fixed_batch == 2
    x = torch.randn(3, 4, 32, 32)
    with torch.inference_mode():
        want = torch.sigmoid(read_checkpoint_model(loaded)(x))
        got = opened.task.probabilities(opened.build_model(torch.device("cpu"), False)(x).numpy())
    assert torch.allclose(torch.from_numpy(got), want, atol=1e-5)


def read_checkpoint_model(loaded):
    from imgcls.model_files.checkpoint_files import build_eval_model

    return build_eval_model(loaded, torch.device("cpu"), channels_last=False)
