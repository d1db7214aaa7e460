"""Calibration, the reject option and Grad-CAM explanations end to end: one short training run on generated
images whose class evidence (a coloured square) sits in a known corner, then eval.py, infer.py, export.py
and a killed-and-resumed run on it."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, tiny_overrides, wait_for
from PIL import Image

pytestmark = pytest.mark.slow  # trains a model (and kills and resumes one)

SIZE = 64
COLOURS = {"blue": (40, 60, 230), "green": (40, 200, 60), "red": (230, 40, 40)}
CORNERS = ("tl", "tr", "bl", "br")
TRAIN = ["data.img_size=64", "data.crop_pct=1.0", "data.scale=[0.85,1.0]", "data.hflip=0.0", "train.epochs=3",
         "optim.lr=0.1", "checkpoint.every_steps=0"]


def square_image(colour, corner: str, rng: np.random.Generator) -> Image.Image:
    """Grey noise with a 22-px square of `colour` in `corner`."""
    pixels = rng.normal(128, 25, size=(SIZE, SIZE, 3))
    side = 22
    top = 2 if corner[0] == "t" else SIZE - side - 2
    left = 2 if corner[1] == "l" else SIZE - side - 2
    pixels[top:top + side, left:left + side] = np.array(colour) + rng.normal(0, 10, size=(side, side, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def write_squares(root: Path, per_class: int, seed: int) -> list[tuple[str, str, str]]:
    """root/<colour>/<corner>_<i>.png; returns (path, colour, corner) rows."""
    rng = np.random.default_rng(seed)
    rows = []
    for name, colour in COLOURS.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            corner = CORNERS[i % 4]
            path = root / name / f"{corner}_{i:03d}.png"
            square_image(colour, corner, rng).save(path)
            rows.append((str(path), name, corner))
    return rows


def write_photos(root: Path, count: int) -> list[str]:
    """Out-of-distribution images: benchmarking/modes.py's generated photos at other sizes."""
    from imgcls.benchmarking.modes import photo

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    paths = []
    for i in range(count):
        path = root / f"photo_{i:03d}.jpg"
        Image.fromarray(photo(rng, int(rng.integers(80, 200)), int(rng.integers(80, 200)))).save(path)
        paths.append(str(path))
    return paths


def train_cmd(data: Path, out: Path, *extra: str, script=None) -> list:
    script = script or [str(REPO / "train.py")]
    return [sys.executable, *script, "--config", "base", *tiny_overrides(data, out), *TRAIN, *extra]


ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def call(script: str, *argv: str, capsys) -> tuple[int, str]:
    """An entry script's main in this process (no interpreter start-up): (exit status, stderr)."""
    import importlib

    from imgcls.cli import run_main

    main = importlib.import_module(script).main
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        run_main(lambda: main(list(argv)))
    return exited.value.code, capsys.readouterr().err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    base = tmp_path_factory.mktemp("trust")
    data = base / "data"
    write_squares(data / "train", 16, seed=0)
    write_squares(data / "val", 12, seed=1)
    done = subprocess.run(train_cmd(data, base / "run"), env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "calibration on 36 validation images: temperature" in done.stderr
    assert "kept from the pass that chose best.pt (no second pass)" in done.stderr
    return base, data, base / "run" / "best.pt"


def test_best_pt_carries_the_calibration_record(trained):
    _, _, best = trained
    record = torch.load(best, map_location="cpu", weights_only=True)["calibration"]
    assert 0.05 <= record["temperature"] <= 20 and record["temperature_setting"] == "auto"
    assert record["method"] == "mahalanobis_layers" and record["coverage"] == 0.95 and record["num_samples"] == 36
    # how much of generated far-off images the fit rejects (issue 51), and a note when that is weak
    assert list(record["reject_probe"]) == ["noise", "flat colours", "strokes", "grey blocks"]
    assert all(0.0 <= rate <= 100.0 for rate in record["reject_probe"].values())
    assert bool(record["reject_notes"]) == (sum(record["reject_probe"].values()) / 4 < 90.0)
    assert record["temperature_decision"].startswith(("applied", "declined"))
    assert record["class_means_l2"].shape[0] == 3 and record["precision_l2"].shape[0] == record["precision_l2"].shape[1]
    # the input's 17 statistics, then resnet10t's five stages, each pooled to (mean, std) of at most 128 channel
    # groups: a bounded fit per stage; the input weighs half of the score
    assert record["layer_names"] == ["input", "act1", "layer1", "layer2", "layer3", "layer4"]
    assert [tuple(p.shape) for p in record["layer_precisions"]] == [(17, 17), (128, 128), (128, 128), (256, 256),
                                                                   (256, 256), (256, 256)]
    assert [tuple(m.shape) for m in record["layer_means"]] == [(3, 17), (3, 128), (3, 128), (3, 256), (3, 256),
                                                              (3, 256)]
    assert len(record["layer_scales"]) == 6 and all(spread > 0 for _, spread in record["layer_scales"])
    assert record["layer_weights"] == pytest.approx([0.5, 0.1, 0.1, 0.1, 0.1, 0.1])
    bank = record["feature_bank"]
    # the 36 validation images, topped up with every training image (48, fewer than the 164 they lack)
    assert record["reject_fit"] == "validation+training"
    assert bank.dtype == torch.float16 and bank.shape[0] == 36 + 48
    assert torch.allclose(bank.float().norm(dim=1), torch.ones(36 + 48), atol=1e-2)


def test_eval_reports_calibration_and_selective_figures(trained, tmp_path, capsys):
    _, _, best = trained
    out = tmp_path / "eval.json"
    code, err = call("eval", "--checkpoint", str(best), "--json", str(out), "--reliability",
                     str(tmp_path / "rel.png"), "data.num_workers=0", capsys=capsys)
    assert code == 0, err[-2000:]
    doc = json.loads(out.read_text())
    record = torch.load(best, map_location="cpu", weights_only=True)["calibration"]
    assert doc["temperature"] == pytest.approx(record["temperature"])
    assert 0 <= doc["ece"] <= 100 and 0 <= doc["ece_uncalibrated"] <= 100 and doc["nll"] >= 0
    sel = doc["selective"]
    assert sel["method"] == "mahalanobis_layers"
    assert sel["threshold"] == pytest.approx(record["thresholds"]["mahalanobis_layers"])
    assert sel["coverage"] >= 95.0 - 100 / 36 and 0 <= sel["accuracy"] <= 100  # the split it was set on
    assert Image.open(tmp_path / "rel.png").size[0] > 100
    # a hand threshold above every score keeps nothing
    code, err = call("eval", "--checkpoint", str(best), "--json", str(out), "--reject-below", "1e9",
                     "data.num_workers=0", capsys=capsys)
    assert code == 0 and json.loads(out.read_text())["selective"]["coverage"] == 0.0


def test_reject_keeps_new_squares_and_rejects_photos(trained, tmp_path, capsys):
    _, _, best = trained
    squares = write_squares(tmp_path / "squares", 8, seed=5)
    photos = write_photos(tmp_path / "photos", 24)
    out = tmp_path / "rows.csv"
    code, err = call("infer", str(tmp_path / "squares"), str(tmp_path / "photos"), "--checkpoint", str(best),
                     "--reject", "--output", str(out), "--num-workers", "0", capsys=capsys)
    assert code == 0, err[-2000:]
    import csv

    rows = {r["path"]: r for r in csv.DictReader(out.open())}
    assert {"predicted", "score"} <= set(next(iter(rows.values())))
    kept = sum(rows[p]["label"] != "unknown" for p, _, _ in squares) / len(squares)
    rejected = sum(rows[p]["label"] == "unknown" for p in photos) / len(photos)
    assert kept >= 0.8 and rejected >= 0.8, (kept, rejected)
    assert all(rows[p]["predicted"] in COLOURS for p in photos)  # the would-be label is kept
    record = torch.load(best, map_location="cpu", weights_only=True)["calibration"]
    assert f"mahalanobis_layers score < {record['thresholds']['mahalanobis_layers']:.4g}" in err


def test_serve_rejects_as_infer_does(trained, tmp_path, capsys):
    """serve.py --reject: the same `unknown` labels, would-be labels, scores and calibrated probabilities as
    infer.py --reject on the same files."""
    from imgcls.model_files.predictor import TrustOptions
    from imgcls.serving.model import ServedModel

    _, _, best = trained
    squares = write_squares(tmp_path / "squares", 4, seed=7)
    photos = write_photos(tmp_path / "photos", 4)
    files = [p for p, _, _ in squares] + list(photos)
    out = tmp_path / "rows.json"
    code, err = call("infer", *files, "--checkpoint", str(best), "--reject", "--output", str(out),
                     "--num-workers", "0", capsys=capsys)
    assert code == 0, err[-2000:]
    expected = json.loads(out.read_text())
    served = ServedModel.load(str(best), topk=5, max_batch=64, device_setting="cpu", trust=TrustOptions(reject=True))
    rows = served.classify([served.decode(Path(p).read_bytes()) for p in files], files)
    assert [r["label"] for r in rows] == [r["label"] for r in expected]
    assert "unknown" in [r["label"] for r in rows]
    for row, want in zip(rows, expected):
        assert row["predicted"] == want["predicted"]
        assert row["score"] == pytest.approx(want["score"], rel=1e-4, abs=1e-4)
        assert row["prob"] == pytest.approx(want["prob"], abs=1e-5)


def test_explain_peaks_land_on_the_square(trained, tmp_path, capsys):
    """Grad-CAM's peak for the predicted class lies in the quadrant holding the coloured square, in the
    original image's pixels (here the image is also upscaled 2x, so the eval resize must be undone)."""
    _, _, best = trained
    rows = write_squares(tmp_path / "squares", 8, seed=9)
    for path, _, _ in rows:  # 128 px originals: the peak must be mapped back through the resize
        Image.open(path).resize((2 * SIZE, 2 * SIZE), Image.NEAREST).save(path)
    out, folder = tmp_path / "rows.json", tmp_path / "cams"
    code, err = call("infer", str(tmp_path / "squares"), "--checkpoint", str(best), "--explain", str(folder),
                     "--output", str(out), "--num-workers", "0", capsys=capsys)
    assert code == 0, err[-2000:]
    results = {r["path"]: r for r in json.loads(out.read_text())}
    hits = 0
    for path, colour, corner in rows:
        (explained,) = results[path]["explain"]
        x, y = explained["peak"]
        assert 0 <= x < 2 * SIZE and 0 <= y < 2 * SIZE and explained["label"] == results[path]["label"]
        assert explained["layer"] == "layer2"                  # 8x8 cells at 64 px; layer4 would be 2x2
        assert Image.open(explained["overlay"]).size == (2 * SIZE, 2 * SIZE)
        hits += ("t" if y < SIZE else "b") + ("l" if x < SIZE else "r") == corner
    assert hits >= 0.75 * len(rows), hits


def test_exports_carry_the_temperature_and_the_checkpoints_reject_score(trained, tmp_path, capsys):
    _, data, best = trained
    onnx = tmp_path / "model.onnx"
    code, err = call("export", "--checkpoint", str(best), "--format", "onnx", "--output", str(onnx), capsys=capsys)
    assert code == 0, err[-2000:]
    from imgcls.model_files.loading import load_model_file

    record = torch.load(best, map_location="cpu", weights_only=True)["calibration"]
    exported = load_model_file(onnx).calibration
    assert exported["temperature"] == pytest.approx(record["temperature"])
    assert exported["method"] == "mahalanobis_layers" and exported["score_output"] == "reject_score"
    assert exported["thresholds"] == {name: pytest.approx(record["thresholds"][name])
                                      for name in ("energy", "mahalanobis_layers")}
    out = tmp_path / "rows.json"
    photos = write_photos(tmp_path / "photos", 4)
    code, err = call("infer", *photos, "--checkpoint", str(onnx), "--reject", "--output", str(out),
                     "--num-workers", "0", capsys=capsys)
    assert code == 0, err[-2000:]
    assert "mahalanobis_layers score <" in err
    assert all("predicted" in r for r in json.loads(out.read_text()))
    # the calibrated prob is the same from the export as from the checkpoint, and is the softmax of the
    # logits divided by the stored temperature
    ckpt_out = tmp_path / "ckpt.json"
    call("infer", *photos, "--checkpoint", str(best), "--output", str(ckpt_out), "--num-workers", "0", capsys=capsys)
    probs = [r["prob"] for r in json.loads(ckpt_out.read_text())]
    assert [r["prob"] for r in json.loads(out.read_text())] == pytest.approx(probs, abs=1e-4)
    from imgcls.model_files.loading import load_model_file as load

    loaded = load(best)
    model = loaded.build_model(torch.device("cpu"), channels_last=False)
    from imgcls.data.transforms import normalize_batch

    x = normalize_batch(torch.stack([loaded.eval_transform()(p) for p in photos]), loaded.cfg.data.mean,
                        loaded.cfg.data.std)
    with torch.no_grad():
        want = (model(x) / record["temperature"]).softmax(1).max(1).values.tolist()
    assert probs == pytest.approx(want, abs=1e-4)
    code, err = call("infer", *photos, "--checkpoint", str(onnx), "--explain", str(tmp_path / "cams"), capsys=capsys)
    assert code == 2 and "--explain" in err and "export" in err


def test_reject_without_a_stored_threshold_is_a_usage_error(trained, tmp_path, capsys):
    base, _, _ = trained
    photos = write_photos(tmp_path / "photos", 1)
    code, err = call("infer", *photos, "--checkpoint", str(base / "run" / "last.pt"), "--reject", capsys=capsys)
    assert code == 2 and "--reject-below" in err
    code, err = call("infer", *photos, "--checkpoint", str(base / "run" / "last.pt"), "--reject-below", "1e9",
                     "--output", str(tmp_path / "r.json"), "--num-workers", "0", capsys=capsys)
    assert code == 0 and json.loads((tmp_path / "r.json").read_text())[0]["label"] == "unknown"


def test_a_killed_and_resumed_run_stores_the_same_calibration(trained, tmp_path):
    """Killed after epoch 2's last.pt, resumed and killed again after the last epoch's last.pt (before the
    calibration), resumed: the run ends with the uninterrupted run's calibration record. The uninterrupted
    run fitted on the outputs its validation pass kept, this one on a separate pass (its best epoch's
    outputs died with the killed process): the same numbers, bitwise."""
    base, data, best = trained
    run, marker = tmp_path / "run", tmp_path / "paused"
    for point, extra in (("after_save:2", ()), ("after_save:1", ("--resume", "auto"))):
        paused = [str(REPO / "tests" / "paused_train.py"), str(marker), point, "--"]
        proc = subprocess.Popen(train_cmd(data, run, *extra, script=paused), env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        wait_for(proc, marker.exists, "the pause point")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        marker.unlink()
        assert "calibration" not in torch.load(run / "best.pt", map_location="cpu", weights_only=True)
    assert torch.load(run / "last.pt", map_location="cpu", weights_only=True)["epoch"] == 3
    done = subprocess.run(train_cmd(data, run, "--resume", "auto"), env=ENV, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "calibration on 36 validation images" in done.stderr and "no second pass" not in done.stderr
    a = torch.load(best, map_location="cpu", weights_only=True)["calibration"]
    b = torch.load(run / "best.pt", map_location="cpu", weights_only=True)["calibration"]
    assert a["temperature"] == b["temperature"] and a["thresholds"] == b["thresholds"]
    assert a["layer_names"] == b["layer_names"] and a["layer_scales"] == b["layer_scales"]
    for key in ("feature_bank", "class_means_l2", "precision_l2"):
        assert torch.equal(a[key], b[key]), key
    for key in ("layer_means", "layer_precisions"):
        assert all(torch.equal(x, y) for x, y in zip(a[key], b[key])), key


@pytest.mark.parametrize("bad", [float("nan"), 0.0, float("inf"), -1.0, 1e-300, "1.5", [1.0]])
def test_a_stored_temperature_outside_its_range_exits_2_naming_the_file(trained, tmp_path, capsys, bad):
    """NaN / 0 / inf labelled every image alike at prob nan (bare NaN in the JSON), -1 inverted the ranking,
    a string or list was a TypeError traceback."""
    _, _, best = trained
    ckpt = torch.load(best, map_location="cpu", weights_only=True)
    ckpt["calibration"]["temperature"] = bad
    edited = tmp_path / "edited.pt"
    torch.save(ckpt, edited)
    photos = write_photos(tmp_path / "photos", 1)
    for script, args in (("infer", [*photos, "--num-workers", "0"]), ("eval", ["data.num_workers=0"]),
                         ("export", ["--format", "onnx", "--output", str(tmp_path / "m.onnx")])):
        code, err = call(script, *args, "--checkpoint", str(edited), capsys=capsys)
        assert code == 2 and str(edited) in err and "temperature" in err and "Traceback" not in err, (script, err)
    assert not (tmp_path / "m.onnx").exists()


def test_an_onnx_file_with_a_nan_temperature_or_threshold_exits_2(trained, tmp_path, capsys):
    import onnx

    _, _, best = trained
    good = tmp_path / "model.onnx"
    code, err = call("export", "--checkpoint", str(best), "--format", "onnx", "--output", str(good), capsys=capsys)
    assert code == 0, err[-2000:]
    photos = write_photos(tmp_path / "photos", 1)
    for field, value in (("temperature", float("nan")), ("thresholds", {"energy": float("nan")})):
        model = onnx.load(str(good))
        for prop in model.metadata_props:
            if prop.key == "imgcls.calibration":  # the stored record (not the config's calibration section)
                doc = json.loads(prop.value)
                doc[field] = value
                prop.value = json.dumps(doc)
        bad = tmp_path / f"bad_{field}.onnx"
        onnx.save(model, str(bad))
        code, err = call("infer", *photos, "--checkpoint", str(bad), "--num-workers", "0", capsys=capsys)
        assert code == 2 and str(bad) in err and ("temperature" if field == "temperature" else "reject") in err, err


def test_reject_below_nan_or_inf_is_a_usage_error(trained, tmp_path, capsys):
    _, _, best = trained
    photos = write_photos(tmp_path / "photos", 1)
    for value in ("nan", "inf", "-inf"):
        code, err = call("infer", *photos, "--checkpoint", str(best), "--reject-below", value, capsys=capsys)
        assert code == 2 and "--reject-below" in err
        code, err = call("eval", "--checkpoint", str(best), "--reject-below", value, capsys=capsys)
        assert code == 2 and "--reject-below" in err


def test_explain_overlay_of_a_large_photo_is_bounded_and_its_peak_in_original_pixels(trained, tmp_path, capsys):
    """A 9000x9000 JPEG took 5.6 GB and wrote a 142 MB overlay: the overlay's longer side is now at most
    OVERLAY_MAX_SIDE, the peak still in the original's pixels."""
    from imgcls.model_files.predictor import OVERLAY_MAX_SIDE

    _, _, best = trained
    rows = write_squares(tmp_path / "squares", 1, seed=3)
    path, _, corner = rows[0]
    big = tmp_path / "big.png"
    Image.open(path).resize((3000, 2000), Image.NEAREST).save(big)
    out, folder = tmp_path / "rows.json", tmp_path / "cams"
    code, err = call("infer", str(big), "--checkpoint", str(best), "--explain", str(folder), "--output", str(out),
                     "--num-workers", "0", capsys=capsys)
    assert code == 0, err[-2000:]
    (explained,) = json.loads(out.read_text())[0]["explain"]
    assert Image.open(explained["overlay"]).size == (OVERLAY_MAX_SIDE, round(2000 * OVERLAY_MAX_SIDE / 3000))
    x, y = explained["peak"]
    assert 0 <= x < 3000 and 0 <= y < 2000 and explained["peak_informative"] is True
    assert sum(p.stat().st_size for p in folder.iterdir()) < 3_000_000


def test_overlay_geometry_and_names():
    from imgcls.model_files.predictor import display_size, explain_items, overlay_name
    from imgcls.tasks import get_task

    assert display_size(9000, 9000) == (1024, 1024, 1024 / 9000) and display_size(300, 200) == (300, 200, 1.0)
    assert overlay_name(7, "/d/a.png", None) == "00007_a.png"
    assert overlay_name(7, "/d/a.png", "sea lion/x") == "00007_a.sea_lion_x.png"
    rows = [{"label": "b", "error": None}, {"label": None, "error": "bad"}, {"label": "unknown", "predicted": "a",
                                                                            "error": None}]
    assert explain_items(rows, ["a", "b"], get_task("multiclass")) == [(0, 1), (2, 0)]
    assert explain_items([{"labels": ["b", "a"], "error": None}], ["a", "b"], get_task("multilabel")) == [(0, 1),
                                                                                                          (0, 0)]


@pytest.mark.slow
def test_the_trust_benchmark_measures_the_shipped_default_score(tmp_path):
    """trust.md's reject table compared msp, energy, kNN and Mahalanobis but not the default the checkpoints
    use; benchmarking.trust measures `mahalanobis_layers` beside them."""
    from conftest import train_tiny

    from imgcls.benchmarking.trust import measure

    _, checkpoint = train_tiny(tmp_path, {"a": (8, 6), "b": (8, 6)})
    result = measure(str(checkpoint), 4, 0.95)
    assert set(result["val_kept"]) == {"msp", "energy", "knn", "mahalanobis", "mahalanobis_layers"}
    for kind in ("sample_photos", "generated_photos"):
        assert 0.0 <= result["rejected"][kind]["mahalanobis_layers"] <= 100.0
    assert 0.0 <= result["held_out"]["val_kept"]["mahalanobis_layers"] <= 100.0


def test_a_briefly_trained_model_rejects_grey_digits(tmp_path, capsys):
    """issue 51: a photos model trained 3 epochs rejected a third of upscaled grey digits (its stages had learnt
    too little to tell them apart); the input's statistics, which no training spoils, reject them while the
    model keeps its own kind of image."""
    from imgcls.benchmarking.reject_matrix import write_photos_tree
    from imgcls.data.listing import ensure_builtin

    data = write_photos_tree(tmp_path / "shapes", 30, 12, seed=0)              # 7 classes: 210 train, 84 val
    held = write_photos_tree(tmp_path / "held", 0, 8, seed=3) / "val"          # 56 new ones, never seen
    digits = sorted((ensure_builtin("digits", tmp_path / "digits") / "val").rglob("*.png"))[:70]
    run = tmp_path / "run"
    command = [sys.executable, str(REPO / "train.py"), "--config", "base",
               *tiny_overrides(data, run, **{"model.name": "resnet10t", "data.img_size": 32, "train.epochs": 3,
                                             "train.batch_size": 32, "optim.lr": 0.4, "schedule.warmup_epochs": 1})]
    done = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    shown = tmp_path / "grey_digits"
    shown.mkdir()
    for i, path in enumerate(digits):
        shutil.copy(path, shown / f"{i:03d}.png")
    out = tmp_path / "rows.csv"
    code, err = call("infer", str(held), str(shown), "--checkpoint", str(run / "best.pt"), "--reject",
                     "--output", str(out), "--num-workers", "0", capsys=capsys)
    assert code == 0, err[-2000:]
    import csv

    rows = list(csv.DictReader(out.open()))
    own = [r for r in rows if r["path"].startswith(str(held))]
    foreign = [r for r in rows if not r["path"].startswith(str(held))]
    assert len(own) == 56 and len(foreign) == 70
    kept = sum(r["label"] != "unknown" for r in own) / len(own)
    rejected = sum(r["label"] == "unknown" for r in foreign) / len(foreign)
    assert kept >= 0.9 and rejected >= 0.9, (kept, rejected)


def test_a_small_validation_split_is_topped_up_with_only_the_training_images_it_lacks(tmp_path):
    """issue 47: a validation split under MIN_VALIDATION_FIT images is topped up for the reject fit with the
    outputs of just as many training images as it lacks (one short pass, not over 2,048): the log and the
    record say so, and the kNN bank holds the validation features, then the training ones."""
    from conftest import train_tiny

    from imgcls.evaluation.trust import MIN_VALIDATION_FIT

    val_images = 2 * 70
    data, best = train_tiny(tmp_path, {"a": (40, 70), "b": (40, 70)},
                            **{"model.name": "resnet10t"})
    log = (best.parent / "train.log").read_text()
    lacking = MIN_VALIDATION_FIT - val_images
    assert (f"{val_images} validation images (< {MIN_VALIDATION_FIT}): the reject fit adds {lacking} training "
            f"images' outputs") in log
    record = torch.load(best, map_location="cpu", weights_only=True)["calibration"]
    assert record["reject_fit"] == "validation+training" and record["method"] == "mahalanobis_layers"
    assert record["feature_bank"].shape[0] == MIN_VALIDATION_FIT


def test_a_validation_split_of_200_is_the_reject_fit_with_no_pass_over_training_images(tmp_path):
    """issue 47: after the last epoch nothing passes over training images when the kept validation outputs
    suffice (MIN_VALIDATION_FIT images): the record says so, the log says so, and the kNN bank holds the
    validation features."""
    from conftest import train_tiny

    from imgcls.evaluation.trust import MIN_VALIDATION_FIT

    data, best = train_tiny(tmp_path, {"a": (8, MIN_VALIDATION_FIT // 2), "b": (8, MIN_VALIDATION_FIT // 2)},
                            **{"model.name": "resnet10t"})
    log = (best.parent / "train.log").read_text()
    assert f"reject fit on the {MIN_VALIDATION_FIT} validation outputs" in log and "passes over" not in log
    record = torch.load(best, map_location="cpu", weights_only=True)["calibration"]
    assert record["reject_fit"] == "validation" and record["method"] == "mahalanobis_layers"
    assert record["feature_bank"].shape[0] == MIN_VALIDATION_FIT          # the validation features, not 16
