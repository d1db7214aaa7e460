"""serve.py without torch (imgcls/serving/slim.py, the slim serving image's path): its PIL/NumPy preprocessing
against the torch path's on the same images, and its rows against serve.py's torch path on the same
exports (fp32, int8, multi-label), with the calibrated probability and the reject option; the server
itself (--onnx-only) over HTTP; its usage errors."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import class_image, run_script, train_tiny
from multilabel_data import make_tag_list
from PIL import Image
from served_rows import assert_same_rows as assert_rows_agree
from stored_metadata_cases import BAD_METADATA, good_metadata, spoilt, write_onnx

import export as export_script
from imgcls.core.errors import ConfigError
from imgcls.data.eval_preprocessing import EvalPreprocessing, centre_crop_box, resized_short_side
from imgcls.data.images import open_image
from imgcls.data.transforms import EvalTransform, normalize_batch
from imgcls.serving.slim import OnnxServedModel
from imgcls.tasks.rows import energy_score as energy, softmax, top_k

PROB_TOLERANCE = 1e-5
CLASSES = ["a", "b", "c"]


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


def exif_rotated_jpeg(size=(300, 200)) -> bytes:
    """A JPEG stored landscape whose EXIF orientation (6: rotate 90) shows it portrait."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return encode(class_image(1, size), "JPEG", quality=92, exif=exif.tobytes())


def sample_images() -> dict[str, bytes]:
    """Files of every decode path: PNGs (PIL), an RGBA and a palette PNG, a greyscale one, small JPEGs
    (the torch path's tensor decoder), large ones (PIL's draft decode) and one turned by EXIF."""
    rng = np.random.default_rng(3)
    images = {}
    for i, size in enumerate([(24, 24), (37, 23), (23, 41), (64, 48), (5, 9)]):
        images[f"png_{size[0]}x{size[1]}"] = encode(class_image(i % 3, size, rng), "PNG")
    images["png_rgba"] = encode(class_image(2, (30, 20), rng).convert("RGBA"), "PNG")
    images["png_palette"] = encode(class_image(0, (26, 26), rng).convert("P"), "PNG")
    images["png_grey"] = encode(class_image(1, (33, 27), rng).convert("L"), "PNG")
    images["jpeg_small"] = encode(class_image(0, (40, 30), rng), "JPEG", quality=90)
    images["jpeg_small_grey"] = encode(class_image(2, (29, 35), rng).convert("L"), "JPEG", quality=90)
    images["jpeg_draft"] = encode(class_image(1, (400, 300), rng), "JPEG", quality=90)
    images["jpeg_exif_draft"] = exif_rotated_jpeg()
    return images


@pytest.mark.parametrize("width, height, short_to", [(24, 24, 18), (37, 23, 18), (23, 41, 27), (400, 300, 18)])
def test_resize_and_crop_geometry_is_torchvisions(width, height, short_to):
    from torchvision.transforms.v2 import functional as F

    resized = F.resize(Image.new("RGB", (width, height)), short_to)
    assert resized_short_side(width, height, short_to) == resized.size
    crop = 16
    image = torch.arange(resized.size[0] * resized.size[1]).reshape(1, resized.size[1], resized.size[0])
    left, top, right, bottom = centre_crop_box(*resized.size, crop)
    assert torch.equal(F.center_crop(image, crop), image[:, top:bottom, left:right])


@pytest.mark.parametrize("img_size, crop_pct, interpolation", [(16, 0.875, "bilinear"), (20, 1.0, "bicubic"),
                                                                (16, 0.5, "nearest")])
def test_preprocessing_equals_the_torch_path(img_size, crop_pct, interpolation):
    """The same uint8 crop as data.transforms.EvalTransform for every file (both decode through PIL), and
    normalize_batch's floats exactly."""
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    slim = EvalPreprocessing(img_size, crop_pct, interpolation, tuple(mean), tuple(std))
    torch_path = EvalTransform.of(slim)
    worst = {}
    for name, body in sample_images().items():
        got, want = slim.decode(open_image(io.BytesIO(body), name=name), name), torch_path(body).numpy()
        assert got.shape == want.shape == (3, img_size, img_size) and got.dtype == np.uint8, name
        worst[name] = int(np.abs(got.astype(int) - want.astype(int)).max())
        batch = np.stack([got])
        assert np.array_equal(slim.normalise(batch), normalize_batch(torch.from_numpy(batch), mean, std).numpy())
    assert worst == dict.fromkeys(worst, 0)


def test_numpy_scores_equal_torchs():
    logits = torch.randn(7, 5, generator=torch.Generator().manual_seed(0)) * 4
    probs = softmax(logits.numpy(), 1.7)
    assert np.allclose(probs, (logits / 1.7).softmax(1).numpy(), atol=1e-7)
    values, indices = top_k(probs, 3)
    want = torch.from_numpy(probs).topk(3, dim=1)
    assert np.array_equal(indices, want.indices.numpy()) and np.array_equal(values, want.values.numpy())
    assert np.allclose(energy(logits.numpy()), torch.logsumexp(logits, 1).numpy(), atol=1e-6)


# ---------------------------------------------------------------- rows: the torch path's serve.py vs ONNX only


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A tiny single-label run (calibrated, with a stored reject threshold) exported as fp32 and static int8
    ONNX, and a tiny multi-label run (tuned tag thresholds) exported as ONNX; request bodies for each."""
    base = tmp_path_factory.mktemp("onnx_only")
    # a stored temperature other than 1 (too few validation errors would keep the fitted one at 1)
    data, checkpoint = train_tiny(base, {name: (8, 4) for name in CLASSES}, **{"calibration.temperature": 0.7})
    files = {"fp32": base / "model.onnx", "int8": base / "model_int8.onnx", "tags": base / "tags.onnx"}
    assert export_script.main(["--checkpoint", str(checkpoint), "--format", "onnx", "--dynamic-batch",
                               "--output", str(files["fp32"])]) == 0
    assert export_script.main(["--checkpoint", str(checkpoint), "--format", "onnx", "--dynamic-batch",
                               "--quantize", "int8",
                               "--calibration-images", "8", "--min-agreement", "0", "--output",
                               str(files["int8"])]) == 0
    tags_root = base / "tags"
    train_csv = make_tag_list(tags_root, 32)
    run = base / "tags_run"
    result = run_script("train.py", "--config", "base", "data.format=csv", f"data.train_csv={train_csv}",
                        "data.val_fraction=0.25", "data.task=multilabel", f"output.dir={run}",
                        "model.name=test_resnet", "data.img_size=16", "data.num_workers=0", "train.batch_size=8",
                        "train.epochs=1", "train.amp=none", "train.device=cpu", "output.progress_bar=off",
                        "output.tensorboard=false")
    assert result.returncode == 0, result.stderr[-2000:]
    assert export_script.main(["--checkpoint", str(run / "best.pt"), "--format", "onnx", "--dynamic-batch",
                               "--output", str(files["tags"])]) == 0
    bodies = {f"val_{p.parent.name}_{p.name}": p.read_bytes() for p in sorted((data / "val").rglob("*.png"))}
    bodies.update(sample_images())
    tag_bodies = {p.name: p.read_bytes() for p in sorted((tags_root / "images").glob("*.png"))[:12]}
    return {"files": files, "bodies": bodies, "tag_bodies": tag_bodies}


def both_rows(path: Path, bodies: dict[str, bytes], max_batch: int = 8, **trust) -> tuple[list, list]:
    """serve.py's rows for `bodies` from its torch path (serving.model) and from the ONNX-only path, in
    batches of `max_batch` as the server forms them."""
    from imgcls.model_files.predictor import TrustOptions
    from imgcls.serving.model import ServedModel

    torch_model = ServedModel.load(str(path), 5, max_batch, "cpu", TrustOptions(**trust))
    slim_model = OnnxServedModel.load(str(path), 5, max_batch, **trust)
    names = list(bodies)
    torch_rows, slim_rows = [], []
    for start in range(0, len(names), max_batch):
        chunk = names[start:start + max_batch]
        torch_rows += torch_model.classify([torch_model.decode(bodies[n]) for n in chunk], chunk)
        slim_rows += slim_model.classify([slim_model.decode(bodies[n]) for n in chunk], chunk)
    return torch_rows, slim_rows


def assert_same_rows(slim_rows: list[dict], torch_rows: list[dict]) -> None:
    """Labels identical (tied probabilities in either order), every probability and score within
    PROB_TOLERANCE."""
    assert_rows_agree(slim_rows, torch_rows, PROB_TOLERANCE)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fp32", "int8"])
def test_rows_equal_the_torch_paths_with_the_calibrated_prob(exports, kind):
    path = exports["files"][kind]
    slim = OnnxServedModel.load(str(path), 5, 8)
    assert slim.export.temperature is not None and slim.export.temperature != 1.0  # the calibration is applied
    torch_rows, slim_rows = both_rows(path, exports["bodies"])
    assert_same_rows(slim_rows, torch_rows)
    assert {row["label"] for row in slim_rows} <= set(CLASSES) and len(slim_rows) == len(exports["bodies"])


@pytest.mark.slow
def test_reject_rows_equal_the_torch_paths(exports):
    """--reject (the stored energy threshold) and --reject-below X (set between the images' scores, so some
    are rejected and some kept): the same `unknown` labels, `predicted` and `score`."""
    path = exports["files"]["fp32"]
    torch_rows, slim_rows = both_rows(path, exports["bodies"], reject=True)
    assert_same_rows(slim_rows, torch_rows)
    scores = sorted(row["score"] for row in torch_rows)
    middle = (scores[len(scores) // 2 - 1] + scores[len(scores) // 2]) / 2
    torch_rows, slim_rows = both_rows(path, exports["bodies"], reject_below=middle)
    assert_same_rows(slim_rows, torch_rows)
    assert 0 < sum(row["label"] == "unknown" for row in slim_rows) < len(slim_rows)


@pytest.mark.slow
def test_multilabel_rows_equal_the_torch_paths(exports):
    path = exports["files"]["tags"]
    slim = OnnxServedModel.load(str(path), 5, 8)
    assert slim.export.task.name == "multilabel" and slim.export.tag_thresholds is not None
    torch_rows, slim_rows = both_rows(path, exports["tag_bodies"])
    assert_same_rows(slim_rows, torch_rows)
    assert any(row["labels"] for row in slim_rows)
    with pytest.raises(ConfigError, match="not for multi-label"):
        OnnxServedModel.load(str(path), 5, 8, reject=True)


# ---------------------------------------------------------------- usage errors (exit 2, before any work)


def serve_exit(*argv: str) -> tuple[int, str]:
    from conftest import exit_code

    import serve

    return exit_code(lambda: serve.main(["--onnx-only", "--port", "0", *argv]))


def test_onnx_only_refuses_what_it_cannot_serve(tmp_path, capsys):
    checkpoint = tmp_path / "best.pt"
    checkpoint.write_bytes(b"not read")
    assert serve_exit("--checkpoint", str(checkpoint)) == 2
    assert "only ONNX exports" in capsys.readouterr().err
    assert serve_exit("--checkpoint", str(tmp_path / "missing.onnx")) == 2
    assert serve_exit("--checkpoint", str(checkpoint), "--device", "cuda") == 2
    assert "--device cuda" in capsys.readouterr().err
    not_onnx = tmp_path / "model.onnx"
    not_onnx.write_bytes(b"not a protobuf")
    assert serve_exit("--checkpoint", str(not_onnx)) == 2
    assert "onnxruntime" in capsys.readouterr().err


@pytest.mark.parametrize("case, changes, named", BAD_METADATA, ids=[case for case, _, _ in BAD_METADATA])
def test_onnx_only_refuses_metadata_the_torch_path_refuses(tmp_path, capsys, monkeypatch, case, changes, named):
    """Issue 50 item 6: an export's spoilt metadata is refused before the port opens (exit 2, naming the field,
    its value and what is allowed), as the torch path refuses it; no class dropped, no 500 per request."""
    import imgcls.serving.slim as slim_server

    def port_opened(config):
        raise AssertionError(f"{case}: the server started on this export")
    monkeypatch.setattr(slim_server, "GracefulServer", port_opened)
    path = write_onnx(tmp_path / "model.onnx", spoilt(changes))
    assert serve_exit("--checkpoint", str(path)) == 2
    said = capsys.readouterr().err
    assert named in said and str(path) in said and "Traceback" not in said


def test_onnx_only_serves_good_metadata_as_the_torch_path(tmp_path):
    """The hand-built export the refusals start from is served, with the same rows on both paths."""
    from imgcls.serving.model import ServedModel

    path = write_onnx(tmp_path / "model.onnx", good_metadata())
    slim, torch_model = OnnxServedModel.load(str(path), 3, 4), ServedModel.load(str(path), 3, 4, "cpu")
    bodies = sample_images()
    names = list(bodies)[:4]
    got = slim.classify([slim.decode(bodies[n]) for n in names], names)
    want = torch_model.classify([torch_model.decode(bodies[n]) for n in names], names)
    assert got == want  # one rows path: the same NumPy code on the same logits
    assert slim.health()["preprocessing"] == torch_model.health()["preprocessing"]


@pytest.mark.slow
def test_a_non_finite_upload_is_a_bad_image_for_an_onnx_file_on_both_paths(exports):
    """main: a NaN float TIFF decoded to a black image (a row, not a 400); an inf .npy to a white one."""
    from imgcls.serving import BadImage
    from imgcls.serving.model import ServedModel

    tiff, npy = io.BytesIO(), io.BytesIO()
    Image.fromarray(np.full((20, 20), np.nan, np.float32)).save(tiff, format="TIFF")
    np.save(npy, np.full((20, 20, 3), np.inf, np.float32))
    path = str(exports["files"]["fp32"])
    for model, bodies in ((ServedModel.load(path, 5, 4, "cpu"), (tiff, npy)), (OnnxServedModel.load(path, 5, 4),
                                                                              (tiff,))):
        for body in bodies:
            with pytest.raises(BadImage) as caught:
                model.decode(body.getvalue())
            assert caught.value.kind == "non_finite_image", caught.value.detail
