"""Broken and unusual image files, and broken trees.

Every broken kind (truncated JPEG, zero-byte, text named .jpg, decompression bomb, unknown pixel mode)
is an ImageDecodeError; training replaces it by a seeded re-draw of its class and names it in
summary.json; evaluation leaves it out and says how many samples it evaluated. Image modes follow one
policy in training and evaluation (EXIF orientation, 16-bit, alpha on white, CMYK). A FIFO in a split is
skipped and named; a run that fails on its data ends at once, its loader workers with it.
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import IN_PROCESS, class_image, exit_code, make_cfg, make_tree, run_script, tiny_overrides
from PIL import Image

from imgcls.config import load_config
from imgcls.data.datasets import EvalDataset, TrainDataset
from imgcls.data.images import ImageDecodeError, load_rgb
from imgcls.data.listing import scan_split
from imgcls.data.transforms import EvalTransform, TrainTransform
from imgcls.training.trainer import run

# ---------------------------------------------------------------- broken files


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bytes(width: int, height: int, bit_depth: int, color_type: int, row: bytes) -> bytes:
    raw = (b"\x00" + row) * height
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, bit_depth, color_type,
                                                                    0, 0, 0))
            + _png_chunk(b"IDAT", zlib.compress(raw, 9)) + _png_chunk(b"IEND", b""))


def write_truncated_jpeg(path: Path) -> None:
    buffer = io.BytesIO()
    class_image(0, (32, 32)).save(buffer, "JPEG")
    path.write_bytes(buffer.getvalue()[: len(buffer.getvalue()) * 2 // 3])


def write_bomb(path: Path) -> None:
    """A 1-bit PNG of 20000 x 10000 pixels (200 MP, over PIL's 2 x MAX_IMAGE_PIXELS) in a few kB."""
    path.write_bytes(png_bytes(20000, 10000, 1, 0, bytes(20000 // 8)))


def write_unknown_mode(path: Path) -> None:
    """A PNG with colour type 5, which no PNG mode has."""
    path.write_bytes(png_bytes(8, 8, 8, 5, bytes(16)))


BROKEN = {
    "truncated.jpg": write_truncated_jpeg,
    "empty.jpg": lambda p: p.write_bytes(b""),
    "text.jpg": lambda p: p.write_text("this is not an image\n"),
    "bomb.png": write_bomb,
    "unknown_mode.png": write_unknown_mode,
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_every_broken_kind_is_an_image_decode_error(tmp_path, name):
    path = tmp_path / name
    BROKEN[name](path)
    with pytest.raises(ImageDecodeError, match=name):
        load_rgb(path)
    with pytest.raises(ImageDecodeError):
        EvalTransform(16, 0.875, "bilinear")(path)
    with pytest.raises(ImageDecodeError):
        TrainTransform(16, (0.25, 1.0), (0.75, 1.33), 0.5, 0.0, "bilinear")(path)


def test_the_bomb_is_a_decompression_bomb_error_not_an_os_error(tmp_path):
    path = tmp_path / "bomb.png"
    write_bomb(path)
    assert path.stat().st_size < 100_000
    with pytest.raises(Image.DecompressionBombError):
        Image.open(path)
    assert not issubclass(Image.DecompressionBombError, OSError)
    with pytest.raises(ImageDecodeError, match="DecompressionBombError"):
        load_rgb(path)


# ---------------------------------------------------------------- modes


def test_16_bit_grayscale_is_scaled_not_clipped_to_white(tmp_path):
    values = np.array([[0, 257 * 64, 32896, 65535]], dtype=np.uint16).repeat(4, axis=0)
    path = tmp_path / "gray16.png"
    Image.fromarray(values).save(path)
    assert Image.open(path).mode == "I;16"
    rgb = np.asarray(load_rgb(path))
    assert rgb.shape == (4, 4, 3)
    assert rgb[0, :, 0].tolist() == [0, 64, 128, 255]
    assert (rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 1] == rgb[..., 2]).all()


def _top_red_bottom_blue(width: int, height: int) -> Image.Image:
    a = np.zeros((height, width, 3), np.uint8)
    a[: height // 2, :, 0] = 255
    a[height // 2:, :, 2] = 255
    return Image.fromarray(a)


def test_exif_orientation_is_applied_the_same_way_in_train_and_eval(tmp_path):
    """Stored 32 wide x 24 high with orientation 6 (rotate 90 clockwise to display): displayed 24 x 32,
    red on top. Both transforms must give what the upright copy gives."""
    upright = _top_red_bottom_blue(24, 32)
    stored = upright.transpose(Image.Transpose.ROTATE_90)  # what a camera held sideways writes
    exif = Image.Exif()
    exif[0x0112] = 6
    rotated_path, upright_path = tmp_path / "exif6.png", tmp_path / "upright.png"
    stored.save(rotated_path, exif=exif)
    upright.save(upright_path)
    assert Image.open(rotated_path).size == (32, 24)
    assert load_rgb(rotated_path).size == (24, 32)
    assert np.array_equal(np.asarray(load_rgb(rotated_path)), np.asarray(upright))

    eval_tf = EvalTransform(16, 0.875, "bilinear")
    assert torch.equal(eval_tf(rotated_path), eval_tf(upright_path))
    train_tf = TrainTransform(16, (0.25, 1.0), (0.75, 1.33), 0.5, 0.0, "bilinear")
    for seed in range(5):
        assert torch.equal(train_tf(rotated_path, seed), train_tf(upright_path, seed))
    # Whole-image views: red on top in both.
    full = TrainTransform(16, (1.0, 1.0), (0.75, 0.75), 0.0, 0.0, "bilinear")(rotated_path)
    for img in (full, eval_tf(rotated_path)):
        assert img[0, 0].float().mean() > 200 and img[2, 0].float().mean() < 50
        assert img[2, -1].float().mean() > 200 and img[0, -1].float().mean() < 50


def test_exif_orientation_6_on_a_jpeg(tmp_path):
    upright = _top_red_bottom_blue(24, 32)
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "camera.jpg"
    upright.transpose(Image.Transpose.ROTATE_90).save(path, exif=exif, quality=95)
    full = np.asarray(load_rgb(path)).astype(int)
    assert full.shape == (32, 24, 3)
    assert full[2, :, 0].mean() > 200 and full[-3, :, 2].mean() > 200
    # Draft decoding at half size (the caller needs 12 x 16 as displayed) keeps the orientation.
    half = np.asarray(load_rgb(path, min_size=(12, 16))).astype(int)
    assert half.shape == (16, 12, 3)
    assert half[1, :, 0].mean() > 200 and half[-2, :, 2].mean() > 200
    # The training and evaluation transforms (whatever JPEG decoder they use) show it upright too.
    whole = TrainTransform(16, (1.0, 1.0), (0.75, 0.75), 0.0, 0.0, "bilinear")
    for size in (16, 8):  # 8: small enough for a reduced-size decode
        for img in (TrainTransform(size, (1.0, 1.0), (0.75, 0.75), 0.0, 0.0, "bilinear")(path),
                    EvalTransform(size, 0.875, "bilinear")(path)):
            assert img[0, 0].float().mean() > 200 and img[2, 0].float().mean() < 60, size
            assert img[2, -1].float().mean() > 200 and img[0, -1].float().mean() < 60, size
    assert whole(path).shape == (3, 16, 16)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparency_is_composited_on_white(tmp_path, mode):
    path = tmp_path / f"{mode}.png"
    if mode == "RGBA":
        a = np.zeros((4, 4, 4), np.uint8)
        a[:, :2] = (255, 0, 0, 128)  # half-transparent red; the right half fully transparent black
        Image.fromarray(a, "RGBA").save(path)
        expected_left = (255, 127, 127)
    elif mode == "LA":
        a = np.zeros((4, 4, 2), np.uint8)
        a[:, :2] = (0, 255)  # opaque black; the right half transparent black
        Image.fromarray(a, "LA").save(path)
        expected_left = (0, 0, 0)
    else:
        img = Image.new("P", (4, 4), 1)
        img.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
        img.paste(0, (2, 0, 4, 4))  # index 0 (black) is the transparent one
        img.save(path, transparency=0)
        expected_left = (255, 0, 0)
    assert Image.open(path).mode == mode
    rgb = np.asarray(load_rgb(path)).astype(int)
    assert (rgb[:, 2:] == 255).all(), "transparent pixels must come out white"
    assert np.abs(rgb[:, :2] - np.array(expected_left)).max() <= 1


def test_cmyk_is_converted(tmp_path):
    path = tmp_path / "cmyk.jpg"
    Image.new("CMYK", (8, 8), (0, 255, 255, 0)).save(path, quality=95)
    assert Image.open(path).mode == "CMYK"
    rgb = np.asarray(load_rgb(path)).astype(int)
    assert np.abs(rgb - np.array([255, 0, 0])).max() <= 8


# ---------------------------------------------------------------- datasets


def test_train_dataset_redraws_a_broken_file_from_its_class_deterministically(tmp_path):
    root = make_tree(tmp_path / "d", {"a": 4, "b": 4}, splits=("train",))
    broken = root / "train" / "b" / "b_0001.png"
    broken.write_bytes(b"")
    index = scan_split(root / "train")
    dataset = TrainDataset(index, TrainTransform(16, (0.5, 1.0), (0.75, 1.33), 0.5, 0.0, "bilinear"))
    i = index.paths.index(str(broken))
    image, label, bad = dataset[(i, 1234)]
    assert (label, bad) == (1, i)
    again, _, _ = dataset[(i, 1234)]
    assert torch.equal(image, again)
    # The stand-in is one of the class's readable files.
    candidates = [j for j, lab in enumerate(index.labels) if lab == 1 and j != i]
    substitutes = []
    for j in candidates:
        out, _, ok = dataset[(j, 1234)]
        assert ok == -1
        substitutes.append(torch.equal(out, image))
    assert any(substitutes)


def test_eval_dataset_marks_a_broken_file_invalid_and_never_substitutes(tmp_path):
    root = make_tree(tmp_path / "d", {"a": 2, "b": 2}, splits=("val",))
    (root / "val" / "a" / "a_0000.png").write_bytes(b"not a png")
    dataset = EvalDataset(scan_split(root / "val"), EvalTransform(16, 0.875, "bilinear"), 16)
    image, label, valid, index = dataset[0]
    assert (label, valid, index) == (0, False, 0) and not image.any()
    assert dataset[1][2] is True


# ---------------------------------------------------------------- a salted tree, end to end


def salted_tree(root: Path) -> tuple[Path, list[str], list[str]]:
    """3 classes x 9 readable training images + 5 broken ones (32 = 4 batches of 8, so every file is read
    in one epoch); 3 x 3 validation images + 1 broken; a hidden folder, a hidden file, a text file."""
    make_tree(root, {"a": (9, 3), "b": (9, 3), "c": (9, 3)})
    bad_train = []
    for (name, write), cls in zip(sorted(BROKEN.items()), "abcab"):
        path = root / "train" / cls / f"zz_{name}"
        write(path)
        bad_train.append(str(path))
    bad_val = root / "val" / "b" / "zz_empty.jpg"
    bad_val.write_bytes(b"")
    hidden = root / "train" / ".thumbnails"
    hidden.mkdir()
    class_image(0).save(hidden / "x.png")
    (root / "train" / "a" / ".hidden.png").write_bytes(b"")
    (root / "train" / "c" / "notes.txt").write_text("not an image")
    return root, sorted(bad_train), [str(bad_val)]


@pytest.mark.slow
def test_a_salted_tree_trains_keeps_the_classes_and_names_the_broken_files(tmp_path):
    root, bad_train, bad_val = salted_tree(tmp_path / "data")
    out = tmp_path / "run"
    done = run_script("train.py", "--config", "base", *tiny_overrides(
        root, out, **{"model.name": "test_resnet", "train.epochs": 1, "data.num_workers": 2,
                      "data.max_bad_fraction": 0.2, "output.tensorboard": "false"}))
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["classes"] == ["a", "b", "c"]
    assert sorted(summary["skipped_files"]) == bad_train
    assert summary["skipped_val_files"] == bad_val
    assert summary["best"]["num_samples"] == 9  # 10 validation files, the broken one left out
    assert summary["steps_completed"] == 4
    log = (out / "train.log").read_text()
    # each skipped file is named with the reason, in infer.py's words
    reasons = {path: reason for reason, path in re.findall(
        r"unreadable training file skipped \((.+); replaced by another image of its class\): (\S+)", log)}
    assert sorted(reasons) == bad_train
    by_name = {os.path.basename(path).removeprefix("zz_"): reason for path, reason in reasons.items()}
    assert by_name["empty.jpg"] == "empty file"
    assert "cannot identify image file" in by_name["text.jpg"]
    assert "DecompressionBombError" in by_name["bomb.png"]
    assert all(reason and not reason.startswith("could not be read") for reason in by_name.values())
    assert "32 training images" in log
    ckpt = torch.load(out / "last.pt", map_location="cpu", weights_only=True)
    assert ckpt["classes"] == ["a", "b", "c"]


@pytest.mark.slow
@pytest.mark.parametrize("every_steps", [0, 1])
def test_more_broken_files_than_max_bad_fraction_exits_1_listing_them(tmp_path, capsys, every_steps):
    """Checked at the epoch end, and at each mid-epoch checkpoint (which stops the run sooner)."""
    root, bad_train, _ = salted_tree(tmp_path / "data")
    out = tmp_path / "run"
    cfg = load_config("base", tiny_overrides(root, out, **{"model.name": "test_resnet", "train.epochs": 1,
                                                           "output.tensorboard": "false",
                                                           "checkpoint.every_steps": every_steps}))
    assert cfg.data.max_bad_fraction == 0.01  # the default
    assert exit_code(lambda: run(cfg)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    summary = json.loads((out / "summary.json").read_text())
    if every_steps == 0:
        assert "5 of 32 training files could not be read, more than data.max_bad_fraction=0.01" in err
        for path in bad_train:
            assert path in err
        assert summary["skipped_files"] == bad_train
    else:
        assert summary["steps_completed"] < 4  # stopped at the first checkpoint after the limit was passed
        seen = summary["skipped_files"]
        assert seen and set(seen) <= set(bad_train)
        assert f"{len(seen)} of 32 training files could not be read" in err
        assert all(path in err for path in seen)
    assert not (out / "last.pt").exists() or torch.load(out / "last.pt", weights_only=True)["step"] < 4


@pytest.mark.slow
def test_broken_validation_files_above_the_limit_exit_1(tmp_path, capsys):
    root = make_tree(tmp_path / "data", {"a": (8, 2), "b": (8, 2)})
    (root / "val" / "a" / "a_0000.png").write_bytes(b"")
    cfg = load_config("base", tiny_overrides(root, tmp_path / "run", **{"model.name": "test_resnet",
                                                                        "train.epochs": 1}))
    assert exit_code(lambda: run(cfg)) == 1
    err = capsys.readouterr().err
    assert "1 of 4 validation files could not be read" in err and "a_0000.png" in err


@pytest.mark.slow
def test_an_empty_class_folder_exits_2_naming_it(tmp_path, capsys):
    root = make_tree(tmp_path / "data", {"a": 4, "b": 4})
    (root / "train" / "empty_cls").mkdir()
    (root / "val" / "empty_cls").mkdir()
    class_image(0).save(root / "val" / "empty_cls" / "x.png")
    (root / "train" / "empty_cls" / "readme.txt").write_text("no images here")
    cfg = load_config("base", tiny_overrides(root, tmp_path / "run", **{"model.name": "test_resnet"}))
    assert exit_code(lambda: run(cfg)) == 2
    err = capsys.readouterr().err
    assert "class folder(s) with no image files: empty_cls" in err
    assert not (tmp_path / "run" / "train.log").exists()  # refused before it logged: no empty train.log


@pytest.mark.slow
def test_train_and_val_class_sets_that_differ_exit_2_listing_the_difference(tmp_path, capsys):
    root = make_tree(tmp_path / "data", {"a": 4, "b": 4, "c": (4, 0)}, splits=("train", "val"))
    (root / "val" / "c").rmdir()
    (root / "val" / "d").mkdir()
    class_image(1).save(root / "val" / "d" / "x.png")
    cfg = load_config("base", tiny_overrides(root, tmp_path / "run", **{"model.name": "test_resnet"}))
    assert exit_code(lambda: run(cfg)) == 2
    err = capsys.readouterr().err
    assert "missing here: ['c']" in err and "not in training: ['d']" in err


@pytest.mark.slow
def test_a_run_with_a_fifo_in_the_validation_split_finishes_and_names_it(faults_tree, tmp_path):
    """The FIFO used to block validation for ever (and infer.py too)."""
    root = tmp_path / "data"
    shutil.copytree(faults_tree, root)
    fifo = root / "val" / "a" / "pipe.jpg"
    os.mkfifo(fifo)
    out = tmp_path / "run"
    done = run_script("train.py", "--config", "base", *tiny_overrides(root, out, **(IN_PROCESS | {
        "train.epochs": 1, "data.num_workers": 2})), timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{fifo} (a FIFO)" in (out / "train.log").read_text()
    assert json.loads((out / "summary.json").read_text())["best"]["num_samples"] == 9
    inferred = run_script("infer.py", str(root / "val"), str(fifo), "--checkpoint", str(out / "best.pt"),
                          "--num-workers", "0", timeout=240)
    assert inferred.returncode == 0, inferred.stderr[-3000:]
    assert "not a regular file (a FIFO)" in inferred.stdout


@pytest.mark.slow
def test_a_failing_run_with_loader_workers_exits_at_once_without_a_worker_traceback(tmp_path):
    """Every file of a class junk (re-draws give up): the workers were left to interpreter exit, which
    waited out their 60 s SIGTERM grace and printed 'DataLoader worker ... killed by signal: Alarm clock'."""
    root = make_tree(tmp_path / "data", {"a": (8, 2), "b": (8, 2)})
    for path in (root / "train" / "b").iterdir():
        path.write_bytes(b"junk")
    out = tmp_path / "run"
    done = run_script("train.py", "--config", "base", *tiny_overrides(root, out, **(IN_PROCESS | {
        "data.num_workers": 2, "data.max_bad_fraction": 1.0})), timeout=240)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "20 files of class 'b' in a row could not be read" in done.stderr
    assert "killed by signal" not in done.stderr and "Alarm clock" not in done.stderr
    assert "Traceback" not in done.stderr  # the worker's traceback is not the message


@pytest.mark.slow
def test_a_validation_of_zero_samples_is_an_error_not_a_best(tmp_path, capsys):
    root = make_tree(tmp_path / "data", {"a": (8, 2), "b": (8, 2)})
    for path in (root / "val").rglob("*.png"):
        path.write_bytes(b"")
    out = tmp_path / "run"
    cfg = make_cfg(root, out, **{"data.max_bad_fraction": 1.0, "train.epochs": 1})
    assert exit_code(lambda: run(cfg)) == 1
    assert "validation evaluated no image" in capsys.readouterr().err
    assert not (out / "best.pt").exists()


@pytest.mark.slow
def test_a_split_with_one_class_exits_2(tmp_path, capsys):
    root = make_tree(tmp_path / "data", {"only": (8, 2)})
    cfg = make_cfg(root, tmp_path / "run")
    assert exit_code(lambda: run(cfg)) == 2
    assert "needs at least two classes" in capsys.readouterr().err
