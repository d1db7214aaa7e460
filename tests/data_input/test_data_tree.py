"""Class-folder trees: what counts as a class and an image, and the errors for unusable trees."""
from pathlib import Path

import pytest

from conftest import class_image, make_tree
from data.listing.folder import DataTreeError, scan_split


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
