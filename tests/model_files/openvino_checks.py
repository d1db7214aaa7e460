"""export.py --format openvino [--quantize int8]: an IR folder with the metadata, checked against the checkpoint;
NNCF's int8 IR with its agreement; infer.py, eval.py and serve.py run the folder or its .xml with the
checkpoint's rows; a layer OpenVINO cannot carry exits 2 leaving nothing; openvino loads only on its paths.

Run by tests/model_files/test_openvino.py in a pytest process of its own: OpenVINO's runtime, loaded in a
process, can make that process's later forks crash (SIGSEGV in an xdist worker that went on to start
subprocesses), so it never loads in a worker of the suite."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, export_in_process, train_tiny

import eval as eval_script
import export
import imgcls.model_files.formats.openvino as openvino_format
import infer
from imgcls.cli import run_main
from imgcls.core.errors import ConfigError
from imgcls.model_files.checkpoint_files import read_checkpoint
from imgcls.model_files.formats import format_of
from imgcls.model_files.loading import load_model_file
from imgcls.model_files.predictor import Predictor
from imgcls.serving.model import ServedModel

CLASSES = ["a", "b", "c"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(data root, best.pt, fp32 IR folder, int8 IR folder, int8 export's printed lines) of one tiny run."""
    base = tmp_path_factory.mktemp("openvino")
    # 32 px: at 16 px resnet10t's last average pool sees a 1x1 map, which OpenVINO refuses (a test below)
    data, checkpoint = train_tiny(base, {name: (8, 6) for name in CLASSES}, **{"data.img_size": 32})
    fp32, int8 = base / "exports" / "fp32", base / "exports" / "int8"
    export_in_process(checkpoint, fp32, "openvino", "--dynamic-batch")
    printed = export_in_process(checkpoint, int8, "openvino", "--quantize", "int8", "--calibration-images", "6",
                                "--min-agreement", "0.5")
    return data, checkpoint, fp32, int8, printed


def _infer_rows(data: Path, model: Path, out: Path) -> dict:
    assert infer.main([str(data / "val"), "--checkpoint", str(model), "--output", str(out), "--num-workers", "0"]) == 0
    return {row["path"]: row for row in json.loads(out.read_text())}


@pytest.mark.slow
def test_fp32_ir_is_a_folder_with_the_metadata_and_nothing_else(exported):
    _, checkpoint, fp32, _, _ = exported
    assert sorted(p.name for p in fp32.parent.iterdir()) == ["fp32", "int8"]  # no staging folder left
    assert sorted(p.name for p in fp32.iterdir()) == ["model.bin", "model.xml"]
    reference = read_checkpoint(checkpoint)
    for path in (fp32, fp32 / "model.xml"):  # the folder or its .xml
        assert format_of(path).name == "openvino"
        opened = load_model_file(path)
        assert opened.kind == "openvino" and opened.classes == CLASSES and opened.epoch == 1
        assert opened.fixed_batch is None
        for key in ("img_size", "crop_pct", "interpolation", "mean", "std"):
            assert getattr(opened.cfg.data, key) == getattr(reference.cfg.data, key)
        assert opened.calibration["temperature"] == pytest.approx(reference.calibration["temperature"])
    assert "<imgcls>" in (fp32 / "model.xml").read_text()  # the metadata sits in the IR's rt_info


@pytest.mark.slow
def test_int8_ir_is_quantized_smaller_and_its_agreement_is_recorded(exported):
    _, _, fp32, int8, printed = exported
    assert "FakeQuantize" in (int8 / "model.xml").read_text()
    assert "FakeQuantize" not in (fp32 / "model.xml").read_text()
    assert (int8 / "model.bin").stat().st_size < 0.5 * (fp32 / "model.bin").stat().st_size
    assert "calibrated on 6 images" in printed and "NNCF" in printed
    agreement = re.search(r"int8 top-1 agreement with fp32 ([\d.]+)% \((\d+)/(\d+)\)", printed)
    assert agreement and int(agreement.group(3)) == 18
    assert load_model_file(int8).classes == CLASSES


@pytest.mark.slow
def test_infer_on_the_ir_gives_the_checkpoints_rows(exported, tmp_path):
    data, checkpoint, fp32, int8, printed = exported
    want = _infer_rows(data, checkpoint, tmp_path / "ckpt.json")
    got = _infer_rows(data, fp32 / "model.xml", tmp_path / "fp32.json")
    assert got.keys() == want.keys() and len(want) == 18
    for path, row in want.items():
        assert got[path]["label"] == row["label"] and got[path]["top2_label"] == row["top2_label"]
        assert got[path]["prob"] == pytest.approx(row["prob"], abs=1e-4)
    # the int8 IR differs from the checkpoint on exactly the images export.py counted as disagreeing with fp32
    agree = int(re.search(r"agreement with fp32 [\d.]+% \((\d+)/18\)", printed).group(1))
    quantized = _infer_rows(data, int8, tmp_path / "int8.json")
    assert sum(quantized[p]["label"] == row["label"] for p, row in want.items()) == agree


@pytest.mark.slow
def test_eval_and_serve_open_the_ir(exported, tmp_path):
    data, checkpoint, fp32, _, _ = exported
    results = {}
    for name, model in (("checkpoint", checkpoint), ("ir", fp32)):
        out = tmp_path / f"{name}.json"
        assert eval_script.main(["--checkpoint", str(model), "--json", str(out)]) == 0
        results[name] = json.loads(out.read_text())
    assert results["ir"]["model_format"] == "openvino" and results["ir"]["num_samples"] == 18
    assert results["ir"]["top1"] == results["checkpoint"]["top1"]
    assert results["ir"]["confusion"] == results["checkpoint"]["confusion"]
    rows = _infer_rows(data, checkpoint, tmp_path / "rows.json")
    served = ServedModel.load(str(fp32), topk=5, max_batch=4)
    paths = sorted(rows)[:3]
    got = served.classify([served.decode(Path(p).read_bytes()) for p in paths], paths)
    assert [r["label"] for r in got] == [rows[p]["label"] for p in paths]


@pytest.mark.slow
def test_the_ir_runs_with_the_thread_policys_count_in_fp32(exported):
    _, _, fp32, _, _ = exported
    for threads in (1, 2):
        predictor = Predictor.open(str(fp32), device_setting="cpu", overrides=[f"train.threads={threads}"])
        compiled = predictor.model.function.compiled
        assert predictor.runtime.threads == threads
        assert compiled.get_property("INFERENCE_NUM_THREADS") == threads
        assert str(compiled.get_property("INFERENCE_PRECISION_HINT")) == "<Type: 'float32'>"
        assert str(compiled.get_property("PERFORMANCE_HINT")) == "LATENCY"


class Digamma(torch.nn.Module):
    """torch.digamma: an operator OpenVINO's PyTorch frontend has no conversion rule for."""

    def forward(self, x):
        return torch.digamma(x.abs() + 1)


class WithDigammaTail(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.tail = Digamma()

    def forward(self, x):
        return self.tail(self.model(x))


@pytest.mark.slow
def test_a_layer_openvino_cannot_carry_exits_2_naming_it_and_leaves_nothing(exported, tmp_path, capsys,
                                                                            monkeypatch):
    _, checkpoint, _, _, _ = exported
    real = openvino_format.traced_model
    monkeypatch.setattr(openvino_format, "traced_model",
                        lambda loaded, batch: (WithDigammaTail(real(loaded, batch)[0]), real(loaded, batch)[1]))
    out = tmp_path / "exports" / "ir"
    for options in ([], ["--quantize", "int8"]):
        with pytest.raises(SystemExit) as exited:
            run_main(lambda: export.main(["--checkpoint", str(checkpoint), "--format", "openvino", "--output",
                                          str(out), *options]))
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert exited.value.code == 2
        assert "cannot carry this model" in line and "aten.digamma.default" in line and "'tail' (Digamma)" in line
        assert list((tmp_path / "exports").iterdir()) == []


@pytest.mark.slow
def test_a_shape_openvino_refuses_at_the_input_size_names_the_layer(exported, tmp_path):
    """resnet10t at 16 px: its last ResNet-D downsample pools 2x2 over a 1x1 map, which PyTorch's ceil_mode
    allows and OpenVINO's shape check refuses."""
    _, checkpoint, _, _, _ = exported
    loaded = read_checkpoint(checkpoint)
    loaded.cfg.data.img_size = 16
    with pytest.raises(ConfigError, match=r"at 16 px: operator aten.avg_pool2d.default in layer "
                                          r"'layer4.0.downsample.0' \(AvgPool2d\) refused: Kernel"):
        openvino_format.write_openvino(loaded, tmp_path / "ir", None, {})
    assert not (tmp_path / "ir").exists()


@pytest.mark.slow
def test_help_and_other_formats_never_import_openvino(exported):
    _, checkpoint, _, _, _ = exported
    code = ("import contextlib, io, sys, export, infer, eval, serve\n"
            "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
            "    export.main(['--help'])\n"
            "from imgcls.model_files.loading import load_model_file\n"
            "from imgcls.model_files.export import check_export\n"
            "import imgcls.commands.export, imgcls.commands.infer, imgcls.commands.evaluate, imgcls.serving.model\n"
            f"load_model_file({str(checkpoint)!r})\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'openvino', 'nncf'}))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def _copy_ir(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


def _refused(model: Path, data: Path, out: Path, capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        run_main(lambda: infer.main([str(data / "val"), "--checkpoint", str(model), "--output", str(out),
                                     "--num-workers", "0"]))
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err and not out.exists(), err[-2000:]
    return err


@pytest.mark.slow
def test_an_ir_whose_weights_were_replaced_or_grown_is_refused(exported, tmp_path, capsys):
    """The IR records its model.bin's sha256: another model's weights of the same size (here: the same file
    with other values), or a longer file, run with this IR's classes and calibration otherwise."""
    import numpy as np

    data, _, fp32, int8, _ = exported
    assert openvino_format.WEIGHTS_DIGEST in (fp32 / "model.xml").read_text()
    assert openvino_format.WEIGHTS_DIGEST in (int8 / "model.xml").read_text()
    swapped, grown = _copy_ir(fp32, tmp_path / "swapped"), _copy_ir(fp32, tmp_path / "grown")
    weights = np.fromfile(swapped / "model.bin", dtype=np.uint8).copy()
    weights[len(weights) // 2:len(weights) // 2 + 4096] ^= 0x21  # other weights, the same length
    weights.tofile(swapped / "model.bin")
    with open(grown / "model.bin", "ab") as f:
        f.write(bytes(4096))
    for model in (swapped, grown / "model.xml"):
        assert "is not the weights this IR was exported with" in _refused(model, data, tmp_path / "rows.json", capsys)
    assert load_model_file(fp32).classes == CLASSES  # the untouched IR opens


@pytest.mark.slow
def test_an_ir_whose_input_channels_disagree_with_its_metadata_is_refused_when_opened(exported, tmp_path, capsys):
    import openvino as ov

    data, _, fp32, _, _ = exported
    model = ov.Core().read_model(str(fp32 / "model.xml"))
    metadata = openvino_format.ir_metadata(model, fp32)
    metadata["config"]["data"].update(channels=1, mean=[0.5], std=[0.25])
    metadata["preprocessing"].update(mean=[0.5], std=[0.25])
    openvino_format.set_ir_metadata(model, metadata)
    openvino_format.save_ir(model, tmp_path / "one_band")
    err = _refused(tmp_path / "one_band", data, tmp_path / "rows.json", capsys)
    assert "channel(s)" in err and "[?,3,32,32]" in err.replace(" ", "")
