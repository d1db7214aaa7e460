"""Class-incremental training (`incremental.base`, `train.py --extend`): the old classes kept in their order and
the new ones appended, the exemplar memory chosen by herding and carried to the next extension, the imprinted
new rows, weight aligning in best.pt, the old / new split in the log, summary.json and eval.py, and the refusals
before any work (another task, channel count or model family, a hostile or non-model file, a base inside the
run's own directory). The base file is never written."""
from __future__ import annotations

import csv
import hashlib
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import IN_PROCESS, Payload, class_image, run_train_in_process, tiny_overrides

from imgcls.config import load_config
from imgcls.training.trainer import run as train_run

NAMES = ["a", "b", "c", "d", "e", "f"]


def write_images(root: Path, split: str, counts: dict, seed: int) -> None:
    """Images of each named class, coloured by the class's place in NAMES (the same look in every tree)."""
    rng = np.random.default_rng(seed)
    for name, n in counts.items():
        folder = root / split / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            class_image(NAMES.index(name), (20, 20), rng).save(folder / f"{name}_{seed}_{i:03d}.png")


def overrides(data: Path, out: Path, **extra) -> list[str]:
    return tiny_overrides(data, out, **(IN_PROCESS | {"train.epochs": 1, "calibration.temperature": "none"} | extra))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def trees(tmp_path_factory) -> Path:
    """A: a, b, c. B: new d, e and a few more images of old class a; its validation split holds every class.
    C: new f."""
    root = tmp_path_factory.mktemp("incremental")
    write_images(root / "A", "train", {"a": 10, "b": 10, "c": 10}, 1)
    write_images(root / "A", "val", {"a": 4, "b": 4, "c": 4}, 2)
    write_images(root / "B", "train", {"a": 3, "d": 10, "e": 10}, 3)
    write_images(root / "B", "val", {n: 4 for n in NAMES[:5]}, 4)
    write_images(root / "C", "train", {"f": 12}, 5)
    write_images(root / "C", "val", {n: 3 for n in NAMES}, 6)
    return root


@pytest.fixture(scope="module")
def base_run(trees) -> Path:
    out = trees / "runA"
    assert train_run(load_config("base", overrides(trees / "A", out))) == 0
    return out


@pytest.fixture(scope="module")
def extended(trees, base_run) -> tuple[Path, dict]:
    """A+B (4 exemplars per old class), and its starting weights as the set-up left them."""
    import imgcls.training.parts as parts

    started = {}
    real = parts.initialise

    def keep(model, extension, train_index, device, num_workers):
        real(model, extension, train_index, device, num_workers)
        started.update({k: v.clone() for k, v in model.state_dict().items()})

    parts.initialise = keep
    try:
        out = trees / "runAB"
        cfg = load_config("base", overrides(trees / "B", out, **{"incremental.memory_per_class": 4,
                                                                 "incremental.base": base_run / "best.pt",
                                                                 "incremental.align": "true"}))
        assert train_run(cfg) == 0
    finally:
        parts.initialise = real
    return out, started


def test_extend_keeps_old_classes_appends_new_and_reports_the_split(trees, base_run, extended):
    base = base_run / "best.pt"
    out, _ = extended
    best = torch.load(out / "best.pt", weights_only=True)
    assert best["classes"] == ["a", "b", "c", "d", "e"]  # old in order; 'a' in B is an old class, not a new one
    assert best["incremental"]["old_classes"] == ["a", "b", "c"]
    assert best["config"]["incremental"]["base"] == str(base)
    assert digest(base) == best["incremental"]["base"]["sha256"], "the base file is never written"

    # memory: 4 exemplars per old class, herded from A's training files, listed with their content digests
    rows = list(csv.DictReader((out / "memory.csv").open()))
    assert [r["label"] for r in rows] == ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    for r in rows:
        assert Path(r["path"]).parent == trees / "A" / "train" / r["label"] and digest(Path(r["path"])) == r["sha256"]
    assert len({r["path"] for r in rows}) == 12
    # the training split: B's 23 images (3 of them old class a) and the 12 exemplars
    assert json.loads((out / "summary.json").read_text())["incremental"]["memory"]["exemplars"] == 12
    last = torch.load(out / "last.pt", weights_only=True)
    assert last["data_fingerprint"]["train"]["classes"] == {"a": 7, "b": 4, "c": 4, "d": 10, "e": 10}

    # weight aligning: best.pt's new rows have the old rows' mean norm; last.pt keeps the trained rows
    norms = best["model"]["fc.weight"].norm(dim=1)
    assert float(norms[3:].mean()) == pytest.approx(float(norms[:3].mean()), rel=1e-5)
    trained = last["model"]["fc.weight"]
    gain = float(trained.norm(dim=1)[:3].mean() / trained.norm(dim=1)[3:].mean())
    assert torch.allclose(best["model"]["fc.weight"][3:], trained[3:] * gain)
    assert torch.equal(best["model"]["fc.weight"][:3], trained[:3])

    summary = json.loads((out / "summary.json").read_text())
    split = summary["incremental"]
    assert split["old_classes"] == ["a", "b", "c"] and split["new_classes"] == ["d", "e"]
    assert 0 <= split["base_old_top1"] <= 100 and split["base_sha256"] == digest(base)
    b = summary["best"]
    # old top-1 weighs the 12 old-class validation images, new the 8 new ones: all is their weighted mean
    assert b["top1"] == pytest.approx((12 * b["old_top1"] + 8 * b["new_top1"]) / 20)
    assert "top1 old classes" in (out / "train.log").read_text()
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert float(rows[-1]["val_old_top1"]) == b["old_top1"]

    from imgcls.commands.evaluate import evaluate_checkpoint

    result = evaluate_checkpoint(out / "best.pt")
    assert result.split["old_classes"] == ["a", "b", "c"]
    assert result.split["old_top1"] == pytest.approx(b["old_top1"], abs=100 / 12 + 1e-6)  # at most one image apart
    assert result.split["new_top1"] == pytest.approx(b["new_top1"], abs=100 / 8 + 1e-6)


def test_new_rows_are_imprinted_and_memory_carries_to_the_next_extension(trees, base_run, extended):
    """The old rows start as the base's, each new row as the normalised mean embedding of its class x the old
    rows' mean norm. The extension of the extension (A+B+C) takes A's exemplars from A+B's memory list."""
    ab, started = extended
    base = torch.load(base_run / "best.pt", weights_only=True)["model"]
    w = started["fc.weight"]
    assert torch.equal(w[:3], base["fc.weight"]) and torch.equal(started["fc.bias"][:3], base["fc.bias"])
    assert float(w[3].norm()) == pytest.approx(float(base["fc.weight"].norm(dim=1).mean()), rel=1e-5)
    assert float(started["fc.bias"][4]) == pytest.approx(float(base["fc.bias"].mean()))
    assert not torch.allclose(w[3], w[4])
    assert all(torch.equal(started[k], v) for k, v in base.items() if not k.startswith("fc."))

    abc = trees / "runABC"
    assert train_run(load_config("base", overrides(trees / "C", abc, **{"incremental.memory_per_class": 2,
                                                                        "incremental.base": ab / "best.pt"}))) == 0
    best = torch.load(abc / "best.pt", weights_only=True)
    assert best["classes"] == NAMES and best["incremental"]["old_classes"] == NAMES[:5]
    carried = {r["path"] for r in csv.DictReader((ab / "memory.csv").open())}
    rows = list(csv.DictReader((abc / "memory.csv").open()))
    assert [r["label"] for r in rows] == [n for n in NAMES[:5] for _ in range(2)]
    assert {r["path"] for r in rows if r["label"] in ("b", "c")} <= carried  # b, c exist only in A and A+B's memory
    # incremental.align: auto, with exemplars: off (best.pt holds the trained rows)
    assert json.loads((abc / "summary.json").read_text())["incremental"]["align"] is False
    last = torch.load(abc / "last.pt", weights_only=True)
    assert torch.equal(best["model"]["fc.weight"], last["model"]["fc.weight"])


def test_weight_aligning_auto_is_on_only_without_exemplars():
    from types import SimpleNamespace

    from imgcls.objectives.incremental import IncrementalObjective

    def objective(align):
        keys = SimpleNamespace(distill=True, distill_weight=1.0, temperature=2.0, align=align)
        base = SimpleNamespace(classes=["a", "b"], identity={"source": "a.pt", "sha256": "0" * 64})
        return IncrementalObjective(base, None, None, ["a", "b", "c"], "fc", keys, None)

    for align, exemplars, on in (("auto", 0, True), ("auto", 12, False), (True, 12, True), (False, 0, False)):
        made = objective(align)
        made.use_memory({"memory": {"exemplars": exemplars}})
        assert made.align is on and made.summary()["incremental"]["align"] is on
    weights = {"fc.weight": torch.tensor([[3.0, 4.0], [0.0, 5.0], [0.0, 10.0]]), "fc.bias": torch.tensor([1.0, 2.0, 4.0])}
    aligned = objective(True).best_weights(weights)
    assert torch.equal(aligned["fc.weight"][2], torch.tensor([0.0, 5.0])) and float(aligned["fc.bias"][2]) == 2.0
    assert torch.equal(weights["fc.weight"][2], torch.tensor([0.0, 10.0])), "the trained weights are not changed"


@pytest.fixture
def hostile_base(tmp_path) -> tuple[Path, Path]:
    marker = tmp_path / "pwned"
    path = tmp_path / "hostile.pt"
    with open(path, "wb") as f:
        pickle.dump({"model": Payload(marker)}, f)
    return path, marker


def test_bases_that_cannot_be_extended_exit_2_before_any_work(trees, base_run, hostile_base, tmp_path, monkeypatch,
                                                              capsys):
    base = base_run / "best.pt"
    ckpt = torch.load(base, weights_only=True)
    other_channels = tmp_path / "gray.pt"
    torch.save({**ckpt, "config": {**ckpt["config"], "data": {**ckpt["config"]["data"], "channels": 1}}},
               other_channels)
    tagged = tmp_path / "tags.pt"
    data = {**ckpt["config"]["data"], "task": "multilabel", "format": "csv", "train_csv": "t.csv", "val_csv": "v.csv"}
    torch.save({**ckpt, "config": {**ckpt["config"], "data": data}}, tagged)
    text = tmp_path / "notes.pt"
    text.write_text("not a model")
    hostile, marker = hostile_base
    cases = [
        (base, {"model.name": "resnet10t"}, "it is a test_resnet model and model.name is resnet10t"),
        (other_channels, {}, "reads 1-channel images and data.channels is 3"),
        (text, {}, "not a model this program can extend"),
        (hostile, {}, "not a model this program can extend"),
        (tagged, {}, "it is a multilabel model: incremental.base: class-incremental training"),
        (base, {"distill.teacher": str(base)}, "set distill.teacher to null"),
        (base, {"semi.method": "fixmatch", "data.unlabeled": str(trees / "B")}, "do not combine in one run"),
    ]
    for source, extra, message in cases:
        out = tmp_path / f"out_{len(list(tmp_path.iterdir()))}"
        code, err = run_train_in_process(monkeypatch, capsys, "--config", "base",
                                         *overrides(trees / "B", out, **extra), "--extend", str(source))
        assert code == 2 and message in err, (source, extra, err[-1500:])
        assert not (out / "last.pt").exists() and not (out / "memory.csv").exists()
    assert not marker.exists(), "the hostile file was unpickled"
    code, err = run_train_in_process(monkeypatch, capsys, "--config", "base", *overrides(
        trees / "B", tmp_path / "ft", **{"incremental.base": base}), "--finetune", str(base))
    assert code == 2 and "exclude each other" in err
    before = digest(base)
    code, err = run_train_in_process(monkeypatch, capsys, "--config", "base", *overrides(trees / "B", base_run),
                                     "--extend", str(base))
    assert code == 2 and "the base is never written" in err
    assert digest(base) == before


def test_csv_lists_extend_with_a_validation_list_of_every_class(trees, base_run):
    """data.format=csv: the training list holds the new classes only; the validation list every class."""
    lists = {}
    for split in ("train", "val"):
        paths = sorted((trees / "B" / split).glob("*/*.png"))
        lists[split] = trees / f"B_{split}.csv"
        lists[split].write_text("path,label\n" + "".join(f"{p},{p.parent.name}\n" for p in paths
                                                         if split == "val" or p.parent.name != "a"))
    out = trees / "runCSV"
    cfg = load_config("base", overrides(trees / "B", out, **{
        "data.format": "csv", "data.train_csv": lists["train"], "data.val_csv": lists["val"], "data.root": "null",
        "incremental.memory_per_class": 2, "incremental.base": base_run / "best.pt"}))
    assert train_run(cfg) == 0
    best = torch.load(out / "best.pt", weights_only=True)
    assert best["classes"] == ["a", "b", "c", "d", "e"]
    assert json.loads((out / "summary.json").read_text())["best"]["num_samples"] == 20
    from imgcls.commands.evaluate import evaluate_checkpoint

    assert evaluate_checkpoint(out / "best.pt").split["old_classes"] == ["a", "b", "c"]
