"""Class-folder trees: what counts as a class and an image, links and special files in the tree, and the
errors for unusable trees."""
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, class_image, make_tree

from imgcls.data.datasets import FileListDataset, expand_inputs
from imgcls.data.listing import DataTreeError, scan_split
from imgcls.data.transforms import EvalTransform


def test_hidden_entries_and_non_images_are_ignored_and_classes_sorted(tmp_path):
    root = make_tree(tmp_path, {"zebra": 2, "Apple": 1, "mango": 3}, splits=("train",))
    train = root / "train"
    # hidden class folder with images, hidden files, non-image files, a nested folder inside a class
    (train / ".cache").mkdir()
    class_image(0).save(train / ".cache" / "x.png")
    class_image(0).save(train / "mango" / ".hidden.png")
    (train / "mango" / "._resource_fork.jpg").write_bytes(b"\x00\x01")
    (train / "mango" / "notes.txt").write_text("not an image")
    (train / "mango" / "labels.csv").write_text("a,b")
    class_image(2).save(train / "mango" / "UPPER.JPG", format="JPEG")   # extensions match in any case
    (train / ".DS_Store").write_bytes(b"\x00")
    (train / "README.md").write_text("a stray file beside the class folders")
    (train / "zebra" / "more").mkdir()
    class_image(1).save(train / "zebra" / "more" / "deep.jpg")
    (train / "zebra" / ".thumbs").mkdir()
    class_image(1).save(train / "zebra" / ".thumbs" / "t.png")

    index = scan_split(train)
    assert index.classes == ["Apple", "mango", "zebra"]
    names = [p.split("/")[-1] for p in index.paths]
    assert not any(n.startswith(".") or n.endswith((".txt", ".csv", ".md")) for n in names)
    assert index.class_counts() == [1, 4, 3]    # zebra: its 2 images plus the nested one
    # each file is labelled by the class folder it sits under
    assert all(Path(p).relative_to(train).parts[0] == index.classes[label] for p, label in zip(index.paths, index.labels))
    assert any(p.endswith("zebra/more/deep.jpg") for p in index.paths)


def test_val_classes_differing_from_train_is_an_error_listing_the_difference(tmp_path):
    make_tree(tmp_path, {"cat": 2, "dog": 2, "fox": 2}, splits=("train",))
    make_tree(tmp_path, {"cat": 2, "dog": 2, "owl": 2}, splits=("val",))
    train = scan_split(tmp_path / "train")
    with pytest.raises(DataTreeError) as err:
        scan_split(tmp_path / "val", classes=train.classes)
    message = str(err.value)
    assert "fox" in message and "owl" in message
    assert "missing here: ['fox']" in message and "not in training: ['owl']" in message


def test_empty_class_folder_is_an_error_naming_it(tmp_path):
    make_tree(tmp_path, {"cat": 2, "dog": 2}, splits=("train",))
    (tmp_path / "train" / "empty_one").mkdir()
    (tmp_path / "train" / "only_text").mkdir()
    (tmp_path / "train" / "only_text" / "readme.txt").write_text("no images here")
    with pytest.raises(DataTreeError) as err:
        scan_split(tmp_path / "train")
    assert "empty_one" in str(err.value) and "only_text" in str(err.value)
    assert "cat" not in str(err.value)


def test_split_without_class_folders_is_an_error(tmp_path):
    (tmp_path / "train").mkdir()
    class_image(0).save(tmp_path / "train" / "loose.png")
    with pytest.raises(DataTreeError, match="no class folders"):
        scan_split(tmp_path / "train")


# ---------------------------------------------------------------- links and special files in the tree


SCAN = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
from imgcls.data.listing import scan_split
index = scan_split(sys.argv[1])
print(json.dumps({"counts": index.class_counts(), "paths": index.paths, "labels": index.labels,
                  "skipped": getattr(index, "skipped", [])}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("links", [("self",), ("up",), ("self", "up"), ("outside",)])
def test_links_in_a_class_folder_neither_repeat_nor_relabel_images(tmp_path, links):
    """`ln -s . a/self` counted class a 40 times over, `ln -s .. a/up` labelled b's files as a, and both
    together never finished. Each real folder is read once, never one outside the class folder; a link to
    a single file outside the class folder is left out and listed too (issue 28)."""
    root = make_tree(tmp_path / "data", {"a": 3, "b": 2}, splits=("train",))
    train = root / "train"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    class_image(1).save(elsewhere / "stranger.png")
    targets = {"self": ".", "up": "..", "outside": str(elsewhere)}
    for name in links:
        os.symlink(targets[name], train / "a" / name)
    os.symlink(elsewhere / "stranger.png", train / "b" / "linked.png")
    # In a subprocess: the unfixed scan never ends on ("self", "up").
    done = subprocess.run([sys.executable, "-c", SCAN, str(train)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert found["counts"] == [3, 2]
    assert any(entry.startswith(str(train / "b" / "linked.png")) for entry in found["skipped"])
    for path, label in zip(found["paths"], found["labels"]):
        assert Path(path).relative_to(train).parts[0] == "ab"[label]
        assert "/self/" not in path and "/up/" not in path and "/outside/" not in path
    for name in links:
        assert any(entry.startswith(str(train / "a" / name)) for entry in found["skipped"]), found["skipped"]
        assert str(train / "a" / name) in done.stderr  # the log says what was left out


def test_a_fifo_named_jpg_is_skipped_and_listed_in_scans_and_infer_inputs(tmp_path, caplog):
    root = make_tree(tmp_path / "data", {"a": 2, "b": 2}, splits=("val",))
    fifo = root / "val" / "a" / "pipe.jpg"
    os.mkfifo(fifo)
    with caplog.at_level(logging.WARNING):
        index = scan_split(root / "val")
        inputs = expand_inputs([str(root / "val")])
    assert str(fifo) not in index.paths and str(fifo) not in inputs and len(inputs) == 4
    assert f"{fifo} (a FIFO)" in index.skipped
    assert f"{fifo} (a FIFO)" in caplog.text
    # Named on the command line it is tried, and fails at once instead of waiting for a writer.
    item = FileListDataset([str(fifo)], EvalTransform(16, 0.875, "bilinear"), 16)[0]
    assert item[1] is False and "not a regular file (a FIFO)" in item[3]


def test_file_links_out_of_the_class_folder_are_left_out_and_listed(tmp_path, caplog):
    root = make_tree(tmp_path / "data", {"a": 3, "b": 2}, splits=("train",))
    train = root / "train"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    class_image(0).save(elsewhere / "stranger.png")
    os.symlink("../b/b_0000.png", train / "a" / "fromb.png")            # into another class
    os.symlink(elsewhere / "stranger.png", train / "a" / "outside.png")  # out of the tree
    os.symlink("a_0000.png", train / "a" / "again.png")                  # a second name in its own class
    with caplog.at_level(logging.WARNING):
        index = scan_split(train)
    assert index.class_counts() == [3, 2]
    assert not any(Path(p).name in ("fromb.png", "outside.png", "again.png") for p in index.paths)
    assert f"{train / 'a' / 'fromb.png'} (a link to a file outside {train / 'a'})" in index.skipped
    assert f"{train / 'a' / 'outside.png'} (a link to a file outside {train / 'a'})" in index.skipped
    assert f"{train / 'a' / 'again.png'} (a second name of a file already read)" in index.skipped
    assert "fromb.png" in caplog.text
