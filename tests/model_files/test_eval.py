"""eval.py: reproduces training's validation numbers exactly, matches classes by name, reports per-class
metrics and the confusion matrix, leaves unreadable files out."""
from __future__ import annotations

import json
import math
import re
import shutil

import numpy as np
import pytest
import torch
from conftest import make_tree, run_script, tiny_overrides
from PIL import Image

from imgcls.commands.evaluate import evaluate_checkpoint
from imgcls.config import ConfigError
from imgcls.data.listing import DataTreeError

COUNTS = {"a": (16, 6), "b": (16, 6), "c": (16, 7)}
METRIC_KEYS = ("top1", "top5", "loss", "mean_class_acc", "num_samples")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One tiny training run shared by the module: (data root, run dir)."""
    base = tmp_path_factory.mktemp("eval")
    data = make_tree(base / "data", COUNTS)
    run_dir = base / "run"
    result = run_script("train.py", "--config", "base", *tiny_overrides(data, run_dir))
    assert result.returncode == 0, result.stderr[-2000:]
    return data, run_dir


def _edited_checkpoint(src, dst, edit):
    ckpt = torch.load(src, weights_only=True)
    edit(ckpt)
    torch.save(ckpt, dst)
    return dst


@pytest.mark.slow
def test_eval_reproduces_training_best_metrics_exactly(trained, tmp_path):
    data, run_dir = trained
    out = tmp_path / "report" / "eval.json"
    result = run_script("eval.py", "--checkpoint", str(run_dir / "best.pt"), "--json", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    doc = json.loads(out.read_text())
    assert {k: doc[k] for k in METRIC_KEYS} == summary["best"]  # bit-for-bit, loss included
    assert doc["num_samples"] == 19
    assert sum(map(sum, doc["confusion"])) == 19
    assert [row["count"] for row in doc["per_class"].values()] == [6, 6, 7]
    assert set(doc["per_class"]["a"]) >= {"accuracy", "precision", "recall", "f1", "count"}
    assert doc["batch_size"] == 8 and doc["amp"] == "none" and doc["epoch"] == summary["best_epoch"]
    png = out.with_name("eval_confusion.png")
    with Image.open(png) as img:
        assert img.format == "PNG" and img.width > 100
    assert "mean class acc" in result.stdout and "recall%" in result.stdout


@pytest.mark.slow
def test_constant_model_gives_hand_checked_metrics(trained, tmp_path):
    """fc weights zeroed: every image gets logits = bias, so every prediction is 'b'."""
    data, run_dir = trained
    bias = torch.tensor([0.0, 1.0, 0.5])

    def constant(ckpt):
        ckpt["model"]["fc.weight"].zero_()
        ckpt["model"]["fc.bias"].copy_(bias)

    ckpt = _edited_checkpoint(run_dir / "best.pt", tmp_path / "constant.pt", constant)
    result = evaluate_checkpoint(ckpt)
    assert result.confusion.tolist() == [[0, 6, 0], [0, 6, 0], [0, 7, 0]]
    m = result.metrics
    assert m["top1"] == pytest.approx(100 * 6 / 19)
    assert m["top5"] == 100.0  # k clipped to 3 classes
    assert m["mean_class_acc"] == pytest.approx(100 / 3)
    nll = (torch.logsumexp(bias, 0) - bias).tolist()
    assert m["loss"] == pytest.approx((6 * nll[0] + 6 * nll[1] + 7 * nll[2]) / 19, rel=1e-6)
    b = result.per_class["b"]
    assert b["recall"] == 100.0 and b["count"] == 6
    assert b["precision"] == pytest.approx(100 * 6 / 19)
    assert b["f1"] == pytest.approx(100 * 2 * (6 / 19) / (1 + 6 / 19))
    # every score tied: one threshold, at which a class's precision is its share, its recall 1
    assert result.per_class["a"] == {"accuracy": 0.0, "precision": 0.0, "recall": 0.0, "f1": 0.0, "count": 6,
                                     "average_precision": pytest.approx(6 / 19)}
    assert result.precision_recall["pr_auc_macro"] == pytest.approx((6 / 19 + 6 / 19 + 7 / 19) / 3)

    from imgcls.commands.evaluate import draw_confusion

    with Image.open(draw_confusion(result.confusion, result.classes, tmp_path / "c.png")) as img:
        pixels = np.asarray(img.convert("RGB")).reshape(-1, 3)
    colours = {tuple(int(v) for v in c) for c in np.unique(pixels, axis=0)}
    assert (0, 0, 255) in colours  # b -> b: the whole row, full blue
    assert (255, 0, 0) in colours  # a -> b and c -> b: the whole row, full red


@pytest.mark.slow
def test_classes_in_another_order_are_remapped_by_name(trained, tmp_path):
    data, run_dir = trained
    order = [2, 0, 1]  # checkpoint classes c, a, b with the classifier rows to match

    def permute(ckpt):
        ckpt["classes"] = [ckpt["classes"][i] for i in order]
        for key in ("fc.weight", "fc.bias"):
            ckpt["model"][key] = ckpt["model"][key][order].clone()

    reference = evaluate_checkpoint(run_dir / "best.pt")
    permuted = evaluate_checkpoint(_edited_checkpoint(run_dir / "best.pt", tmp_path / "perm.pt", permute))
    assert permuted.classes == ["c", "a", "b"]
    for key in ("top1", "top5", "mean_class_acc", "num_samples"):
        assert permuted.metrics[key] == reference.metrics[key]
    assert permuted.metrics["loss"] == pytest.approx(reference.metrics["loss"], rel=1e-6)
    assert list(permuted.per_class) == ["c", "a", "b"]
    for name, row in reference.per_class.items():
        assert permuted.per_class[name] == pytest.approx(row)
    assert permuted.confusion.tolist() == reference.confusion[order][:, order].tolist()


@pytest.mark.slow
def test_class_mismatch_exits_2_listing_the_difference(trained, tmp_path):
    _, run_dir = trained
    other = make_tree(tmp_path / "other", {"a": (0, 2), "b": (0, 2), "d": (0, 2)})
    result = run_script("eval.py", "--checkpoint", str(run_dir / "best.pt"), "--data", str(other))
    assert result.returncode == 2
    assert "missing here: ['c']" in result.stderr and "not in the checkpoint: ['d']" in result.stderr


@pytest.mark.slow
def test_unreadable_files_are_left_out_and_reported(trained, tmp_path):
    data, run_dir = trained
    copy = tmp_path / "data"
    shutil.copytree(data / "val", copy / "holdout")
    broken = copy / "holdout" / "a" / "broken.png"
    broken.write_bytes(b"not an image")
    reference = evaluate_checkpoint(run_dir / "best.pt")
    # also reads through 2 loader workers
    result = evaluate_checkpoint(run_dir / "best.pt", str(copy), "holdout", overrides=["data.num_workers=2"])
    assert result.skipped_files == [str(broken)]
    assert result.metrics == reference.metrics  # 19 readable files, the same numbers
    assert result.per_class["a"]["count"] == 6


@pytest.mark.slow
def test_batch_size_and_overrides(trained):
    data, run_dir = trained
    reference = evaluate_checkpoint(run_dir / "best.pt")
    other = evaluate_checkpoint(run_dir / "best.pt", batch_size=5)
    assert other.settings["batch_size"] == 5
    assert other.metrics["num_samples"] == 19 and other.confusion.tolist() == reference.confusion.tolist()
    assert other.metrics["loss"] == pytest.approx(reference.metrics["loss"], rel=1e-5)
    first_batch = evaluate_checkpoint(run_dir / "best.pt", overrides=["data.limit_val_batches=1"])
    assert first_batch.metrics["num_samples"] == 8  # one batch of the training batch size
    with pytest.raises(ConfigError, match="unknown config key 'train.bogus'"):
        evaluate_checkpoint(run_dir / "best.pt", overrides=["train.bogus=1"])
    with pytest.raises(DataTreeError, match="does not exist"):
        evaluate_checkpoint(run_dir / "best.pt", split="nosuchsplit")


@pytest.mark.slow
def test_tta_averages_the_mirror_image(trained, tmp_path):
    """On left-right symmetric images the mirror adds nothing: TTA must give the plain numbers."""
    data, run_dir = trained
    sym = tmp_path / "sym"
    for path in (data / "val").rglob("*.png"):
        pixels = np.asarray(Image.open(path).convert("RGB"))
        half = pixels[:, : pixels.shape[1] // 2]
        target = sym / "val" / path.parent.name / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.concatenate([half, half[:, ::-1]], axis=1)).save(target)
    plain = evaluate_checkpoint(run_dir / "best.pt", str(sym))
    tta = evaluate_checkpoint(run_dir / "best.pt", str(sym), tta=True)
    assert tta.settings["tta"] is True
    assert tta.metrics["loss"] == pytest.approx(plain.metrics["loss"], rel=1e-5)
    assert tta.confusion.tolist() == plain.confusion.tolist()
    asym_plain = evaluate_checkpoint(run_dir / "best.pt")
    asym_tta = evaluate_checkpoint(run_dir / "best.pt", tta=True)
    assert not math.isclose(asym_tta.metrics["loss"], asym_plain.metrics["loss"], rel_tol=1e-6)


@pytest.mark.slow
def test_infer_agrees_with_eval(trained, tmp_path):
    """infer.py over the validation folder predicts what eval.py counted in its confusion matrix."""
    import infer

    data, run_dir = trained
    reference = evaluate_checkpoint(run_dir / "best.pt")
    out = tmp_path / "pred.json"
    assert infer.main([str(data / "val"), "--checkpoint", str(run_dir / "best.pt"), "--batch-size", "4",
                       "--output", str(out), "--num-workers", "0"]) == 0
    confusion = torch.zeros(3, 3, dtype=torch.int64)
    for row in json.loads(out.read_text()):
        true = reference.classes.index(row["path"].split("/")[-2])
        confusion[true, reference.classes.index(row["label"])] += 1
    assert confusion.tolist() == reference.confusion.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["json_is_the_list", "reliability_is_a_val_image", "json_in_the_root",
                                  "json_is_the_checkpoint"])
def test_an_output_over_an_input_exits_2_naming_both_roles(trained, tmp_path, case):
    """--json onto the evaluated list, --reliability onto a validation image: written over, exit 0."""
    data, run_dir = trained
    listing = tmp_path / "list.csv"
    val_images = sorted((data / "val").rglob("*.png"))
    listing.write_text("path,label\n" + "".join(f"{p},{p.parent.name}\n" for p in val_images))
    image = tmp_path / "copy.png"
    shutil.copy(val_images[0], image)
    listing.write_text(listing.read_text() + f"{image},{val_images[0].parent.name}\n")
    best = run_dir / "best.pt"
    args, words = {
        "json_is_the_list": (["--data", str(listing), "--json", str(listing)], ["--json", "data list"]),
        "reliability_is_a_val_image": (["--data", str(listing), "--reliability", str(image)],
                                       ["--reliability", "evaluated image"]),
        "json_in_the_root": (["--json", str(data / "val" / "report.json")], ["--json", "data root"]),
        "json_is_the_checkpoint": (["--json", str(best)], ["--json", "checkpoint"]),
    }[case]
    before = {p: p.read_bytes() for p in (listing, image, best)}
    result = run_script("eval.py", "--checkpoint", str(best), *args, "data.num_workers=0")
    assert result.returncode == 2, result.stderr[-2000:]
    assert all(w in result.stderr for w in words), result.stderr[-2000:]
    assert {p: p.read_bytes() for p in before} == before
    assert not (data / "val" / "report.json").exists()


@pytest.mark.parametrize("outputs, words", [
    ({"--json": "r.json", "--predictions": "r.json"}, "--predictions r.json: is also --json r.json"),
    ({"--json": "r.json", "--reliability": "r_confusion.png"},
     "--reliability r_confusion.png: is also --json's confusion matrix r_confusion.png"),
    ({"--json": "r2.json", "--predictions": "r2_errors.csv"},
     "--predictions r2_errors.csv: is also --json's misclassified list r2_errors.csv"),
    ({"--json": None, "--predictions": "X.png", "--reliability": "X.png"}, "--reliability X.png: is also --predictions X.png"),
    ({"--json": "sub/../r.json", "--predictions": "r.json"}, "--predictions r.json: is also --json sub/../r.json"),
])
def test_evals_outputs_and_the_files_it_derives_are_apart_from_each_other(tmp_path, monkeypatch, outputs, words):
    from imgcls.commands.output_roles import check_eval_outputs

    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    with pytest.raises(ConfigError, match=re.escape(words)):
        check_eval_outputs(outputs, "best.pt", None, None, None, [])
    check_eval_outputs({"--json": "r.json", "--predictions": "rows.csv", "--reliability": "rel.png"}, "best.pt",
                       None, None, None, [])


@pytest.mark.slow
def test_eval_with_two_outputs_on_one_file_exits_2_before_writing(trained, tmp_path):
    data, run_dir = trained
    report = tmp_path / "r.json"
    result = run_script("eval.py", "--checkpoint", str(run_dir / "best.pt"), "--json", str(report),
                        "--predictions", str(report), "data.num_workers=0")
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"--predictions {report}: is also --json {report}" in result.stderr
    assert not report.exists()


def test_an_explicit_train_amp_override_is_evals_amp():
    """eval.py has no --amp: `train.amp=bf16` on its command line keeps bf16 where the checkpoint's own bf16
    would run in fp32 (a CPU that emulates it)."""
    from imgcls.commands.evaluate import amp_override

    assert amp_override(["data.num_workers=0", "train.amp=bf16"]) == "bf16"
    assert amp_override(["train.amp=none", "train.amp = auto"]) == "auto"
    assert amp_override(["data.num_workers=0"]) is None
