"""Multi-label classification (data.task=multilabel) end to end, on tagged images the tests generate
(tests/multilabel_data.py): tag parsing, the split, the losses, mAP against scikit-learn, the tuned
thresholds, and one training run that eval.py, infer.py, the exports, a killed-and-resumed run and a DDP
run are checked against."""
from __future__ import annotations

import csv
import importlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, TEST_MODEL, run_script, wait_for
from multilabel_data import TAGS, make_tag_list
from sklearn.metrics import average_precision_score, f1_score

from imgcls.config import load_config
from imgcls.core.errors import USAGE_ERRORS, ConfigError, DataTreeError
from imgcls.data.labels import parse_tags, tag_split_positions
from imgcls.data.sources import scan_sources
from imgcls.tasks import get_task
from imgcls.tasks.losses import AsymmetricLoss, BinaryCrossEntropy
from imgcls.tasks.metrics import average_precision, multilabel_metrics, predicted, tune_thresholds
from imgcls.training.step import MixDraw, apply_mix

ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def script_main(name: str, *args: str) -> int:
    """An entry script's main() in this process (eval.py, infer.py, export.py): no new interpreter to start."""
    return importlib.import_module(name).main([str(a) for a in args])


def settings(train_csv: Path, out: Path, **extra) -> list[str]:
    values = {"data.format": "csv", "data.train_csv": str(train_csv), "data.val_fraction": 0.25,
              "data.task": "multilabel", "output.dir": str(out), "model.name": TEST_MODEL, "data.img_size": 16,
              "data.num_workers": 0, "train.batch_size": 8, "train.epochs": 2, "train.amp": "none",
              "train.device": "cpu", "schedule.warmup_epochs": 0.5, "optim.lr": 0.2, "output.log_interval": 1,
              "output.progress_bar": "off", "output.tensorboard": "false", "train.mixup_alpha": 0.2,
              "checkpoint.every_steps": 1}
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


# ---------------------------------------------------------------- parsing and sources


@pytest.mark.parametrize("text, delimiter, tags", [
    ("cloud road", " ", ["cloud", "road"]), ("  cloud   road ", " ", ["cloud", "road"]),
    ("cloud,road,", ",", ["cloud", "road"]), ("cloud| road |cloud", "|", ["cloud", "road"]),
    ("", " ", []), ("   ", " ", []), ("sea lion;cloud", ";", ["sea lion", "cloud"])])
def test_parse_tags(text, delimiter, tags):
    assert parse_tags(text, delimiter) == tags


def write_list(path: Path, rows: list[tuple[str, str]], newline: str = "\n", bom: bool = False) -> Path:
    text = newline.join(["path,label", *(f'{p},"{label}"' for p, label in rows)]) + newline
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tags")
    make_tag_list(root, 12)
    return root


def scan(train_csv: Path, *extra: str):
    cfg = load_config("base", [f"data.train_csv={train_csv}", f"data.val_csv={train_csv}", "data.format=csv",
                               "data.task=multilabel", *extra])
    return scan_sources(cfg)


def test_csv_tags_with_bom_crlf_empty_tags_and_a_delimiter(images):
    rows = [(f"images/list_{i:04d}.png", label) for i, label in
            enumerate(["road;cloud", "", "water", "tree;;water;", "cloud"])]
    csv_path = write_list(images / "semi.csv", rows, newline="\r\n", bom=True)
    sources = scan(csv_path, "data.label_delimiter=;")
    index = sources.train_index
    assert index.classes == ["cloud", "road", "tree", "water"]   # the sorted union of the tags
    assert index.labels == [(0, 1), (), (3,), (2, 3), (0,)]
    assert index.untagged() == 1 and index.class_counts() == [2, 1, 1, 2]
    assert index.target(index.labels[3]).tolist() == [0.0, 0.0, 1.0, 1.0]


def test_unknown_tag_stops_with_the_row_and_the_close_match(images):
    classes = images / "classes.txt"
    classes.write_text("\n".join(TAGS) + "\n")
    rows = [("images/list_0000.png", "cloud"), ("images/list_0001.png", "road wtaer")]
    with pytest.raises(DataTreeError, match=r"line 3: tag 'wtaer' .*did you mean 'water'"):
        scan(write_list(images / "typo.csv", rows), f"data.classes={classes}")
    assert issubclass(DataTreeError, USAGE_ERRORS)  # exit 2, before any work


def test_shards_carry_the_tags(images, tmp_path):
    """python -m imgcls.data.shards --from LIST.csv --multilabel writes .tags members; the eval stream reads them back
    as the CSV's multi-hot targets (an untagged image all zeros)."""
    from imgcls.data.labels import TagLabels
    from imgcls.data.shards import ShardEvalStream, main as write_shards_main, shard_index
    from imgcls.data.transforms import EvalTransform

    rows = [(f"images/list_{i:04d}.png", label) for i, label in enumerate(["road,cloud", "", "water"])]
    listed = write_list(images / "comma.csv", rows)
    assert write_shards_main(["--from", str(listed), "--to", str(tmp_path), "--shard-size", "2", "--multilabel",
                              "--label-delimiter", ","]) == 0
    classes = (tmp_path / "classes.txt").read_text().split()
    assert classes == ["cloud", "road", "water"]
    index = shard_index(str(tmp_path / "shard-{000000..000001}.tar"), classes, None, "shards", labels=TagLabels(","))
    got = sorted(tuple(target.tolist()) for _, target, valid, _ in ShardEvalStream(index, EvalTransform(16, 0.875,
                                                                                                      "bilinear"), 16))
    assert got == sorted([(1.0, 1.0, 0.0), (0.0, 0.0, 0.0), (0.0, 0.0, 1.0)])


@pytest.mark.parametrize("overrides, message", [
    (["data.format=folder", "data.root=.", "data.train_csv=null", "data.val_fraction=null"], "use data.format=csv"),
    (["train.loss=ce"], "train.loss=bce or asl"),
    (["data.sampler=weighted"], "data.sampler=random"),
    (["early_stop.metric=top1"], "use mAP"),
])
def test_settings_that_mean_nothing_for_multilabel_are_refused(overrides, message):
    base = ["data.task=multilabel", "data.format=csv", "data.train_csv=x.csv", "data.val_fraction=0.2"]
    with pytest.raises(ConfigError, match=message):
        load_config("base", base + overrides)


def test_multilabel_defaults_and_multiclass_refusals():
    cfg = load_config("base", ["data.task=multilabel", "data.format=csv", "data.train_csv=x.csv",
                               "data.val_fraction=0.2"])
    assert (cfg.train.loss, cfg.early_stop.metric) == ("bce", "mAP")
    assert load_config("base", []).train.loss == "ce"   # multiclass untouched
    for override in ("train.loss=asl", "early_stop.metric=mAP"):
        with pytest.raises(ConfigError, match="multilabel"):
            load_config("base", [override])


def test_iterative_split_is_reproducible_and_keeps_every_tag_on_both_sides():
    rng = np.random.default_rng(1)
    keys = [f"img_{i:03d}.png" for i in range(80)]
    labels = [tuple(c for c in range(5) if rng.random() < (0.5 if c < 4 else 0.08)) for _ in keys]
    train, val = tag_split_positions(keys, labels, 5, 0.25, seed=3)
    assert sorted(train + val) == list(range(80)) and len(val) == 20
    # the same split from another listing order: a function of paths and tags, not of the order
    order = list(reversed(range(80)))
    _, val_reversed = tag_split_positions([keys[i] for i in order], [labels[i] for i in order], 5, 0.25, seed=3)
    assert sorted(order[p] for p in val_reversed) == val
    for c in range(5):
        positives = sum(c in labels[p] for p in range(80))
        held = sum(c in labels[p] for p in val)
        assert abs(held - positives * 0.25) <= 1.5, (c, held, positives)
    assert tag_split_positions(keys, labels, 5, 0.25, seed=4)[1] != val


# ---------------------------------------------------------------- losses and mixing


def test_asymmetric_loss_follows_the_paper_and_reduces_to_bce():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, generator=g) * 3
    targets = (torch.rand(6, 5, generator=g) < 0.4).float()
    p = logits.sigmoid()
    p_m = (p - 0.05).clamp(min=0)
    want = -(targets * (1 - p) ** 1 * p.log() + (1 - targets) * p_m ** 4 * (1 - p_m).log()).mean()
    got = AsymmetricLoss(gamma_neg=4, gamma_pos=1, clip=0.05)(logits, targets)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    plain = AsymmetricLoss(gamma_neg=0, gamma_pos=0, clip=0)(logits, targets)
    assert plain.item() == pytest.approx(BinaryCrossEntropy()(logits, targets).item(), rel=1e-5)


def test_mixup_mixes_the_target_vectors():
    images = torch.zeros(3, 3, 4, 4)
    targets = torch.tensor([[1.0, 0, 0], [0, 1.0, 1.0], [0, 0, 0]])
    _, mixed = apply_mix(images, targets, MixDraw("mixup", 0.7), 3)
    assert torch.allclose(mixed, 0.7 * targets + 0.3 * targets.roll(1, 0))


# ---------------------------------------------------------------- metrics and thresholds


@pytest.mark.parametrize("seed", range(4))
def test_map_and_f1_equal_scikit_learn_with_ties(seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 12, (150, 5), generator=g).float() / 11   # many tied scores
    targets = (torch.rand(150, 5, generator=g) < 0.3).float()
    targets[:, 4] = 0                                                    # a class without positives
    metrics = multilabel_metrics(scores, targets, list("abcde"), loss_sum=0.0)
    want = average_precision_score(targets[:, :4].numpy(), scores[:, :4].numpy(), average="macro")
    assert metrics["mAP"] == pytest.approx(100 * want, abs=1e-10)
    for c in range(4):
        assert average_precision(scores[:, c], targets[:, c] > 0) == pytest.approx(
            average_precision_score(targets[:, c].numpy(), scores[:, c].numpy()), abs=1e-12)
    calls = predicted(scores, metrics["thresholds"]).numpy()
    assert metrics["micro_f1"] == pytest.approx(100 * f1_score(targets.numpy(), calls, average="micro"), abs=1e-9)
    assert metrics["macro_f1"] == pytest.approx(
        100 * f1_score(targets[:, :4].numpy(), calls[:, :4], average="macro"), abs=1e-9)
    assert metrics["per_class"]["e"]["ap"] is None and metrics["per_class"]["e"]["positives"] == 0


def f1(truth: np.ndarray, calls: np.ndarray) -> float:
    tp = float((calls & (truth > 0)).sum())
    return 2 * tp / (calls.sum() + (truth > 0).sum()) if tp else 0.0


def test_tuned_thresholds_reach_the_best_f1_of_every_class():
    g = torch.Generator().manual_seed(7)
    scores = torch.rand(120, 4, generator=g)
    targets = ((scores + 0.4 * torch.rand(120, 4, generator=g)) > 0.8).float()
    thresholds = tune_thresholds(scores, targets)
    for c in range(4):
        y, s = targets[:, c].numpy(), scores[:, c].numpy()
        best = max(f1(y, s >= t) for t in np.unique(s))
        assert f1(y, predicted(scores, thresholds)[:, c].numpy()) == pytest.approx(best, abs=1e-12)
        # half-way between two scores: a rounding difference in an export's scores flips no call
        assert not np.isin(np.float32(thresholds[c]), s)


# ---------------------------------------------------------------- one training run, checked every way


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """64 tagged images (a quarter held out by iterative stratification), 2 epochs, mixup, last.pt every step:
    also the uninterrupted run of the resume test."""
    base = tmp_path_factory.mktemp("multilabel")
    train_csv = make_tag_list(base / "data", 64)
    run = base / "run"
    result = run_script("train.py", "--config", "base", *settings(train_csv, run))
    assert result.returncode == 0, result.stderr[-3000:]
    return train_csv, run


def held_out_paths(run: Path, train_csv: Path) -> tuple[list[str], list[str]]:
    with open(run / "split_val.csv") as f:
        rows = list(csv.DictReader(f))
    return [str(train_csv.parent / r["path"]) for r in rows], [r["label"] for r in rows]


@pytest.mark.slow
def test_training_records_map_thresholds_and_the_task(trained):
    train_csv, run = trained
    best = torch.load(run / "best.pt", weights_only=True)
    assert best["config"]["data"]["task"] == "multilabel" and best["classes"] == TAGS
    assert len(best["thresholds"]) == 4 and all(0 < t < 1 for t in best["thresholds"])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best_metric"] == "mAP" and summary["best"]["mAP"] == best["metrics"]["mAP"]
    assert summary["best"]["num_samples"] == 16
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert max(float(r["val_mAP"]) for r in rows) == pytest.approx(summary["best"]["mAP"], abs=1e-3)
    log = (run / "train.log").read_text()
    assert "task: multilabel" in log and "with no tag (all-negative)" in log


@pytest.mark.slow
def test_eval_equals_training_and_scikit_learn_on_infer_probabilities(trained, tmp_path):
    train_csv, run = trained
    report = tmp_path / "eval.json"
    assert script_main("eval", "--checkpoint", run / "best.pt", "--json", report) == 0
    doc = json.loads(report.read_text())
    best = torch.load(run / "best.pt", weights_only=True)
    assert doc["num_samples"] == 16
    for key in ("mAP", "micro_f1", "macro_f1"):
        assert doc[key] == pytest.approx(best["metrics"][key], abs=1e-9), key
    assert set(doc["per_class"]["road"]) == {"ap", "f1", "precision", "recall", "threshold", "positives"}
    assert [doc["per_class"][c]["threshold"] for c in TAGS] == best["thresholds"]

    paths, labels = held_out_paths(run, train_csv)
    out = tmp_path / "pred.csv"
    assert script_main("infer", *paths, "--checkpoint", run / "best.pt", "--output", out, "--num-workers", 0) == 0
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["path", "labels", *TAGS, "error"]
    probs = np.array([[float(r[c]) for c in TAGS] for r in rows])
    truth = np.array([[c in label.split(" ") for c in TAGS] for label in labels], dtype=int)
    present = truth.sum(0) > 0
    sk_map = 100 * average_precision_score(truth[:, present], probs[:, present], average="macro")
    assert doc["mAP"] == pytest.approx(sk_map, abs=1e-6)
    # infer.py calls a tag where its probability reaches the tuned threshold
    for r, p in zip(rows, probs):
        called = {c for c, prob, t in zip(TAGS, p, best["thresholds"]) if prob >= t}
        assert set(filter(None, r["labels"].split(" "))) == called


@pytest.mark.slow
def test_infer_threshold_flag_and_json_rows(trained, tmp_path):
    train_csv, run = trained
    paths, _ = held_out_paths(run, train_csv)
    out = tmp_path / "pred.json"
    assert script_main("infer", *paths[:3], "--checkpoint", run / "best.pt", "--output", out, "--threshold", 0,
                       "--num-workers", 0) == 0
    rows = json.loads(out.read_text())
    assert all(sorted(r["labels"]) == TAGS and set(r["probs"]) == set(TAGS) for r in rows)
    with pytest.raises(ConfigError, match="--threshold 1.5"):
        script_main("infer", paths[0], "--checkpoint", run / "best.pt", "--threshold", 1.5, "--num-workers", 0)
    with pytest.raises(ConfigError, match="multi-label model"):
        get_task("multiclass").check_supported("--threshold")


@pytest.mark.slow
def test_serve_answers_the_tag_rows_infer_writes(trained, tmp_path):
    """serve.py's model on a multi-label checkpoint: the same tags and probabilities as infer.py's JSON rows;
    the reject option is refused for it."""
    from imgcls.model_files.predictor import TrustOptions
    from imgcls.serving.model import ServedModel

    train_csv, run = trained
    paths, _ = held_out_paths(run, train_csv)
    out = tmp_path / "pred.json"
    assert script_main("infer", *paths[:4], "--checkpoint", run / "best.pt", "--output", out, "--num-workers", 0) == 0
    expected = json.loads(out.read_text())
    served = ServedModel.load(str(run / "best.pt"), topk=5, max_batch=4, device_setting="cpu")
    rows = served.classify([served.decode(Path(p).read_bytes()) for p in paths[:4]], list(paths[:4]))
    for row, want in zip(rows, expected):
        assert row["labels"] == want["labels"]
        assert row["probs"] == pytest.approx(want["probs"], abs=1e-5)
    with pytest.raises(ConfigError, match="not for multi-label models"):
        ServedModel.load(str(run / "best.pt"), topk=5, max_batch=4, device_setting="cpu",
                         trust=TrustOptions(reject=True))


@pytest.mark.slow
@pytest.mark.parametrize("fmt, name", [("onnx", "model.onnx"), ("timm", "timm_folder")])
def test_exports_carry_task_and_thresholds_and_evaluate_the_same(trained, tmp_path, fmt, name):
    train_csv, run = trained
    target = tmp_path / name
    assert script_main("export", "--checkpoint", run / "best.pt", "--format", fmt, "--output", target) == 0
    best = torch.load(run / "best.pt", weights_only=True)
    report = tmp_path / "eval.json"
    # an export records no split: the run's split_val.csv names the held-out files (relative to the data)
    assert script_main("eval", "--checkpoint", target, "--json", report, "--data", run / "split_val.csv",
                       f"data.root={train_csv.parent}", "data.num_workers=0") == 0
    doc = json.loads(report.read_text())
    assert [doc["per_class"][c]["threshold"] for c in TAGS] == best["thresholds"]
    assert doc["mAP"] == pytest.approx(best["metrics"]["mAP"], abs=1e-6)
    assert doc["micro_f1"] == pytest.approx(best["metrics"]["micro_f1"], abs=1e-6)


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_is_bitwise_equal(trained, tmp_path):
    train_csv, reference = trained
    run, marker = tmp_path / "run", tmp_path / "paused"
    # 48 training images, batch 8: 6 steps per epoch; killed just after epoch 2's first step is saved
    # (epoch 1 saved last.pt after each of its 6 steps and at its end: the 8th save)
    cmd = [sys.executable, str(REPO / "tests" / "paused_train.py"), str(marker), "after_save:8", "--",
           "--config", "base", *settings(train_csv, run)]
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    wait_for(proc, marker.exists, "the pause point")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    saved = torch.load(run / "last.pt", weights_only=True)
    assert (saved["epoch"], saved["batch_in_epoch"]) == (1, 1)
    result = run_script("train.py", "--config", "base", *settings(train_csv, run), "--resume", "auto")
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("last.pt", "best.pt"):
        a, b = (torch.load(d / name, weights_only=True) for d in (reference, run))
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]), name
        assert a["metrics"].get("mAP") == b["metrics"].get("mAP")
    assert torch.load(run / "best.pt", weights_only=True)["thresholds"] == \
        torch.load(reference / "best.pt", weights_only=True)["thresholds"]


@pytest.mark.slow
def test_ddp_map_equals_single_process_eval(trained, tmp_path):
    """2 processes (gloo), one epoch: every validation score gathered once; eval.py in one process agrees."""
    train_csv, _ = trained
    run = tmp_path / "ddp"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(REPO / "train.py"), "--config", "base",
               *settings(train_csv, run, **{"train.epochs": 1, "train.batch_size": 4, "checkpoint.every_steps": 0})]
    result = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    best = torch.load(run / "best.pt", weights_only=True)
    assert best["metrics"]["num_samples"] == 16   # 8 per rank, no padding duplicates
    report = tmp_path / "eval.json"
    assert script_main("eval", "--checkpoint", run / "best.pt", "--json", report) == 0
    doc = json.loads(report.read_text())
    assert doc["num_samples"] == 16
    assert doc["mAP"] == pytest.approx(best["metrics"]["mAP"], abs=1e-6)
    assert doc["micro_f1"] == pytest.approx(best["metrics"]["micro_f1"], abs=1e-6)


# ---------------------------------------------------------------- tags that cannot be class names, splits that cannot be


@pytest.mark.parametrize("label, words", [
    ("cloud path", "tag 'path' is reserved"), ("labels water", "tag 'labels' is reserved"),
    ("error", "tag 'error' is reserved"), ("cloud\nroad", "control character"), ("tab\tbed", "control character")])
def test_tags_that_break_infer_columns_or_split_class_lists_exit_2(images, label, words):
    """A tag named path / labels / error made infer.py's CSV header ambiguous; a tag holding a newline became
    two lines of the shard writer's classes.txt (12 classes where the report said 11)."""
    rows = [("images/list_0000.png", label), ("images/list_0001.png", "cloud")]
    delimiter = [] if "\t" not in label else ["data.label_delimiter=;"]
    with pytest.raises(DataTreeError, match=words):
        scan(write_list(images / "bad.csv", rows), *delimiter)
    classes = images / "reserved_classes.txt"
    classes.write_text("cloud\npath\n")
    with pytest.raises(DataTreeError, match="'path' is reserved"):
        scan(write_list(images / "ok.csv", [("images/list_0000.png", "cloud")]), f"data.classes={classes}")


def test_shard_writer_refuses_a_tag_with_a_newline(images, tmp_path):
    from imgcls.data.labels import TagLabels
    from imgcls.data.shards import source_index

    listing = write_list(images / "newline.csv", [("images/list_0000.png", "cloud\nroad"),
                                                  ("images/list_0001.png", "water")])
    with pytest.raises(DataTreeError, match="control character"):
        source_index(listing, str(images), TagLabels())


def test_nfc_and_nfd_spellings_of_a_tag_are_one_class(images):
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    rows = [("images/list_0000.png", composed), ("images/list_0001.png", f"{decomposed} road")]
    index = scan(write_list(images / "accents.csv", rows)).train_index
    assert index.classes == [composed, "road"] and index.labels == [(0,), (0, 1)]


def test_an_all_negative_list_without_data_classes_exits_2(images):
    rows = [("images/list_0000.png", ""), ("images/list_0001.png", "")]
    with pytest.raises(DataTreeError, match="data.classes"):
        scan(write_list(images / "negative.csv", rows))


@pytest.mark.parametrize("n", [1, 2])
def test_a_val_fraction_split_that_leaves_a_side_empty_exits_2(images, n):
    """A one-row list crashed the stratifier (ValueError traceback); unique tags per image held out nothing."""
    rows = [(f"images/list_{i:04d}.png", ["cloud", "road"][i]) for i in range(n)]
    cfg = load_config("base", [f"data.train_csv={write_list(images / f'tiny{n}.csv', rows)}", "data.format=csv",
                               "data.task=multilabel", "data.val_fraction=0.01"])
    if n == 2:  # two images, 1 % held out: the stratifier keeps at least one; check the rule itself
        from imgcls.data.listing import check_split_sides

        with pytest.raises(DataTreeError, match="validation side empty"):
            check_split_sides([0, 1], [], 0.01)
        return
    with pytest.raises(DataTreeError, match="data.val_fraction"):
        scan_sources(cfg)


@pytest.mark.slow
def test_explain_draws_one_overlay_per_called_tag_and_says_a_one_cell_peak_is_no_information(trained, tmp_path,
                                                                                              caplog):
    """--explain on a multi-label model exited 2; it draws one overlay per called tag, and names the layer it
    read."""
    train_csv, run = trained
    paths, _ = held_out_paths(run, train_csv)
    out, folder = tmp_path / "pred.json", tmp_path / "cams"
    assert script_main("infer", *paths[:3], "--checkpoint", run / "best.pt", "--output", out, "--threshold", 0,
                       "--explain", folder, "--num-workers", 0) == 0
    rows = json.loads(out.read_text())
    for row in rows:  # --threshold 0: every tag is called, so every tag gets its overlay
        assert [e["label"] for e in row["explain"]] == row["labels"] and len(row["explain"]) == len(TAGS)
        assert len({e["overlay"] for e in row["explain"]}) == len(TAGS)
        # at 16 px Grad-CAM reads a stage fine enough to point (issue 51), and says which
        assert all(Path(e["overlay"]).is_file() and e["layer"] and isinstance(e["peak_informative"], bool)
                   for e in row["explain"])
    assert len(list(folder.iterdir())) == 3 * len(TAGS)
    csv_out = tmp_path / "pred.csv"
    assert script_main("infer", paths[0], "--checkpoint", run / "best.pt", "--output", csv_out, "--threshold", 0,
                       "--explain", tmp_path / "cams_csv", "--num-workers", 0) == 0
    with csv_out.open() as f:
        (row,) = list(csv.DictReader(f))
    assert row["explain_overlay"].count(" | ") == len(TAGS) - 1


@pytest.mark.parametrize("raw, delimiter", [(",", ","), ("|", "|"), (";", ";"), ("' '", " "), ("'|'", "|")])
def test_label_delimiter_overrides_are_taken_as_written(raw, delimiter):
    """data.label_delimiter=, was a YAML error on the command line and | became '' (block scalar)."""
    assert load_config("base", [f"data.label_delimiter={raw}"]).data.label_delimiter == delimiter


@pytest.mark.slow
def test_eval_refuses_single_label_options_on_a_multilabel_model(trained, tmp_path):
    """--reliability and --reject-below were silently ignored on a multi-label model."""
    _, run = trained
    for extra in (["--reject-below", "1.0"], ["--reliability", str(tmp_path / "rel.png")]):
        with pytest.raises(ConfigError, match=f"{extra[0]}: .*(single|multi)-label"):
            script_main("eval", "--checkpoint", run / "best.pt", *extra, "data.num_workers=0")
    assert not (tmp_path / "rel.png").exists()
