"""data.channels: grayscale, 16-bit, multi-band TIFF and .npy files read as N bands with their depth, a stem of the
right width, hostile headers refused before decoding, and 8-bit RGB training unchanged."""
from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, run_script, tiny_overrides, wait_for
from PIL import Image

import eval as eval_script
import infer
from imgcls.core.errors import ImageDecodeError
from imgcls.data.images import read_bands
from imgcls.data.transforms import EvalTransform, TrainTransform


def tiff_bytes(array: np.ndarray, **kwargs) -> bytes:
    import tifffile

    buf = io.BytesIO()
    tifffile.imwrite(buf, array, **kwargs)
    return buf.getvalue()


def tiff_header(width: int, height: int, samples: int) -> bytes:
    """A classic little-endian TIFF whose first page declares width x height pixels of `samples` 8-bit samples
    and holds one byte of data: what a hostile upload looks like."""
    tags = [(256, 4, 1, width), (257, 4, 1, height), (258, 3, 1, 8), (259, 3, 1, 1), (262, 3, 1, 1),
            (273, 4, 1, 8), (277, 3, 1, samples), (278, 4, 1, height), (279, 4, 1, 1)]
    out = b"II*\x00" + struct.pack("<I", 8) + struct.pack("<H", len(tags))
    for tag, kind, count, value in tags:
        out += struct.pack("<HHII", tag, kind, count, value)
    return out + struct.pack("<I", 0)


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def four_band_image(label: int, rng, size: int = 20) -> np.ndarray:
    """uint16 (H, W, 4): the first three bands noise alike for every class, the class only in the fourth."""
    array = rng.integers(20000, 40000, (size, size, 4)).astype(np.uint16)
    array[..., 3] = np.clip(rng.normal(12000 + 20000 * label, 3000, (size, size)), 0, 65535).astype(np.uint16)
    return array


def write_band_tree(root, kind: str, counts=(16, 6), classes=("a", "b")):
    """root/<split>/<class>/<i>.{tif,npy}: four-band images (the class in the fourth band)."""
    rng = np.random.default_rng(0)
    for split, n in zip(("train", "val"), counts):
        for label, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                array = four_band_image(label, rng)
                if kind == "tif":
                    (folder / f"{name}_{i}.tif").write_bytes(tiff_bytes(array, photometric="minisblack"))
                else:
                    np.save(folder / f"{name}_{i}.npy", array.transpose(2, 0, 1))  # (N, H, W)
    return root


def write_sixteen_bit_tree(root, counts=(24, 12)):
    """16-bit grayscale PNGs whose classes differ by less than one 8-bit step (257 in 16 bits)."""
    rng = np.random.default_rng(1)
    for split, n in zip(("train", "val"), counts):
        for label, name in enumerate(("a", "b")):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                array = np.clip(rng.normal(30000 + 150 * label, 12, (16, 16)), 0, 65535).astype(np.uint16)
                Image.fromarray(array).save(folder / f"{name}_{i}.png")
    return root


def stem_in_channels(checkpoint) -> int:
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]
    return next(v for v in state.values() if v.ndim == 4).shape[1]


# ---------------------------------------------------------------- reading


def test_a_four_band_tiff_and_npy_read_as_four_channels_with_their_depth():
    array = four_band_image(1, np.random.default_rng(0))
    from_tiff = read_bands(tiff_bytes(array, photometric="minisblack"), "x.tif", 4)
    from_planar_tiff = read_bands(tiff_bytes(array.transpose(2, 0, 1), photometric="minisblack"), "p.tif", 4)
    from_npy = read_bands(npy_bytes(array.transpose(2, 0, 1)), "x.npy", 4)  # (N, H, W): only the first axis fits
    expected = array.astype(np.float32) * np.float32(255 / 65535)
    for got in (from_tiff, from_planar_tiff, from_npy):
        assert got.shape == (20, 20, 4) and got.dtype == np.float32
        np.testing.assert_allclose(got, expected, rtol=1e-6)
    # values one 16-bit step apart stay apart: nothing quantised to 8 bits
    assert len(np.unique(read_bands(npy_bytes(np.arange(300, dtype=np.uint16).reshape(15, 20)), "r.npy", 1))) == 300


def test_the_eval_transform_gives_n_float_bands_and_a_blank_of_the_same_kind(tmp_path):
    path = tmp_path / "x.tif"
    path.write_bytes(tiff_bytes(four_band_image(0, np.random.default_rng(0)), photometric="minisblack"))
    transform = EvalTransform(16, 0.875, "bilinear", channels=4)
    out = transform(str(path))
    assert out.shape == (4, 16, 16) and out.dtype == torch.float32
    assert transform.blank().shape == (4, 16, 16) and transform.blank().dtype == torch.float32
    train = TrainTransform(16, (0.5, 1.0), (0.75, 1.33), 0.5, 0.0, "bilinear", channels=4)
    assert train(str(path), 3).shape == (4, 16, 16)


def test_value_range_scales_the_samples_it_declares():
    array = np.array([[100, 300], [200, 500]], dtype=np.uint16)
    got = read_bands(npy_bytes(array), "x.npy", 1, value_range=[100, 500])
    np.testing.assert_allclose(got[..., 0], [[0, 127.5], [63.75, 255]], rtol=1e-6)


@pytest.mark.parametrize("data,channels,has", [
    ("rgb", 1, "has 3 channel(s)"), ("gray", 4, "has 1 channel(s)"), ("npy5", 4, "has 5 channel(s)")])
def test_a_file_with_other_channels_is_unreadable_naming_what_it_has_and_what_is_asked(data, channels, has):
    files = {"rgb": lambda: _png(np.zeros((8, 8, 3), np.uint8)), "gray": lambda: _png(np.zeros((8, 8), np.uint8)),
             "npy5": lambda: npy_bytes(np.zeros((8, 9, 5), np.uint8))}
    with pytest.raises(ImageDecodeError) as info:
        read_bands(files[data](), f"bad.{data}", channels)
    assert has in str(info.value) and f"data.channels asks {channels}" in str(info.value)
    assert f"bad.{data}" in str(info.value)


def _png(array) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("width,height,samples", [(65536, 32768, 1), (8, 8, 65535)])
def test_a_hostile_tiff_header_is_refused_before_decoding(monkeypatch, width, height, samples):
    import tifffile

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded a refused file")

    monkeypatch.setattr(tifffile.TiffPageSeries, "asarray", no_decoding)
    with pytest.raises(ImageDecodeError, match="refused before decoding"):
        read_bands(tiff_header(width, height, samples), "hostile.tif", samples)


def test_a_hostile_npy_header_is_refused_before_decoding():
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<u2", "fortran_order": False, "shape": (70000, 70000)})
    with pytest.raises(ImageDecodeError, match="refused before decoding"):
        read_bands(header.getvalue(), "hostile.npy", 1)
    with pytest.raises(ImageDecodeError, match="not an image"):
        read_bands(npy_bytes(np.array([["a"]])), "text.npy", 1)


def test_rgb_keeps_the_uint8_path_bit_for_bit(tmp_path):
    path = tmp_path / "x.png"
    path.write_bytes(_png(np.random.default_rng(0).integers(0, 256, (24, 30, 3), dtype=np.uint8)))
    before = TrainTransform(16, (0.08, 1.0), (0.75, 1.33), 0.5, 0.0, "bilinear")
    after = TrainTransform(16, (0.08, 1.0), (0.75, 1.33), 0.5, 0.0, "bilinear", channels=3)
    for seed in range(4):
        a, b = before(str(path), seed), after(str(path), seed)
        assert a.dtype == b.dtype == torch.uint8 and torch.equal(a, b)


# ---------------------------------------------------------------- training


def _grey_pngs(root, counts: tuple[int, int], pixels) -> None:
    """root/{train,val}/{a,b}/*.png: counts[0] and counts[1] one-channel PNGs a class, `pixels(rng, label)` each."""
    rng = np.random.default_rng(0)
    for split, n in zip(("train", "val"), counts):
        for label, name in enumerate("ab"):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(n):
                Image.fromarray(pixels(rng, label)).save(folder / f"{name}_{i}.png")


def _train(data, run, *extra, **keys):
    overrides = tiny_overrides(data, run, **{"data.hflip": 0.0, **keys})
    return run_script("train.py", "--config", "base", *overrides, *extra)


@pytest.mark.slow
def test_one_channel_pngs_train_with_a_one_channel_stem(tmp_path):
    _grey_pngs(tmp_path / "data", (16, 6),
               lambda rng, label: np.clip(rng.normal(70 + 110 * label, 20, (20, 20)), 0, 255).astype(np.uint8))
    result = _train(tmp_path / "data", tmp_path / "run", **{"data.channels": 1})
    assert result.returncode == 0, result.stderr[-2000:]
    assert stem_in_channels(tmp_path / "run" / "best.pt") == 1
    assert "the ImageNet RGB values do not apply" in result.stderr


@pytest.mark.slow
def test_sixteen_bit_pngs_learn_what_the_eight_bit_reading_cannot_see(tmp_path):
    data = write_sixteen_bit_tree(tmp_path / "data")
    keys = {"train.epochs": 3, "data.scale": "[0.5,1.0]", "optim.lr": 0.2}
    deep = _train(data, tmp_path / "deep", **keys, **{"data.channels": 1})  # mean / std: auto, the default here
    flat = _train(data, tmp_path / "flat", **keys)  # today's 8-bit RGB reading: every image the same flat grey
    assert deep.returncode == 0 and flat.returncode == 0, (deep.stderr + flat.stderr)[-3000:]
    top1 = {name: json.loads((tmp_path / name / "summary.json").read_text())["best"]["top1"]
            for name in ("deep", "flat")}
    assert top1["deep"] >= 90.0 and top1["flat"] <= 60.0, top1
    assert "data.mean / data.std = auto: measured per channel on 48 training images" in deep.stderr
    stored = torch.load(tmp_path / "deep" / "best.pt", map_location="cpu", weights_only=True)["preprocessing"]
    assert stored["mean"][0] == pytest.approx(30075 / 65535, abs=2e-4) and stored["std"][0] < 0.0039


@pytest.mark.slow
def test_a_channels_3_run_trains_bit_for_bit_as_a_run_without_the_key(tiny_tree, tmp_path):
    keys = {"train.epochs": 1, "data.limit_train_batches": 3}
    plain = _train(tiny_tree, tmp_path / "plain", **keys)
    three = _train(tiny_tree, tmp_path / "three", **keys, **{"data.channels": 3})
    assert plain.returncode == 0 and three.returncode == 0, (plain.stderr + three.stderr)[-3000:]
    a = torch.load(tmp_path / "plain" / "last.pt", map_location="cpu", weights_only=True)["model"]
    b = torch.load(tmp_path / "three" / "last.pt", map_location="cpu", weights_only=True)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert stem_in_channels(tmp_path / "three" / "last.pt") == 3


@pytest.fixture(scope="module")
def four_band_run(tmp_path_factory):
    """A 4-band TIFF model (mean / std measured) killed after its first epoch's last.pt, then resumed."""
    base = tmp_path_factory.mktemp("bands")
    data = write_band_tree(base / "data", "tif")
    keys = {"data.hflip": 0.0, "data.channels": 4, "data.mean": "auto", "data.std": "auto"}
    marker = base / "marker"
    cmd = [sys.executable, str(REPO / "tests" / "paused_train.py"), str(marker), "after_save:1", "--",
           "--config", "base", *tiny_overrides(data, base / "run", **keys)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    wait_for(proc, marker.exists, "the first epoch's last.pt")
    proc.kill()
    proc.wait()
    resumed = _train(data, base / "run", "--resume", "auto", **keys)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "data.mean / data.std = auto: the resumed run's measured values" in resumed.stderr
    return data, base / "run"


@pytest.mark.slow
def test_a_four_band_run_resumes_with_a_four_channel_stem(four_band_run):
    _, run = four_band_run
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epochs_completed"] == 2
    assert stem_in_channels(run / "last.pt") == 4
    saved = torch.load(run / "best.pt", map_location="cpu", weights_only=True)
    assert len(saved["preprocessing"]["mean"]) == 4


@pytest.mark.slow
def test_infer_and_eval_give_the_same_rows_for_a_four_band_model(four_band_run, tmp_path):
    data, run = four_band_run
    inferred_file, evaluated_file = tmp_path / "infer.json", tmp_path / "eval.json"
    assert infer.main([str(data / "val"), "--checkpoint", str(run / "best.pt"), "--output", str(inferred_file),
                       "--num-workers", "0", "--device", "cpu"]) == 0
    assert eval_script.main(["--checkpoint", str(run / "best.pt"), "--predictions", str(evaluated_file)]) == 0
    inferred = {os.path.basename(r["path"]): r for r in json.loads(inferred_file.read_text())}
    evaluated = {os.path.basename(r["path"]): r for r in json.loads(evaluated_file.read_text())}
    assert inferred.keys() == evaluated.keys() and len(inferred) == 12
    for name, row in evaluated.items():
        assert not inferred[name]["error"] and row["label"] == inferred[name]["label"], name
        assert row["prob"] == pytest.approx(inferred[name]["prob"], abs=1e-5)


@pytest.mark.slow
def test_npy_bands_train_as_the_tiffs_do(tmp_path):
    data = write_band_tree(tmp_path / "data", "npy", counts=(8, 4))
    # the channel-agnostic augmentations on 4 bands: random erasing, mixup and CutMix
    result = _train(data, tmp_path / "run", **{"data.channels": 4, "train.epochs": 1, "data.random_erasing": 0.5,
                                               "train.mixup_alpha": 0.2, "train.cutmix_alpha": 1.0})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "16 training images" in result.stderr and stem_in_channels(tmp_path / "run" / "best.pt") == 4


def test_colour_policies_are_refused_for_other_than_three_channels(tmp_path):
    for key, value in (("data.auto_augment", "randaugment"), ("data.color_jitter", 0.4)):
        result = run_script("train.py", "--config", "base", *tiny_overrides(tmp_path, tmp_path / "run", **{
            "data.channels": 4, key: value}))
        assert result.returncode == 2 and f"'{key}'" in result.stderr and "8-bit RGB" in result.stderr


@pytest.mark.slow
def test_serve_answers_tiff_and_npy_uploads_with_infer_s_rows(four_band_run, tmp_path):
    from imgcls.serving.model import ServedModel

    data, run = four_band_run
    files = sorted((data / "val").rglob("*.tif"))
    out = tmp_path / "infer.json"
    assert infer.main([str(data / "val"), "--checkpoint", str(run / "best.pt"), "--output", str(out),
                       "--num-workers", "0", "--device", "cpu"]) == 0
    inferred = {os.path.basename(r["path"]): r for r in json.loads(out.read_text())}
    served = ServedModel.load(str(run / "best.pt"), topk=2, max_batch=4, device_setting="cpu")
    served.warm_up()
    import tifffile

    for path in files[:4]:
        as_npy = npy_bytes(tifffile.imread(path))  # the same bands as an (H, W, 4) array upload
        for body in (path.read_bytes(), as_npy):
            row = served.classify([served.decode(body)], [path.name])[0]
            # one image a batch here, 32 padded in infer: oneDNN may pick another kernel per batch shape (an AMD
            # EPYC with AVX-512 gave probabilities 2e-7 apart), so the probability agrees to 1e-6, the label exactly
            assert row["label"] == inferred[path.name]["label"]
            assert row["prob"] == pytest.approx(inferred[path.name]["prob"], abs=1e-6)


@pytest.mark.slow
def test_onnx_int8_pt2_and_timm_exports_take_four_channels_and_agree_with_the_checkpoint(four_band_run, tmp_path):
    import onnx

    data, run = four_band_run
    exports = {"onnx": tmp_path / "m.onnx", "pt2": tmp_path / "m.pt2", "timm": tmp_path / "timm",
               "int8": tmp_path / "q.onnx"}
    for fmt, output in exports.items():
        quantize = ["--quantize", "int8"] if fmt == "int8" else []
        result = run_script("export.py", "--checkpoint", str(run / "best.pt"), "--format",
                            "onnx" if fmt == "int8" else fmt, "--output", str(output), *quantize)
        said = result.stdout + result.stderr
        assert result.returncode == 0, said[-2000:]
        assert "4 channel(s)" in said and ("top-1 agrees on 8/8" in said or "with fp32 100.00% (12/12)" in said), said
    dims = onnx.load(str(exports["onnx"])).graph.input[0].type.tensor_type.shape.dim
    assert dims[1].dim_value == 4
    assert json.loads((exports["timm"] / "config.json").read_text())["model_args"]["in_chans"] == 4
    from imgcls.core.errors import CheckpointError
    from imgcls.serving.slim import OnnxExport

    with pytest.raises(CheckpointError, match="4 input channel"):  # the slim server reads 8-bit RGB only
        OnnxExport.open(exports["onnx"])
    rows = {}
    for name, model in (*exports.items(), ("pt", run / "best.pt")):
        out = tmp_path / f"{name}.json"
        assert infer.main([str(data / "val"), "--checkpoint", str(model), "--output", str(out), "--num-workers",
                           "0", "--device", "cpu"]) == 0
        rows[name] = {r["path"]: r["label"] for r in json.loads(out.read_text())}
    assert len(rows["pt"]) == 12 and all(rows[name] == rows["pt"] for name in exports)

# ---------------------------------------------------------------- stems


def test_torchvision_and_timm_models_take_n_channels():
    from imgcls.models.factory import create_model, stem_conv

    for name in ("tv:resnet18", "resnet10t"):
        for channels in (1, 5):
            model = create_model(name, 3, in_chans=channels).eval()
            assert stem_conv(model)[1].in_channels == channels
            assert model(torch.zeros(1, channels, 32, 32)).shape == (1, 3)


@pytest.mark.slow
def test_a_pretrained_rgb_model_fine_tunes_into_one_channel(tmp_path):
    from conftest import write_pretrained_folder
    from timm.models import adapt_input_conv

    rgb = write_pretrained_folder(tmp_path / "pretrained", num_classes=3)
    _grey_pngs(tmp_path / "data", (8, 4), lambda rng, label: rng.integers(0, 256, (20, 20), dtype=np.uint8))
    result = _train(tmp_path / "data", tmp_path / "run", **{
        "data.channels": 1, "model.name": f"local-dir:{tmp_path / 'pretrained'}", "model.pretrained": "true",
        "train.epochs": 1, "optim.lr": 1e-9, "train.batch_size": 4})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "3-channel weights adapted to 1 input channels" in result.stderr
    saved = torch.load(tmp_path / "run" / "best.pt", map_location="cpu", weights_only=True)
    mean = saved["preprocessing"]["mean"]  # measured on the uniform noise images, not the pretrained RGB mean
    assert len(mean) == 1 and mean[0] == pytest.approx(0.5, abs=0.03)
    stem = next(k for k, v in rgb.items() if v.ndim == 4)
    trained = saved["model"][stem]
    assert trained.shape[1] == 1  # the summed RGB kernels, barely moved at lr 1e-9
    assert torch.allclose(trained, adapt_input_conv(1, rgb[stem]), atol=1e-4)


def test_three_channel_weights_are_adapted_into_an_n_channel_stem_as_timm_does():
    from timm.models import adapt_input_conv

    from imgcls.models.factory import create_model, load_matching_weights, stem_conv
    from imgcls.training.rundir import apply_finetune

    rgb = create_model("resnet10t", 3).state_dict()
    for channels in (1, 4):
        model = create_model("resnet10t", 3, in_chans=channels)
        loaded, _ = load_matching_weights(model, rgb)
        key = f"{stem_conv(model)[0]}.weight"
        assert key in loaded and torch.equal(model.state_dict()[key], adapt_input_conv(channels, rgb[key]))
        # --finetune from a 3-channel checkpoint: every tensor loads, the stem adapted
        assert apply_finetune(create_model("resnet10t", 3, in_chans=channels), {"model": rgb}, "rgb.pt") == 1.0
    one = create_model("resnet10t", 3, in_chans=1)
    load_matching_weights(one, rgb)
    key = f"{stem_conv(one)[0]}.weight"
    assert torch.allclose(one.state_dict()[key][:, 0], rgb[key].sum(dim=1))  # one channel: the RGB sum


@pytest.mark.slow
def test_shards_of_tiff_and_npy_members_train_as_four_bands(tmp_path):
    from imgcls.data.listing import scan_split
    from imgcls.data.shards import write_shards

    for kind in ("tif", "npy"):
        write_band_tree(tmp_path / kind, kind, counts=(8, 4))
    for split in ("train", "val"):
        index = scan_split(tmp_path / "tif" / split)
        npy = scan_split(tmp_path / "npy" / split)
        write_shards(index.paths + npy.paths, index.labels + npy.labels, index.classes, tmp_path / "shards" / split, 8)
    shards = tmp_path / "shards"
    result = _train(tmp_path, tmp_path / "run", **{
        "data.channels": 4, "train.epochs": 1, "data.format": "webdataset", "data.root": "null",
        "data.classes": str(shards / "train" / "classes.txt"), "data.shuffle_buffer": 4,
        "data.train_shards": str(shards / "train" / "shard-{000000..000003}.tar"),
        "data.val_shards": str(shards / "val" / "shard-{000000..000001}.tar")})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "32 training" in result.stderr and stem_in_channels(tmp_path / "run" / "best.pt") == 4


@pytest.mark.slow
def test_the_audit_hashes_the_first_band_and_finds_a_leak_across_formats(tmp_path):
    import tifffile

    data = write_band_tree(tmp_path / "data", "tif", counts=(8, 4))
    # the same bands in another format: other bytes, the same first band
    np.save(data / "val" / "a" / "copy.npy", tifffile.imread(data / "train" / "a" / "a_0.tif"))
    result = run_script("audit.py", "--config", "base", f"data.root={data}", "data.channels=4", "data.img_size=16",
                        "data.num_workers=0", "train.batch_size=4", "audit.folds=0", "--json", str(tmp_path / "a.json"))
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "a.json").read_text())
    assert "the first of 4 band(s)" in report["hash_view"] and "the first of 4 band(s)" in result.stderr
    leaks = [(leak["train"], leak["val"], leak["exact"]) for leak in report["leaks"]]
    assert leaks == [(["train/a/a_0.tif"], ["val/a/copy.npy"], False)] and not report["unreadable"]


@pytest.mark.slow
def test_grad_cam_overlays_of_a_four_band_model_are_drawn_on_the_first_band(four_band_run, tmp_path):
    data, run = four_band_run
    out = tmp_path / "rows.json"
    assert infer.main([str(data / "val" / "a"), "--checkpoint", str(run / "best.pt"), "--output", str(out),
                       "--num-workers", "0", "--device", "cpu", "--explain", str(tmp_path / "cam")]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 6 and all(Path(row["explain"][0]["overlay"]).is_file() for row in rows)
    with Image.open(rows[0]["explain"][0]["overlay"]) as overlay:
        assert overlay.mode == "RGB" and overlay.size[0] >= 20


@pytest.mark.slow
def test_a_file_of_other_channels_is_an_error_row_naming_what_it_has(four_band_run, tmp_path):
    data, run = four_band_run
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "rgb.png").write_bytes(_png(np.zeros((20, 20, 3), np.uint8)))
    (tmp_path / "in" / "ok.tif").write_bytes((data / "val" / "a" / "a_0.tif").read_bytes())
    out = tmp_path / "rows.json"
    assert infer.main([str(tmp_path / "in"), "--checkpoint", str(run / "best.pt"), "--output", str(out),
                       "--num-workers", "0", "--device", "cpu"]) == 0
    rows = {os.path.basename(r["path"]): r for r in json.loads(out.read_text())}
    assert rows["ok.tif"]["label"] == "a" and not rows["ok.tif"]["error"]
    assert "has 3 channel(s)" in rows["rgb.png"]["error"] and "data.channels asks 4" in rows["rgb.png"]["error"]


def test_an_rgb_npy_reads_as_its_png_does_on_the_eight_bit_path(tmp_path):
    array = np.random.default_rng(2).integers(0, 256, (24, 30, 3), dtype=np.uint8)
    (tmp_path / "x.png").write_bytes(_png(array))
    np.save(tmp_path / "x.npy", array)
    transform = EvalTransform(16, 0.875, "bilinear")
    a, b = transform(str(tmp_path / "x.png")), transform(str(tmp_path / "x.npy"))
    assert a.dtype == b.dtype == torch.uint8 and torch.equal(a, b)


@pytest.mark.parametrize("overrides,key", [(["data.value_range=[5,1]"], "data.value_range"),
                                           (["data.channels=2", "data.mean=[0.5,0.5,0.5]"], "data.mean"),
                                           (["data.channels=0"], "data.channels")])
def test_channel_keys_are_checked_before_any_work(tmp_path, overrides, key):
    from imgcls.config import load_config
    from imgcls.core.errors import ConfigError

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("base", [f"data.root={tmp_path}", *overrides])


@pytest.mark.slow
def test_a_four_band_run_under_ddp_measures_the_same_normalisation_once(four_band_run, tmp_path):
    """torchrun with 2 CPU processes: rank 0 measures mean / std on the whole training split and shares them."""
    _, single = four_band_run
    data = write_band_tree(tmp_path / "data", "tif")  # the same files as the fixture's (one seed)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(REPO / "train.py"), "--config", "base",
               *tiny_overrides(data, tmp_path / "run", **{"data.channels": 4, "train.epochs": 1, "data.hflip": 0.0,
                                                          "train.batch_size": 4})]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    ddp = torch.load(tmp_path / "run" / "best.pt", map_location="cpu", weights_only=True)
    first = torch.load(single / "best.pt", map_location="cpu", weights_only=True)
    assert stem_in_channels(tmp_path / "run" / "best.pt") == 4
    # the whole split, once (other batch sizes: float64 sums in another order)
    assert ddp["preprocessing"]["mean"] == pytest.approx(first["preprocessing"]["mean"], rel=1e-12)
    assert ddp["preprocessing"]["std"] == pytest.approx(first["preprocessing"]["std"], rel=1e-9)


# ---------------------------------------------------------------- non-finite and out-of-range samples


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("case", ["inf_npy", "one_nan_npy", "nan_tiff", "huge_npy", "overflowing_float64"])
def test_a_non_finite_or_off_scale_sample_is_unreadable_on_every_path(channels, case):
    shape = (20, 20, channels)
    one_nan = np.random.default_rng(0).random(shape).astype(np.float32)
    one_nan[3, 4, 0] = np.nan
    body = {"inf_npy": lambda: npy_bytes(np.full(shape, np.inf, np.float32)),
            "one_nan_npy": lambda: npy_bytes(one_nan),
            "nan_tiff": lambda: tiff_bytes(np.full((20, 20), np.nan, np.float32)),
            "huge_npy": lambda: npy_bytes(np.full(shape, 1e30, np.float32)),
            "overflowing_float64": lambda: npy_bytes(np.full(shape, 1e300))}[case]()
    want = "outside the declared range" if case in ("huge_npy", "overflowing_float64") else "not finite"
    if case == "nan_tiff" and channels == 3:  # the 8-bit RGB path reads a one-band float TIFF through PIL
        with pytest.raises(ImageDecodeError, match=want):
            EvalTransform(16, 0.875, "bilinear")(body)
        return
    for transform in (EvalTransform(16, 0.875, "bilinear", channels), TrainTransform(
            16, (0.5, 1.0), (0.75, 1.33), 0.5, 0.0, "bilinear", channels=channels)):
        with pytest.raises(ImageDecodeError, match=want):
            transform(body) if isinstance(transform, EvalTransform) else transform(body, 0)


def test_finite_floats_on_the_0_255_scale_still_read_and_value_range_widens_the_bound():
    array = np.random.default_rng(0).random((20, 20, 1)).astype(np.float32) * 255
    assert read_bands(npy_bytes(array), "x", 1).max() == pytest.approx(array.max() * 255)
    with pytest.raises(ImageDecodeError, match=r"data.value_range=\[0.0, 1.0\]"):
        read_bands(npy_bytes(array * 1000), "x", 1, (0.0, 1.0))
    assert read_bands(npy_bytes(array * 1000), "x", 1, (0.0, 255000.0)).max() <= 255.0


def test_serve_refuses_a_non_finite_upload_as_a_bad_image_on_the_band_path():
    from imgcls.serving import BadImage
    from imgcls.serving.model import decode_image

    transform = EvalTransform(16, 0.875, "bilinear", 1)
    with pytest.raises(BadImage) as info:
        decode_image(npy_bytes(np.full((20, 20), np.inf, np.float32)), transform, None)
    assert info.value.kind == "non_finite_image" and "400 of 400 samples" in info.value.detail
    with pytest.raises(BadImage) as info:
        decode_image(tiff_bytes(np.full((20, 20), 1e30, np.float32)), transform, None)
    assert info.value.kind == "out_of_range_image"


def _one_band_npy_tree(root, bad: dict):
    """root/{train,val}/{a,b}/*.npy one-band float images in [0, 1], plus `bad` (name -> array) in train/a."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 12), ("val", 4)):
        for label, name in enumerate("ab"):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(n):
                np.save(folder / f"{name}_{i}.npy", (rng.random((20, 20)) * 0.5 + 0.4 * label).astype(np.float32))
    for name, array in bad.items():
        np.save(root / "train" / "a" / name, array)
    return root


@pytest.mark.slow
def test_a_non_finite_training_file_is_skipped_named_and_kept_out_of_the_auto_normalisation(tmp_path):
    data = _one_band_npy_tree(tmp_path / "data", {"inf.npy": np.full((20, 20), np.inf, np.float32)})
    result = _train(data, tmp_path / "run", **{"data.channels": 1, "train.epochs": 1, "data.max_bad_fraction": 0.1})
    assert result.returncode == 0, result.stderr[-2000:]
    bad = str(data / "train" / "a" / "inf.npy")
    assert f"unreadable training files were left out of the measurement, the first: {bad}" in result.stderr
    assert "measured per channel on 24 training images" in result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["skipped_files"] == [bad]
    saved = torch.load(tmp_path / "run" / "best.pt", map_location="cpu", weights_only=True)
    mean, std = saved["preprocessing"]["mean"][0], saved["preprocessing"]["std"][0]
    assert 0.3 < mean < 0.5 and 0.1 < std < 0.4  # the finite files' values (uniform 0..0.9)


@pytest.mark.slow
def test_bands_that_do_not_match_data_channels_stop_an_auto_normalisation_naming_the_key(tmp_path):
    data = write_band_tree(tmp_path / "data", "tif", counts=(2, 1))
    result = _train(data, tmp_path / "run", **{"data.channels": 2, "train.batch_size": 2})
    assert result.returncode == 2, result.stderr[-2000:]
    assert "not one training image could be read with data.channels=2" in result.stderr
    assert "has 4 channel(s) (shape (20, 20, 4)), data.channels asks 2" in result.stderr
    assert "measured on 0" not in result.stderr
