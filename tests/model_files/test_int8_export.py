"""export.py --quantize int8: a static QDQ int8 ONNX model, calibrated on the validation split, that agrees
with the fp32 export, carries the metadata, is smaller, and that infer.py runs; the agreement floor and the
usage errors."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from conftest import REPO, train_tiny, wait_for

import export
import imgcls.model_files.quantize as quantize
import infer
from imgcls.commands.export import validation_files
from imgcls.core.errors import ConfigError, ExportError
from imgcls.model_files.checkpoint_files import read_checkpoint
from imgcls.model_files.loading import load_model_file
from imgcls.serving.model import ServedModel

CLASSES = ["a", "b", "c"]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(data root, best.pt, int8 path, export.py's printed lines) of one tiny run quantized once."""
    base = tmp_path_factory.mktemp("int8")
    data, checkpoint = train_tiny(base, {name: (8, 6) for name in CLASSES})
    out = base / "model_int8.onnx"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # in-process: no second start-up of torch and onnxruntime
        assert export.main(["--checkpoint", str(checkpoint), "--format", "onnx", "--quantize", "int8",
                            "--calibration-images", "9", "--dynamic-batch", "--output", str(out)]) == 0
    return data, checkpoint, out, printed.getvalue()


@pytest.mark.slow
def test_int8_model_is_quantized_smaller_and_agrees(quantized):
    _, _, out, stdout = quantized
    model = onnx.load(str(out))
    ops = {node.op_type for node in model.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    assert "BatchNormalization" not in ops
    # per-channel weights: a DequantizeLinear of a conv weight has one scale per output channel
    scales = {init.name: init for init in model.graph.initializer}
    per_channel = [n for n in model.graph.node if n.op_type == "DequantizeLinear"
                   and n.input[1] in scales and len(scales[n.input[1]].dims) == 1 and scales[n.input[1]].dims[0] > 1]
    assert per_channel
    assert "calibrated on 9 images" in stdout
    size = re.search(r"size: ([\d.]+) MB int8 vs ([\d.]+) MB fp32", stdout)
    assert float(size.group(1)) < 0.5 * float(size.group(2))
    agreement = re.search(r"int8 top-1 agreement with fp32 ([\d.]+)% \((\d+)/(\d+)\)", stdout)
    assert int(agreement.group(3)) == 18 and float(agreement.group(1)) >= 97.0


@pytest.mark.slow
def test_int8_model_keeps_metadata_and_infer_runs_it(quantized, tmp_path):
    data, checkpoint, out, _ = quantized
    opened = load_model_file(out)
    assert opened.kind == "onnx" and opened.classes == CLASSES and opened.fixed_batch is None
    rows_file = tmp_path / "rows.json"
    assert infer.main([str(data / "val"), "--checkpoint", str(out), "--output", str(rows_file),
                       "--num-workers", "0"]) == 0
    rows = json.loads(rows_file.read_text())
    assert len(rows) == 18 and all(r["label"] in CLASSES and r["error"] is None for r in rows)
    # serve.py runs the int8 export as infer.py does: the same rows
    served = ServedModel.load(str(out), topk=5, max_batch=4)
    paths = [Path(r["path"]) for r in rows[:3]]
    got = served.classify([served.decode(p.read_bytes()) for p in paths], [str(p) for p in paths])
    for row, want in zip(got, rows[:3]):
        assert row["label"] == want["label"] and row["top2_label"] == want["top2_label"]
        assert row["prob"] == pytest.approx(want["prob"], abs=1e-5)


@pytest.mark.slow
def test_sigterm_mid_export_exits_143_and_leaves_no_temporary_folder(quantized, tmp_path):
    """docker stop or kill while the fp32 export is being quantized: the temporary folders beside the
    output go with the process, and no partial output is left."""
    _, checkpoint, _, _ = quantized
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(REPO / "export.py"), "--checkpoint", str(checkpoint), "--format",
                             "onnx", "--quantize", "int8", "--output", str(out / "m.onnx")], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    wait_for(proc, lambda: out.is_dir() and any(p.name.startswith(".fp32-") for p in out.iterdir()),
             "the temporary fp32 export folder")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert "terminated" in err and list(out.iterdir()) == []


AVX2_ONLY = "flags : fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c"


def test_int8_is_said_to_be_no_faster_only_without_vnni_amx_or_dot_product():
    from imgcls.compute.device import int8_slow_reason

    assert "no int8 dot-product instructions" in int8_slow_reason(AVX2_ONLY)
    for flag in ("avx512_vnni", "avx_vnni", "amx_int8", "asimddp"):
        assert int8_slow_reason(f"{AVX2_ONLY} {flag}") is None, flag


@pytest.mark.slow
def test_infer_on_a_cpu_without_vnni_says_once_that_int8_may_be_no_faster(quantized, tmp_path, monkeypatch, caplog):
    import imgcls.model_files.formats.onnx as onnx_format

    data, checkpoint, out, _ = quantized
    monkeypatch.setattr(onnx_format, "read_cpuinfo", lambda: AVX2_ONLY)
    monkeypatch.setattr(onnx_format, "_WARNED_INT8", set())
    assert onnx_format.is_int8_model(out)
    for _ in range(2):
        assert infer.main([str(data / "val"), "--checkpoint", str(out), "--output", str(tmp_path / "rows.json"),
                           "--num-workers", "0"]) == 0
    said = [r for r in caplog.records if "no int8 dot-product instructions" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING" and str(out) in said[0].getMessage()
    monkeypatch.setattr(onnx_format, "_WARNED_INT8", set())
    monkeypatch.setattr(onnx_format, "read_cpuinfo", lambda: AVX2_ONLY + " avx512_vnni")
    caplog.clear()
    assert infer.main([str(data / "val"), "--checkpoint", str(out), "--output", str(tmp_path / "rows.json"),
                       "--num-workers", "0"]) == 0
    # no warning (an INFO line may name the file, whose path says int8)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "int8" in r.getMessage()]


def test_agreement_below_the_floor_is_an_export_error(tmp_path):
    report = quantize.QuantizeReport(tmp_path / "m.onnx", 100, 25, 8, num_images=200, agree=193, fp32_correct=150,
                                     int8_correct=149, images_from="val")
    quantize.check_agreement(report, 0.965)  # 0.965 of 200 agree
    with pytest.raises(ExportError, match=r"0\.9650 of 200 images, below --min-agreement 0\.97"):
        quantize.check_agreement(report, 0.97)


@pytest.mark.slow
def test_calibration_without_the_validation_images_is_a_usage_error(quantized, tmp_path):
    _, checkpoint, _, _ = quantized
    loaded = read_checkpoint(checkpoint)
    loaded.cfg.data.root = str(tmp_path / "moved")
    with pytest.raises(ConfigError, match="calibrates on the checkpoint's validation images"):
        validation_files(loaded)


def test_spread_takes_evenly_spaced_items():
    assert quantize.spread(list(range(10)), 5) == [0, 2, 4, 6, 8]
    assert quantize.spread(list(range(3)), 5) == [0, 1, 2]


@pytest.mark.parametrize("args, flag", [
    (["--format", "pt2", "--quantize", "int8"], "--quantize"),
    (["--format", "onnx", "--quantize", "int8", "--calibration-images", "0"], "--calibration-images"),
    (["--format", "onnx", "--quantize", "int8", "--min-agreement", "1.5"], "--min-agreement"),
])
def test_quantize_usage_errors(args, flag, tmp_path):
    with pytest.raises(ConfigError, match=flag):
        export.main(["--checkpoint", "x.pt", "--output", str(tmp_path / "m.onnx"), *args])
