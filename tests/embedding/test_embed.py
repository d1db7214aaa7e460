"""embed.py, search.py, eval.py --knn / --linear-probe, export.py --embedding and serve.py /embed, /similar:
the files and their rules, the same vectors by every path, the index growing and switching kind."""
from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil

import numpy as np
import pytest
import torch
from conftest import exit_code, train_tiny
from PIL import Image

import embed
import eval as eval_script
import export
import search

CLASSES = ["a", "b", "c"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(data root, best.pt) of one tiny training run shared by the module."""
    return train_tiny(tmp_path_factory.mktemp("embed"), {name: (8, 3) for name in CLASSES})


def embed_run(*argv) -> int:
    return exit_code(lambda: embed.main([*argv, "--num-workers", "0", "--device", "cpu"]))


def search_run(*argv) -> int:
    return exit_code(lambda: search.main([*argv, "--num-workers", "0", "--device", "cpu"]))


def vectors_by_path(folder) -> dict[str, np.ndarray]:
    vectors = np.load(folder / "embeddings.npy")
    with open(folder / "paths.csv", newline="") as f:
        return {r["path"]: vectors[int(r["index"])] for r in csv.DictReader(f) if r["index"]}


@pytest.mark.slow
def test_embed_writes_normalised_rows_an_index_and_error_rows(trained, tmp_path):
    data, checkpoint = trained
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not an image")
    out = tmp_path / "vectors"
    assert embed_run(str(data / "train"), str(broken), "--checkpoint", str(checkpoint), "--output", str(out)) == 0
    vectors = np.load(out / "embeddings.npy")
    assert vectors.dtype == np.float32 and vectors.shape == (24, 512)  # resnet10t's pooled features
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    with open(out / "paths.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["index"] for r in rows if r["index"]] == [str(i) for i in range(24)]
    bad = [r for r in rows if r["path"] == str(broken)]
    assert bad[0]["index"] == "" and bad[0]["error"]
    info = json.loads((out / "index.json").read_text())
    assert info | {"checkpoint": None} == {"model": "resnet10t", "dim": 512, "metric": "cosine", "count": 24,
                                           "kind": "flat", "checkpoint": None,
                                           "digest": hashlib.sha256(checkpoint.read_bytes()).hexdigest()}
    assert (out / "index.faiss").is_file() and not list(out.glob(".*tmp"))


def reencoded(image_path, target, quality=90, shift=0):
    image = Image.open(image_path).convert("RGB")
    if shift:
        image = image.transform(image.size, Image.AFFINE, (1, 0, shift, 0, 1, 0))
    image.save(target, quality=quality)


@pytest.mark.slow
def test_search_finds_an_exact_copy_first_and_a_reencoded_copy_in_the_top_5(trained, tmp_path):
    data, checkpoint = trained
    out = tmp_path / "vectors"
    assert embed_run(str(data), "--checkpoint", str(checkpoint), "--output", str(out)) == 0
    original = sorted((data / "train" / "b").iterdir())[2]
    queries = tmp_path / "queries"
    queries.mkdir()
    shutil.copy(original, queries / "copy.png")
    reencoded(original, queries / "jpeg.jpg", quality=85, shift=1)
    result = tmp_path / "found.json"
    assert search_run(str(queries / "copy.png"), str(queries / "jpeg.jpg"), "--index", str(out), "--top-k", "5",
                      "--output", str(result)) == 0
    rows = json.loads(result.read_text())
    copy = [r for r in rows if r["query"].endswith("copy.png")]
    assert copy[0]["rank"] == 1 and copy[0]["path"] == str(original) and copy[0]["score"] == pytest.approx(1, abs=1e-5)
    assert [r["score"] for r in copy] == sorted((r["score"] for r in copy), reverse=True)
    assert str(original) in [r["path"] for r in rows if r["query"].endswith("jpeg.jpg")]


@pytest.mark.slow
def test_another_model_exits_2_naming_both_and_the_folder_grows_by_new_files_only(trained, tmp_path, capsys):
    data, checkpoint = trained
    images = tmp_path / "images"
    shutil.copytree(data / "val", images)
    out = tmp_path / "vectors"
    assert embed_run(str(images), "--checkpoint", str(checkpoint), "--output", str(out)) == 0
    before = vectors_by_path(out)
    assert len(before) == 9
    extra = sorted((data / "train" / "c").iterdir())[:2]
    for path in extra:
        shutil.copy(path, images / "c" / f"new_{path.name}")
    capsys.readouterr()
    assert embed_run(str(images), "--checkpoint", str(checkpoint), "--output", str(out)) == 0
    assert "2 of 11 input file(s) are new" in capsys.readouterr().err
    after = vectors_by_path(out)
    assert len(after) == 11 and json.loads((out / "index.json").read_text())["count"] == 11
    for path, vector in before.items():
        np.testing.assert_array_equal(after[path], vector)  # kept, not embedded again
    found = tmp_path / "found.csv"
    new_file = str(images / "c" / f"new_{extra[0].name}")
    assert search_run(new_file, "--index", str(out), "--top-k", "1", "--output", str(found)) == 0
    assert next(csv.DictReader(open(found)))["path"] == new_file

    other = tmp_path / "other.pt"
    ckpt = torch.load(checkpoint, weights_only=True)
    ckpt["model"] = {k: v + 0.01 if v.is_floating_point() else v for k, v in ckpt["model"].items()}
    torch.save(ckpt, other)
    capsys.readouterr()
    assert search_run(new_file, "--index", str(out), "--checkpoint", str(other)) == 2
    message = capsys.readouterr().err
    assert str(other) in message and str(checkpoint) in message
    assert embed_run(str(images), "--checkpoint", str(other), "--output", str(out)) == 2
    assert json.loads((out / "index.json").read_text())["count"] == 11


@pytest.mark.slow
def test_embed_py_the_onnx_export_and_serve_py_give_the_same_vectors(trained, tmp_path):
    from fastapi.testclient import TestClient

    from imgcls.serving.app import ServeSettings, create_app
    from imgcls.serving.model import ServedModel
    from imgcls.serving.slim import OnnxServedModel

    data, checkpoint = trained
    onnx_file = tmp_path / "model.onnx"
    assert exit_code(lambda: export.main(["--checkpoint", str(checkpoint), "--format", "onnx", "--output",
                                          str(onnx_file), "--dynamic-batch", "--embedding"])) == 0
    from_checkpoint, from_onnx = tmp_path / "ckpt", tmp_path / "onnx"
    assert embed_run(str(data / "val"), "--checkpoint", str(checkpoint), "--output", str(from_checkpoint)) == 0
    assert embed_run(str(data / "val"), "--checkpoint", str(onnx_file), "--output", str(from_onnx)) == 0
    want, got = vectors_by_path(from_checkpoint), vectors_by_path(from_onnx)
    assert want.keys() == got.keys() and min(float(want[p] @ got[p]) for p in want) >= 0.999
    paths = sorted(want)[:3]
    for served in (ServedModel.load(str(checkpoint), 5, 4, "cpu"), OnnxServedModel.load(str(onnx_file), 5, 4)):
        with TestClient(create_app(served, ServeSettings(max_batch=4))) as client:
            for path in paths:
                answer = client.post("/embed", content=open(path, "rb").read())
                assert answer.status_code == 200
                assert float(np.array(answer.json()["embedding"]) @ want[path]) >= 0.999
            assert client.post("/similar?k=2", content=open(paths[0], "rb").read()).status_code == 404  # no --index


@pytest.mark.slow
def test_serve_similar_answers_the_index_neighbours(trained, tmp_path):
    from fastapi.testclient import TestClient

    from imgcls.embedding.index import load_index
    from imgcls.serving.app import ServeSettings, create_app
    from imgcls.serving.model import ServedModel

    data, checkpoint = trained
    out = tmp_path / "vectors"
    assert embed_run(str(data / "train"), "--checkpoint", str(checkpoint), "--output", str(out)) == 0
    query = sorted((data / "train" / "a").iterdir())[1]
    served = ServedModel.load(str(checkpoint), 5, 4, "cpu")
    with TestClient(create_app(served, ServeSettings(max_batch=4), load_index(out))) as client:
        answer = client.post("/similar?k=3", content=query.read_bytes()).json()["neighbours"]
        assert len(answer) == 3 and answer[0]["path"] == str(query) and answer[0]["score"] == pytest.approx(1, abs=1e-5)
        assert client.post("/similar?k=0", content=query.read_bytes()).status_code == 400


def numpy_knn_top1(bank, bank_labels, queries, labels, k, temperature=0.07) -> float:
    """The weighted vote written out with numpy alone (eval.py's uses FAISS)."""
    similarity = queries @ bank.T
    correct = 0
    for row, label in zip(similarity, labels):
        nearest = np.argsort(-row, kind="stable")[:k]
        votes = np.zeros(len(CLASSES))
        np.add.at(votes, bank_labels[nearest], np.exp(row[nearest] / temperature))
        correct += int(votes.argmax() == label)
    return 100.0 * correct / len(labels)


@pytest.mark.slow
def test_eval_knn_and_linear_probe_add_their_top1_to_the_json(trained, tmp_path):
    data, checkpoint = trained
    report = tmp_path / "eval.json"
    assert exit_code(lambda: eval_script.main(["--checkpoint", str(checkpoint), "--knn", "3", "--linear-probe",
                                               "--json", str(report), "train.device=cpu",
                                               "data.num_workers=0"])) == 0
    doc = json.loads(report.read_text())
    assert doc["knn_k"] == 3 and doc["memory_bank_size"] == 24 and 0 <= doc["linear_probe_top1"] <= 100
    split = {}
    for name in ("train", "val"):
        out = tmp_path / name
        assert embed_run(str(data / name), "--checkpoint", str(checkpoint), "--output", str(out)) == 0
        by_path = vectors_by_path(out)
        paths = sorted(by_path)
        split[name] = (np.stack([by_path[p] for p in paths]),
                       np.array([CLASSES.index(p.split("/")[-2]) for p in paths]))
    assert doc["knn_top1"] == pytest.approx(numpy_knn_top1(*split["train"], *split["val"], k=3))


@pytest.mark.slow
def test_eval_knn_above_the_memory_bank_is_clipped_to_it_and_says_so(trained, tmp_path, capsys):
    data, checkpoint = trained
    report = tmp_path / "eval.json"
    assert exit_code(lambda: eval_script.main(["--checkpoint", str(checkpoint), "--knn", "1000000", "--json",
                                               str(report), "train.device=cpu", "data.num_workers=0"])) == 0
    doc = json.loads(report.read_text())
    assert doc["knn_k"] == doc["memory_bank_size"] == 24  # main: knn_k 1000000
    assert "--knn 1000000: the memory bank holds 24 image(s); k clipped to 24" in capsys.readouterr().err


def test_the_index_turns_approximate_above_the_exact_limit_and_grows_by_add(tmp_path, monkeypatch):
    import imgcls.embedding.index as index_module
    from imgcls.embedding.index import IndexInfo, PathRow, load_index, update_index, write_rows

    monkeypatch.setattr(index_module, "EXACT_LIMIT", 50)
    write_rows(tmp_path, [PathRow(f"{i}.png", i) for i in range(80)])
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((80, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    info = IndexInfo("m", 16, "cosine", 0, "", "model.pt", "d")
    update_index(tmp_path, vectors[:40], info, None)
    assert json.loads((tmp_path / "index.json").read_text())["kind"] == "flat"
    update_index(tmp_path, vectors, IndexInfo(**vars(info)), index_module.read_info(tmp_path))
    loaded = load_index(tmp_path)
    assert loaded.info.kind == "hnsw" and loaded.info.count == 80
    scores, rows = loaded.search(vectors[[3, 45, 79]], 1)
    assert rows[:, 0].tolist() == [3, 45, 79]


def test_usage_errors_exit_2(tmp_path, capsys):
    afile = tmp_path / "x.png"
    Image.new("RGB", (8, 8)).save(afile)
    assert exit_code(lambda: embed.main([str(afile), "--checkpoint", "none.pt", "--output", str(afile)])) == 2
    assert exit_code(lambda: search.main([str(afile), "--index", str(tmp_path), "--top-k", "0"])) == 2
    assert exit_code(lambda: search.main([str(afile), "--index", str(tmp_path)])) == 2  # not an embed.py folder
    assert "index.json" in capsys.readouterr().err
    assert exit_code(lambda: export.main(["--checkpoint", "x.pt", "--format", "pt2", "--output", "x.pt2",
                                          "--embedding"])) == 2
    assert exit_code(lambda: eval_script.main(["--checkpoint", "x.pt", "--knn", "0"])) == 2
    capsys.readouterr()
    assert exit_code(lambda: eval_script.main(["--checkpoint", "x.pt2", "--knn", "3"])) == 2  # logits only
    assert "--knn / --linear-probe: x.pt2 gives logits only" in capsys.readouterr().err


@pytest.mark.slow
def test_a_pretrained_timm_folder_with_another_head_gets_the_feature_figures_alone(trained, tmp_path):
    from conftest import write_pretrained_folder

    data, _ = trained
    folder = tmp_path / "pretrained"
    write_pretrained_folder(folder, num_classes=5)  # a head of 5 numbered classes, not the data's a, b, c
    report = tmp_path / "features.json"
    assert exit_code(lambda: eval_script.main(["--checkpoint", str(folder), "--data", str(data), "--knn", "3",
                                               "--linear-probe", "--json", str(report), "data.num_workers=0"])) == 0
    doc = json.loads(report.read_text())
    assert doc["features_only"] and doc["classes"] == CLASSES and doc["num_samples"] == 9 and "top1" not in doc
    split = {}
    for name in ("train", "val"):
        out = tmp_path / name
        assert embed_run(str(data / name), "--checkpoint", str(folder), "--output", str(out)) == 0
        by_path = vectors_by_path(out)
        paths = sorted(by_path)
        split[name] = (np.stack([by_path[p] for p in paths]),
                       np.array([CLASSES.index(p.split("/")[-2]) for p in paths]))
    assert doc["knn_top1"] == pytest.approx(numpy_knn_top1(*split["train"], *split["val"], k=3))


def rows_by_path(folder) -> dict[str, int]:
    with open(folder / "paths.csv", newline="") as f:
        return {r["path"]: int(r["index"]) for r in csv.DictReader(f) if r["index"]}


@pytest.mark.slow
def test_rows_of_deleted_or_changed_files_are_dropped_and_one_file_is_indexed_once(trained, tmp_path, capsys,
                                                                                  monkeypatch):
    data, checkpoint = trained
    images = tmp_path / "images"
    shutil.copytree(data / "train", images)
    monkeypatch.chdir(tmp_path)
    spelled_twice = ["images/a/../a/" + sorted(os.listdir(images / "a"))[0], "./images/" + "a/" +
                     sorted(os.listdir(images / "a"))[0]]
    out = tmp_path / "vectors"
    assert embed_run("images", *spelled_twice, "--checkpoint", str(checkpoint), "--output", str(out)) == 0
    assert len(rows_by_path(out)) == 24 and json.loads((out / "index.json").read_text())["count"] == 24
    deleted, changed = sorted((images / "a").iterdir())[1], sorted((images / "b").iterdir())[0]
    deleted.unlink()
    Image.new("RGB", (32, 32), (255, 0, 0)).save(changed)
    os.utime(changed, ns=(1, 1))
    assert embed_run("images", "--checkpoint", str(checkpoint), "--output", str(out)) == 0
    rows = rows_by_path(out)
    assert len(rows) == 23 and sorted(rows.values()) == list(range(23))
    assert not any(path.endswith(deleted.name) and "/a/" in path for path in rows)
    assert json.loads((out / "index.json").read_text())["count"] == 23
    found = tmp_path / "found.csv"
    assert search_run(str(changed), "--index", str(out), "--top-k", "23", "--output", str(found)) == 0
    answered = list(csv.DictReader(open(found)))
    assert len(answered) == 23 and answered[0]["path"].endswith(changed.name)
    assert float(answered[0]["score"]) == pytest.approx(1, abs=1e-5)  # the new content, not the old vector
    assert len({os.path.realpath(r["path"]) for r in answered}) == 23


@pytest.mark.slow
def test_a_forged_digest_over_vectors_of_another_length_and_a_bad_k_are_refused(trained, tmp_path, capsys):
    from fastapi.testclient import TestClient

    from imgcls.core.errors import ConfigError
    from imgcls.embedding.index import IndexInfo, PathRow, load_index, update_index, write_rows
    from imgcls.serving.app import ServeSettings, create_app
    from imgcls.serving.model import ServedModel
    from imgcls.serving.server import check_served_index_dim

    data, checkpoint = trained
    folder = tmp_path / "v"  # a 1024-d index whose index.json names this model's digest
    folder.mkdir()
    vectors = np.eye(4, 1024, dtype=np.float32)
    np.save(folder / "embeddings.npy", vectors)
    write_rows(folder, [PathRow(f"{i}.png", i) for i in range(4)])
    update_index(folder, vectors, IndexInfo("resnet10t", 1024, "cosine", 0, "", str(checkpoint),
                                            hashlib.sha256(checkpoint.read_bytes()).hexdigest()), None)
    query = sorted((data / "train" / "a").iterdir())[0]
    capsys.readouterr()
    assert search_run(str(query), "--index", str(folder), "--checkpoint", str(checkpoint)) == 2
    message = capsys.readouterr().err
    assert "1024" in message and "512" in message and "Traceback" not in message
    served = ServedModel.load(str(checkpoint), 5, 4, "cpu")
    with pytest.raises(ConfigError, match="1024"):
        check_served_index_dim(served, load_index(folder), str(folder))

    good = tmp_path / "good"
    assert embed_run(str(data / "train"), "--checkpoint", str(checkpoint), "--output", str(good)) == 0
    with TestClient(create_app(served, ServeSettings(max_batch=4), load_index(good))) as client:
        for k in ("abc", "1.5", "-1", "99999999999"):
            answer = client.post(f"/similar?k={k}", content=query.read_bytes())
            assert answer.status_code == 400 and answer.json()["error"] == "bad_k", answer.text
        assert client.post("/similar?k=2", content=query.read_bytes()).status_code == 200
def test_search_table_header_sits_over_its_columns():
    """Issue 64: query paths longer than the 40-character column pushed every row right of its header."""
    from imgcls.commands.embed import format_table

    rows = [{"query": "short.png", "rank": 1, "score": 0.5, "path": "a.png", "error": None},
            {"query": "/data/a/very/long/folder/name/of/queries/" + "q" * 30 + ".png", "rank": 10, "score": 0.25,
             "path": "b.png", "error": None},
            {"query": "broken.png", "rank": None, "score": None, "path": None, "error": "cannot identify image"}]
    header, *lines = format_table(rows).splitlines()
    rank_end, score_end, path_at = header.index("rank") + 4, header.index("score") + 5, header.index("path")
    for line in lines[:2]:
        assert line[rank_end - 1] != " " and line[rank_end] == " " and line[score_end - 1] != " "
        assert line[path_at:].endswith(".png") and line[path_at - 1] == " "
    assert lines[2].index("error:") == header.index("rank")
