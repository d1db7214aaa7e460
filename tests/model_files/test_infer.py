"""infer.py: padded fixed-shape batches, every decodable image mode, error rows, exit codes, outputs (never a
folder, names with newlines quoted), a model whose outputs are not finite."""
from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, class_image, exit_code, run_script, train_tiny
from PIL import Image

import infer
from imgcls.compute.device import DeviceInput
from imgcls.config import ConfigError
from imgcls.core.errors import CheckpointError
from imgcls.data.datasets import FileListDataset, build_inference_loader, expand_inputs
from imgcls.data.listing import DataTreeError
from imgcls.data.transforms import EvalTransform
from imgcls.evaluation.evaluate import predict
from imgcls.model_files.checkpoint_files import build_eval_model, read_checkpoint
from imgcls.tasks.rows import format_predictions_table

CLASSES = ["a", "b", "c"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """best.pt of one tiny training run shared by the module."""
    return train_tiny(tmp_path_factory.mktemp("infer"), {name: (12, 3) for name in CLASSES})[1]


@pytest.fixture
def images(tmp_path):
    """Seven readable 20x28 RGB PNGs, two per class and one extra."""
    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(1)
    for i in range(7):
        class_image(i % 3, size=(28, 20), rng=rng).save(folder / f"img{i}.png")
    return folder


def _infer_json(tmp_path, *args, name="out.json") -> tuple[int, list[dict]]:
    out = tmp_path / name
    code = infer.main([*map(str, args), "--output", str(out)])
    return code, json.loads(out.read_text())


def _by_name(rows):
    return {os.path.basename(r["path"]): r for r in rows}


@pytest.mark.slow
def test_padded_batches_give_the_same_results_for_any_batch_size(checkpoint, images, tmp_path):
    results = {}
    for batch_size, workers in ((1, 0), (3, 2), (8, 0)):
        code, rows = _infer_json(tmp_path, images, "--checkpoint", checkpoint, "--batch-size", batch_size,
                                 "--num-workers", workers, "--topk", 3, name=f"b{batch_size}.json")
        assert code == 0 and len(rows) == 7
        results[batch_size] = rows
    reference = results[1]
    for rows in results.values():
        for got, want in zip(rows, reference):
            assert got["path"] == want["path"]
            assert [got[f"top{j}_label"] for j in (1, 2, 3)] == [want[f"top{j}_label"] for j in (1, 2, 3)]
            assert [got[f"top{j}_prob"] for j in (1, 2, 3)] == pytest.approx(
                [want[f"top{j}_prob"] for j in (1, 2, 3)], abs=1e-6)
        assert sum(r["top1_prob"] + r["top2_prob"] + r["top3_prob"] for r in rows) == pytest.approx(7.0, abs=1e-5)


@pytest.mark.slow
def test_every_forward_pass_sees_the_full_batch_and_padding_is_dropped(checkpoint, images):
    loaded = read_checkpoint(checkpoint)
    model = build_eval_model(loaded, torch.device("cpu"), channels_last=True)
    shapes = []
    model.register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape)))
    paths = sorted(str(p) for p in images.iterdir())
    dataset = FileListDataset(paths, loaded.eval_transform(), loaded.cfg.data.img_size)
    loader = build_inference_loader(dataset, 3, 0, pin_memory=False)
    d = loaded.cfg.data
    preds = predict(model, loader, DeviceInput(torch.device("cpu"), d.mean, d.std, True, None), k=3)
    assert shapes == [(3, 3, d.img_size, d.img_size)] * 3  # 7 images: 3 + 3 + (1 real + 2 padding)
    assert preds.top_probs.shape == (7, 3) and bool(preds.valid.all())
    # the unpadded reference: each image alone through the model
    from imgcls.data.transforms import normalize_batch

    with torch.inference_mode():
        for i, path in enumerate(paths):
            x = normalize_batch(dataset[i][0][None], d.mean, d.std, channels_last=True)
            probs = model(x).softmax(1)[0]
            assert preds.top_probs[i].tolist() == pytest.approx(probs.sort(descending=True).values.tolist(), abs=1e-6)
            assert preds.top_indices[i, 0].item() == int(probs.argmax())


def _save_modes(folder):
    """Each decodable kind of file, and its plain-RGB equivalent under the policy of data/images.py.
    Returns {special file: its plain twin}."""
    rgb = class_image(1, size=(40, 30), rng=np.random.default_rng(5))
    gray = rgb.convert("L")
    palette = rgb.convert("P", palette=Image.ADAPTIVE, colors=16)
    rgba = rgb.convert("RGBA")
    alpha = np.full((30, 40), 255, np.uint8)
    alpha[:, :20] = 0
    alpha[:10, 20:] = 128
    rgba.putalpha(Image.fromarray(alpha))
    on_white = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed after a 90 degree clockwise turn
    stored = rgb.transpose(Image.Transpose.ROTATE_90)  # so it is stored turned counter-clockwise

    gray.save(folder / "gray.png")
    palette.save(folder / "palette.png")
    palette.save(folder / "palette_alpha.png", transparency=0)  # palette entry 0 is transparent
    with Image.open(folder / "palette_alpha.png") as img:
        palette_on_white = Image.alpha_composite(Image.new("RGBA", img.size, (255, 255, 255, 255)),
                                                 img.convert("RGBA")).convert("RGB")
    rgba.save(folder / "rgba.png")
    Image.fromarray(np.asarray(gray).astype(np.uint16) * 257).save(folder / "gray16.png")
    stored.save(folder / "exif_rotated.png", exif=exif.tobytes())
    pairs = {"gray.png": gray.convert("RGB"), "palette.png": palette.convert("RGB"),
             "palette_alpha.png": palette_on_white, "rgba.png": on_white,
             "gray16.png": gray.convert("RGB"), "exif_rotated.png": rgb}
    for name, plain in pairs.items():
        plain.save(folder / f"plain_{name}")
    rgb.convert("CMYK").save(folder / "cmyk.jpg", quality=95)
    stored.save(folder / "exif_rotated.jpg", exif=exif.tobytes(), quality=95)
    rgb.resize((4000, 3000), Image.NEAREST).save(folder / "large.jpg", quality=80)
    rgb.save(folder / "lossless.webp", lossless=True)
    rgb.save(folder / "plain.tif")
    return {name: f"plain_{name}" for name in pairs}


@pytest.mark.slow
def test_every_image_mode_is_classified(checkpoint, tmp_path):
    folder = tmp_path / "modes"
    folder.mkdir()
    pairs = _save_modes(folder)
    with Image.open(folder / "gray16.png") as img:
        assert img.mode.startswith("I")  # really a 16-bit file
    with Image.open(folder / "cmyk.jpg") as img:
        assert img.mode == "CMYK"
    code, rows = _infer_json(tmp_path, folder, "--checkpoint", checkpoint, "--batch-size", 4)
    assert code == 0
    rows = _by_name(rows)
    assert len(rows) == 2 * len(pairs) + 5
    for name, row in rows.items():
        assert row["error"] is None and row["label"] in CLASSES and 0 < row["prob"] <= 1, name
    for special, plain in pairs.items():  # alpha on white, 16 -> 8 bits, EXIF orientation applied, ...
        assert rows[special]["label"] == rows[plain]["label"], special
        assert rows[special]["prob"] == pytest.approx(rows[plain]["prob"], abs=1e-5), special


def _broken_files(folder):
    good = class_image(0, size=(32, 32))
    buffer = io.BytesIO()
    good.save(buffer, "JPEG")
    (folder / "truncated.jpg").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    (folder / "empty.png").write_bytes(b"")
    (folder / "notes.jpg").write_text("this is text, not an image\n")


@pytest.mark.slow
def test_broken_files_get_error_rows_and_the_run_goes_on(checkpoint, images, tmp_path):
    _broken_files(images)
    out = tmp_path / "out.csv"
    result = run_script("infer.py", str(images), "--checkpoint", str(checkpoint), "--batch-size", "4",
                        "--output", str(out), "--topk", "5")
    assert result.returncode == 0, result.stderr[-2000:]
    with open(out, newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames
        rows = _by_name(list(reader))
    # --topk 5 is clipped to the 3 classes
    assert header == ["path", "label", "prob", "top1_label", "top1_prob", "top2_label", "top2_prob",
                      "top3_label", "top3_prob", "error"]
    assert len(rows) == 10
    for name in ("truncated.jpg", "empty.png", "notes.jpg"):
        assert rows[name]["error"] and rows[name]["label"] == "" and rows[name]["prob"] == "", name
        assert f"could not read {images / name}" in result.stderr
    assert rows["empty.png"]["error"] == "empty file"
    for i in range(7):
        row = rows[f"img{i}.png"]
        assert row["error"] == "" and row["label"] == row["top1_label"] in CLASSES
        assert float(row["top1_prob"]) >= float(row["top2_prob"]) >= float(row["top3_prob"]) > 0
    assert "classified 7 of 10" in result.stderr
    assert b"\r" not in out.read_bytes()  # \n line endings, for cut and friends
    # stdout is the table alone (header and one row per file): status lines go to stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["path", "label", "prob"] and len(lines) == 11
    assert f"checkpoint: {checkpoint}" in result.stderr
    table = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert table[str(images / "img0.png")] == [rows["img0.png"]["label"], f"{float(rows['img0.png']['prob']):.4f}"]
    assert table[str(images / "empty.png")][:3] == ["-", "-", "error:"]


@pytest.mark.slow
def test_a_non_finite_file_is_an_error_row_naming_it_and_its_neighbours_are_classified(checkpoint, images, tmp_path,
                                                                                      capsys, caplog):
    np.save(images / "inf.npy", np.full((20, 28, 3), np.inf, np.float32))
    Image.fromarray(np.full((20, 28), np.nan, np.float32)).save(images / "nan.tif")
    np.save(images / "huge.npy", np.full((20, 28, 3), 1e30, np.float32))
    out = tmp_path / "rows.csv"
    assert infer.main([str(images), "--checkpoint", str(checkpoint), "--output", str(out), "--batch-size", "8"]) == 0
    with open(out, newline="") as f:
        rows = _by_name(list(csv.DictReader(f)))
    assert "samples are not finite (NaN or infinity)" in rows["inf.npy"]["error"]
    assert "samples are not finite (NaN or infinity)" in rows["nan.tif"]["error"]
    assert "outside the declared range" in rows["huge.npy"]["error"]
    assert all(rows[f"img{i}.png"]["error"] == "" and rows[f"img{i}.png"]["label"] in CLASSES for i in range(7))
    err = capsys.readouterr().err + caplog.text
    assert "classified 7 of 10" in err and f"could not read {images / 'inf.npy'}" in err
    assert "not finite (NaN or infinity) for" not in err  # the model is not blamed


@pytest.mark.slow
def test_all_broken_input_exits_1(checkpoint, tmp_path, capsys):
    folder = tmp_path / "broken"
    folder.mkdir()
    _broken_files(folder)
    assert infer.main([str(folder), "--checkpoint", str(checkpoint)]) == 1
    assert "classified 0 of 3" in capsys.readouterr().err


@pytest.mark.slow
def test_default_checkpoint_is_the_newest_best_pt_under_runs(checkpoint, images, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    old, new = work / "runs" / "old" / "best.pt", work / "runs" / "exp" / "new" / "best.pt"
    old.parent.mkdir(parents=True)
    new.parent.mkdir(parents=True)
    shutil.copy(checkpoint, old)
    ckpt = torch.load(checkpoint, weights_only=True)
    ckpt["model"]["fc.weight"].zero_()
    ckpt["model"]["fc.bias"].copy_(torch.tensor([0.0, 0.0, 3.0]))  # always 'c'
    torch.save(ckpt, new)
    os.utime(old, (1_000_000_000, 1_000_000_000))  # the copy is older than the edited one
    monkeypatch.chdir(work)
    code, rows = _infer_json(tmp_path, images)
    assert code == 0 and {r["label"] for r in rows} == {"c"}
    os.utime(new, (900_000_000, 900_000_000))  # now 'old' is the newest
    code, rows = _infer_json(tmp_path, images, name="again.json")
    assert {r["label"] for r in rows} != {"c"}

    capsys.readouterr()
    assert infer.main([str(images), "--topk", "2"]) == 0
    captured = capsys.readouterr()
    assert "checkpoint: runs/old/best.pt (the newest best.pt under runs/)" in captured.err
    assert captured.out.splitlines()[0].split() == ["path", "label", "prob"]

    empty = tmp_path / "empty_cwd"
    empty.mkdir()
    monkeypatch.chdir(empty)
    with pytest.raises(CheckpointError, match="no best.pt under"):
        infer.main([str(images)])


@pytest.mark.slow
def test_json_rows_and_inputs_as_files_folders_and_globs(checkpoint, images, tmp_path):
    (images / "sub").mkdir()
    class_image(2, size=(16, 16)).save(images / "sub" / "deep.png")
    (images / ".hidden").mkdir()
    class_image(2, size=(16, 16)).save(images / ".hidden" / "skip.png")
    class_image(2, size=(16, 16)).save(images / ".skip.png")
    (images / "readme.txt").write_text("not listed: no image extension")
    paths = expand_inputs([str(images / "img1.png"), str(images), str(images / "img[0-2].png")])
    names = [os.path.relpath(p, images) for p in paths]
    assert names[0] == "img1.png" and len(names) == len(set(names)) == 8  # 7 + sub/deep.png, no duplicates
    assert "sub/deep.png" in names and not any(n.startswith(".") or "/." in n or n.endswith(".txt") for n in names)

    code, rows = _infer_json(tmp_path, str(images / "*.png"), "--checkpoint", checkpoint, "--topk", "2")
    assert code == 0 and len(rows) == 7  # the glob does not recurse; hidden files are not matched
    for row in rows:
        assert list(row) == ["path", "label", "prob", "top1_label", "top1_prob", "top2_label", "top2_prob", "error"]
        assert row["label"] == row["top1_label"] and row["prob"] == row["top1_prob"] and row["error"] is None


@pytest.mark.slow
def test_usage_errors(checkpoint, images, tmp_path):
    with pytest.raises(DataTreeError, match="nosuch"):
        infer.main([str(tmp_path / "nosuch"), "--checkpoint", str(checkpoint)])
    empty = tmp_path / "nothing"
    empty.mkdir()
    with pytest.raises(DataTreeError, match="no image files"):
        infer.main([str(empty), "--checkpoint", str(checkpoint)])
    with pytest.raises(CheckpointError, match="does not exist"):
        infer.main([str(images), "--checkpoint", str(tmp_path / "missing.pt")])
    with pytest.raises(ConfigError, match=".csv or .json"):
        infer.main([str(images), "--checkpoint", str(checkpoint), "--output", str(tmp_path / "out.txt")])
    with pytest.raises(ConfigError, match="--batch-size 0"):
        infer.main([str(images), "--checkpoint", str(checkpoint), "--batch-size", "0"])
    result = run_script("infer.py", str(images), "--checkpoint", str(tmp_path / "missing.pt"))
    assert result.returncode == 2 and "missing.pt" in result.stderr


@pytest.mark.slow
def test_infer_folds_batchnorm_and_agrees_with_the_unfolded_model(checkpoint, images, tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO)
    code, rows = _infer_json(tmp_path, images, "--checkpoint", checkpoint, "--num-workers", 0, "--topk", 3)
    assert code == 0 and "folded" in caplog.text
    loaded = read_checkpoint(checkpoint)
    model = build_eval_model(loaded, torch.device("cpu"), channels_last=True)  # as eval.py runs it: unfolded
    dataset = FileListDataset([r["path"] for r in rows], loaded.eval_transform(), loaded.cfg.data.img_size)
    from imgcls.data.transforms import normalize_batch

    d = loaded.cfg.data
    temperature = (loaded.calibration or {}).get("temperature") or 1.0  # prob is calibrated (stored temperature)
    with torch.inference_mode():
        for i, row in enumerate(rows):
            logits = model(normalize_batch(dataset[i][0][None], d.mean, d.std, channels_last=True))
            probs = (logits / temperature).softmax(1)[0]
            assert row["top1_label"] == loaded.classes[int(probs.argmax())]
            assert row["top1_prob"] == pytest.approx(float(probs.max()), abs=1e-4)


# ---------------------------------------------------------------- outputs never written over inputs


@pytest.mark.parametrize("case", ["output_is_list", "output_in_input_folder", "explain_is_input_folder",
                                  "explain_holds_input", "output_is_checkpoint", "output_is_image"])
def test_outputs_over_inputs_exit_2_naming_both_roles_before_any_work(checkpoint, images, tmp_path, case):
    listing = tmp_path / "list.csv"
    listing.write_text("path\n" + "\n".join(f"images/{p.name}" for p in sorted(images.iterdir())) + "\n")
    first = sorted(images.iterdir())[0]
    args, words = {
        "output_is_list": ([str(listing), "--output", str(listing)], ["--output", "input list"]),
        "output_in_input_folder": ([str(images), "--output", str(images / "sub" / "rows.json")],
                                   ["--output", "input folder"]),
        "explain_is_input_folder": ([str(images), "--explain", str(images)], ["--explain", "input"]),
        "explain_holds_input": ([str(first), "--explain", str(tmp_path)], ["--explain", "input image"]),
        "output_is_checkpoint": ([str(first), "--output", str(tmp_path / "x.csv")], None),
        "output_is_image": ([str(images), str(tmp_path / "list.csv"), "--output", str(first.with_suffix(".csv"))],
                            ["--output", "input folder"]),
    }[case]
    if words is None:  # the model file itself as the output (a .csv name is all --output takes: link it)
        link = tmp_path / "model.csv"
        link.symlink_to(checkpoint)
        args, words = [str(first), "--output", str(link)], ["--output", "checkpoint"]
    before = {p.name: p.read_bytes() for p in images.iterdir()}
    listed = listing.read_bytes()
    done = run_script("infer.py", *args, "--checkpoint", str(checkpoint), "--num-workers", "0")
    assert done.returncode == 2, done.stderr[-2000:]
    assert all(w in done.stderr for w in words), done.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in images.iterdir()} == before and listing.read_bytes() == listed
    assert checkpoint.stat().st_size > 1000


def test_check_outputs_apart_compares_resolved_paths(tmp_path):
    from imgcls.core.files import check_outputs_apart

    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "a.png").write_bytes(b"x")
    (tmp_path / "alias").symlink_to(tmp_path / "root")
    check_outputs_apart({"--json": str(tmp_path / "rootx.json")}, {}, {"data root": [str(tmp_path / "root")]})
    with pytest.raises(ConfigError, match="--json .*data root"):
        check_outputs_apart({"--json": str(tmp_path / "alias" / "r.json")}, {}, {"data root": [str(tmp_path / "root")]})
    with pytest.raises(ConfigError, match="--explain .*input image"):
        check_outputs_apart({}, {"input image": [str(tmp_path / "alias" / "a.png")]}, {}, {"--explain": str(tmp_path)})


@pytest.mark.slow
def test_output_files_that_are_folders_are_refused_before_any_work(tmp_path, capsys):
    import eval as eval_script

    folder = tmp_path / "preds.csv"
    folder.mkdir()
    missing_ckpt = str(tmp_path / "no.pt")  # checked later: the output check comes first
    assert exit_code(lambda: infer.main([str(tmp_path), "--checkpoint", missing_ckpt,
                                         "--output", str(folder)])) == 2
    assert f"--output {folder}: is a folder" in capsys.readouterr().err
    assert exit_code(lambda: eval_script.main(["--checkpoint", missing_ckpt, "--json", str(tmp_path)])) == 2
    assert f"--json {tmp_path}: is a folder" in capsys.readouterr().err


def test_infer_quotes_names_with_newlines_and_clamps_the_batch_to_the_inputs(tmp_path):
    rows = [{"path": "odd\nname.jpg", "label": "a", "prob": 0.5, "error": None},
            {"path": "plain.jpg", "label": None, "prob": None, "error": "empty file"}]
    table = format_predictions_table(rows).splitlines()
    assert len(table) == 3 and table[1].startswith("'odd\\nname.jpg'")
    paths = []
    for i in range(3):
        class_image(i).save(tmp_path / f"{i}.png")
        paths.append(str(tmp_path / f"{i}.png"))
    loader = build_inference_loader(FileListDataset(paths, EvalTransform(16, 0.875, "bilinear"), 16), 4096, 0, False)
    images, valid, indices, _ = next(iter(loader))
    assert images.shape[0] == 3 and valid.tolist() == [True] * 3


@pytest.mark.slow
def test_nan_weights_are_an_error_naming_the_model_file_in_infer_and_eval(checkpoint, tmp_path, capsys):
    """A .pt whose first conv weight is NaN printed 'classified 4 of 4' with prob nan, exit 0."""
    import eval as eval_script

    data = checkpoint.parent.parent / "data"  # train_tiny's layout: base/data, base/run/best.pt
    saved = torch.load(checkpoint, weights_only=True)
    first_conv = next(k for k, v in saved["model"].items() if v.ndim == 4)
    saved["model"][first_conv] = torch.full_like(saved["model"][first_conv], float("nan"))
    broken = tmp_path / "nan.pt"
    torch.save(saved, broken)
    out = tmp_path / "rows.csv"
    assert exit_code(lambda: infer.main([str(data / "val"), "--checkpoint", str(broken), "--num-workers", "0",
                                         "--output", str(out)])) == 1
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: {broken}: the model's outputs are not finite") and "Traceback" not in err
    assert "for 9 of 9 image(s)" in line and not out.exists()
    assert exit_code(lambda: eval_script.main(["--checkpoint", str(broken), "--data", str(data)])) == 1
    err = capsys.readouterr().err
    assert f"{broken}: the model's outputs are not finite" in err.strip().splitlines()[-1] and "Traceback" not in err


def test_a_reader_that_closes_the_pipe_early_ends_nothing(checkpoint, images, tmp_path):
    """Issue 64: `infer.py ... | head -4` ended with BrokenPipeError when head left before the table was
    written. Here the reader closes its end before infer.py writes anything, every time: the table goes
    nowhere, the --output file and the summary are still written, exit 0, no traceback."""
    out = tmp_path / "rows.csv"
    proc = subprocess.Popen([sys.executable, str(REPO / "infer.py"), str(images), "--checkpoint", str(checkpoint),
                             "--output", str(out), "--num-workers", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    proc.stdout.close()  # `head` that has left
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0, err
    assert "BrokenPipe" not in err and "Traceback" not in err and "Exception ignored" not in err
    assert "classified 7 of 7 file(s)" in err and len(out.read_text().splitlines()) == 8


def test_run_main_ends_a_closed_pipe_as_cat_would(tmp_path):
    """Any other command whose stdout reader leaves: exit 141 (128 + SIGPIPE), one quiet end."""
    script = ("from imgcls.cli import run_main\n"
              "def main():\n    while True:\n        print('row ' * 100)\n"
              "run_main(main)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == "", err
