"""The uint8 training pipeline keeps the pixel policy: the same pixels as a plain full decode where no
reduced (draft) decode applies, close to them where it does, EXIF and modes as in data/images.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as F

from imgcls.benchmarking.modes import photo
from imgcls.data.datasets import TrainDataset
from imgcls.data.images import ImageDecodeError, load_rgb, open_image, oriented_size
from imgcls.data.listing import scan_split
from imgcls.data.transforms import TrainTransform, normalize_batch, read_source


def _jpeg(path, size, mode="RGB", orientation=None, seed=0):
    array = photo(np.random.default_rng(seed), *size)
    img = Image.fromarray(array)
    if mode == "L":
        img = img.convert("L")
    if mode == "CMYK":
        img = img.convert("CMYK")
    exif = None
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
    img.save(path, quality=90, **({"exif": exif} if exif is not None else {}))
    return path


def _reference(path, img_size):
    """A full decode by PIL (no draft), the whole image as the crop, the same resize."""
    full = F.pil_to_tensor(load_rgb(path))
    return F.resize(full, [img_size, img_size], interpolation=InterpolationMode.BILINEAR, antialias=True)


def _whole_image_transform(img_size):
    # scale = ratio range pinned so the crop is the whole image whatever the random draw (for 4:3 images)
    return TrainTransform(img_size, scale=(1.0, 1.0), ratio=(4 / 3, 4 / 3), hflip=0.0, color_jitter=0.0,
                          interpolation="bilinear")


@pytest.mark.parametrize("mode,orientation", [("RGB", None), ("L", None), ("RGB", 6), ("RGB", 3)])
def test_jpeg_decode_gives_the_same_pixels_as_pil(tmp_path, mode, orientation):
    path = _jpeg(tmp_path / "a.jpg", (96, 72), mode, orientation)
    with open_image(path) as pil:
        assert read_source(path).size == oriented_size(pil)
    decoded = F.pil_to_tensor(read_source(path).rgb())
    assert decoded.dtype == torch.uint8 and torch.equal(decoded, F.pil_to_tensor(load_rgb(path)))


def test_no_reduction_same_pixels_as_full_decode(tmp_path):
    # 96x72 to 64 px: a draft decode would go below the crop size, so the full image is decoded
    path = _jpeg(tmp_path / "a.jpg", (96, 72))
    out = _whole_image_transform(64)(path)
    assert out.shape == (3, 64, 64) and out.dtype == torch.uint8
    assert torch.equal(out, _reference(path, 64))


def test_draft_reduction_close_to_full_decode(tmp_path):
    # 640x480 to 64 px: decoded at 1/4 scale (160x120), still >= the crop's 64 px
    path = _jpeg(tmp_path / "big.jpg", (640, 480))
    out = _whole_image_transform(64)(path).int()
    ref = _reference(path, 64).int()
    diff = (out - ref).abs().float()
    assert diff.mean() < 2.0 and diff.max() < 40


def test_other_modes_fall_back_to_pil_with_the_same_policy(tmp_path):
    path = _jpeg(tmp_path / "cmyk.jpg", (96, 72), mode="CMYK")
    out = _whole_image_transform(64)(path)
    assert torch.equal(out, _reference(path, 64))
    png = tmp_path / "a.png"
    Image.fromarray(photo(np.random.default_rng(1), 96, 72)).save(png)
    assert torch.equal(_whole_image_transform(64)(png), _reference(png, 64))


@pytest.mark.parametrize("size", [(96, 72), (640, 480), (1000, 750)])
def test_libjpeg_turbo_decodes_plain_jpegs_to_the_pil_path_s_pixels(tmp_path, monkeypatch, size):
    """Training's random crops of a plain JPEG, from libjpeg-turbo's array (simplejpeg, at PIL draft's scale:
    full, 1/2, 1/4, 1/8 by the crop) and from PIL: the same pixels. A rotated, grey, CMYK or non-JPEG file is
    PIL's alone."""
    import imgcls.data.images as images

    path = _jpeg(tmp_path / "a.jpg", size, seed=3)
    transforms = [TrainTransform(s, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), hflip=0.5, color_jitter=0.0,
                                 interpolation="bilinear") for s in (16, 64, 224)]
    with open_image(path) as pil:
        array = images.decode_plain_jpeg(pil, path.read_bytes(), (size[0] // 8, size[1] // 8))
    assert (array is not None) == (images.simplejpeg is not None)  # a requirement: absent, PIL decodes it
    if array is not None:
        assert array.shape == ((size[1] + 7) // 8, (size[0] + 7) // 8, 3)  # the 1/8 draft PIL would take
    fast = [t(path, seed) for t in transforms for seed in range(8)]
    monkeypatch.setattr(images, "simplejpeg", None)
    assert all(torch.equal(a, t(path, seed)) for a, (t, seed) in
               zip(fast, [(t, seed) for t in transforms for seed in range(8)]))
    monkeypatch.undo()
    for name, kwargs in (("rotated.jpg", {"orientation": 6}), ("grey.jpg", {"mode": "L"}),
                         ("cmyk.jpg", {"mode": "CMYK"})):
        other = _jpeg(tmp_path / name, size, **kwargs)
        with open_image(other) as pil:
            assert images.decode_plain_jpeg(pil, other.read_bytes(), (16, 16)) is None, name


def test_only_a_plain_upright_colour_jpeg_skips_pil_s_open(tmp_path, monkeypatch):
    """The header read that lets a plain JPEG skip PIL's open names its size only where PIL would open it as an
    upright colour JPEG: any EXIF or XMP block (even orientation 1), a grey or CMYK file, another format, or
    more pixels than PIL's limit go through PIL as before (its orientation, its mode, its refusal)."""
    import imgcls.data.images as images
    from imgcls.data.images import plain_jpeg_size

    plain = _jpeg(tmp_path / "plain.jpg", (97, 61))
    assert plain_jpeg_size(plain.read_bytes()) == (97, 61)
    assert read_source(plain).size == (97, 61)
    for name, kwargs in (("upright_exif.jpg", {"orientation": 1}), ("rotated.jpg", {"orientation": 6}),
                         ("grey.jpg", {"mode": "L"}), ("cmyk.jpg", {"mode": "CMYK"})):
        assert plain_jpeg_size(_jpeg(tmp_path / name, (40, 30), **kwargs).read_bytes()) is None, name
    xmp = b"http://ns.adobe.com/xap/1.0/\0<x:xmpmeta/>"
    data = plain.read_bytes()
    assert plain_jpeg_size(data[:2] + b"\xff\xe1" + (len(xmp) + 2).to_bytes(2, "big") + xmp + data[2:]) is None
    png = tmp_path / "a.png"
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(png)
    assert plain_jpeg_size(png.read_bytes()) is None and plain_jpeg_size(b"\xff\xd8") is None
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 97 * 61 - 1)
    assert plain_jpeg_size(data) is None
    monkeypatch.setattr(images, "simplejpeg", None)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", None)
    assert plain_jpeg_size(data) is None


def test_truncated_jpeg_is_still_refused(tmp_path):
    path = _jpeg(tmp_path / "a.jpg", (96, 72))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ImageDecodeError):
        _whole_image_transform(64)(path)


def test_augmentation_is_a_function_of_the_sample_seed(tmp_path):
    root = tmp_path / "train"
    for i in range(3):
        (root / "c").mkdir(parents=True, exist_ok=True)
        _jpeg(root / "c" / f"{i}.jpg", (200, 150), seed=i)
    transform = TrainTransform(32, (0.08, 1.0), (3 / 4, 4 / 3), 0.5, 0.0, "bilinear")
    dataset = TrainDataset(scan_split(root), transform)
    a, b = dataset[(1, 12345)][0], dataset[(1, 12345)][0]
    assert torch.equal(a, b)
    assert not all(torch.equal(a, dataset[(1, seed)][0]) for seed in range(5))


def test_normalize_batch_matches_the_formula_and_layout():
    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    expected = (images.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    out = normalize_batch(images, mean, std, channels_last=True)
    assert out.dtype == torch.float32 and out.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(out, expected, atol=1e-5)
    assert normalize_batch(images, mean, std, dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("orientation", [None, 1, 2, 3, 4, 5, 6, 7, 8, 9])
@pytest.mark.parametrize("mode,progressive", [("RGB", False), ("L", False), ("RGB", True), ("CMYK", False)])
def test_the_displayed_size_and_pixels_agree_with_pil(tmp_path, orientation, mode, progressive):
    path = tmp_path / "a.jpg"
    img = Image.fromarray(photo(np.random.default_rng(0), 50, 30)).convert(mode)
    kwargs = {"quality": 85, "progressive": progressive}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        exif[0x010F] = "maker"  # a second tag, so the orientation is not the only IFD entry
        kwargs["exif"] = exif
    img.save(path, **kwargs)
    with open_image(path) as pil:
        assert read_source(path).size == oriented_size(pil)
    assert torch.equal(F.pil_to_tensor(read_source(path).rgb()), F.pil_to_tensor(load_rgb(path)))


def test_an_orientation_only_xmp_carries_is_applied(tmp_path):
    good = tmp_path / "a.jpg"
    Image.fromarray(photo(np.random.default_rng(0), 40, 30)).save(good, quality=85)
    data = good.read_bytes()
    xmp = b"http://ns.adobe.com/xap/1.0/\0<x:xmpmeta><rdf:Description tiff:Orientation=\"6\"/></x:xmpmeta>"
    segment = b"\xff\xe1" + (len(xmp) + 2).to_bytes(2, "big") + xmp
    rotated = tmp_path / "xmp.jpg"
    rotated.write_bytes(data[:2] + segment + data[2:])
    assert read_source(rotated).size == (30, 40)                  # PIL reads XMP's orientation: upright
    assert tuple(F.pil_to_tensor(read_source(rotated).rgb()).shape) == (3, 40, 30)
    out = TrainTransform(16, (1.0, 1.0), (4 / 3, 4 / 3), 0.0, 0.0, "bilinear")(rotated)
    assert out.shape == (3, 16, 16)


@pytest.mark.parametrize("size", [(120, 90), (90, 120), (97, 61)])
def test_eval_transform_is_the_pil_resize_and_centre_crop(tmp_path, size):
    from imgcls.data.transforms import EvalTransform

    path = _jpeg(tmp_path / "a.jpg", size)
    transform = EvalTransform(48, 0.875, "bilinear")
    out = transform(path)
    reference = transform.from_image(load_rgb(path))  # PIL: resize the shorter side, centre crop
    assert out.shape == reference.shape == (3, 48, 48) and out.dtype == torch.uint8
    assert torch.equal(out, reference)


@pytest.mark.parametrize("size", [(640, 480), (1000, 750), (97, 61)])
def test_eval_transform_decodes_plain_jpegs_by_libjpeg_turbo_to_pil_s_pixels(tmp_path, monkeypatch, size):
    """Evaluation's decode (validation, eval.py, infer.py, serve.py) of a plain JPEG goes through libjpeg-turbo's
    array at PIL draft's scale: the same uint8 crop as PIL's decode, at full, 1/2 and 1/4 scale."""
    import imgcls.data.images as images
    from imgcls.data.transforms import EvalTransform

    path = _jpeg(tmp_path / "a.jpg", size, seed=5)
    calls = []
    real = images.decode_jpeg_array
    monkeypatch.setattr("imgcls.data.transforms.decode_jpeg_array", lambda *a: calls.append(a[2]) or real(*a))
    transforms = [EvalTransform(s, 0.875, "bilinear") for s in (32, 112, 224)]
    fast = [t(path) for t in transforms]
    assert len(calls) == len(transforms)  # every decode asked libjpeg-turbo first
    monkeypatch.setattr(images, "simplejpeg", None)
    assert all(torch.equal(a, t(path)) for a, t in zip(fast, transforms))


def test_sample_crop_boxes_follow_scale_and_ratio():
    import math
    import random

    from imgcls.data.transforms import sample_crop

    rng = random.Random(0)
    for _ in range(2000):
        width, height = rng.randint(40, 900), rng.randint(40, 900)
        top, left, h, w = sample_crop(width, height, (0.08, 1.0), (3 / 4, 4 / 3), rng)
        assert 0 <= top and top + h <= height and 0 <= left and left + w <= width and h > 0 and w > 0
        if (w, h) != (width, height) and (top, left) != ((height - h) // 2, (width - w) // 2):
            # a drawn box (not the fallback): its area and aspect lie in the ranges, up to pixel rounding
            assert 0.08 * width * height * 0.8 <= w * h <= width * height
            assert 3 / 4 - 0.1 <= w / h <= 4 / 3 + 0.1
    # the same seed draws the same box; positions vary across seeds
    assert sample_crop(500, 375, (0.08, 1), (3 / 4, 4 / 3), random.Random(7)) == \
        sample_crop(500, 375, (0.08, 1), (3 / 4, 4 / 3), random.Random(7))
    assert len({sample_crop(500, 375, (0.08, 1), (3 / 4, 4 / 3), random.Random(s)) for s in range(20)}) == 20
    # no box of that aspect fits a 1000x10 strip: the centred fallback with the ratio clamped
    assert sample_crop(1000, 10, (0.5, 1.0), (3 / 4, 4 / 3), random.Random(0)) == (0, 493, 10, 13)
    # scale pinned to 1 and the image's own ratio: the whole image
    assert sample_crop(400, 300, (1.0, 1.0), (4 / 3, 4 / 3), random.Random(0)) == (0, 0, 300, 400)
    assert math.isclose(400 / 300, 4 / 3)
