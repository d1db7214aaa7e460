"""What the data tools say to do next: the shard writer's overrides (parsed back as the shell passes them), and
the batch size to use when train.batch_size is larger than a small folder."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.parametrize("split, key", [("train", "data.train_shards"), ("val", "data.val_shards")])
def test_shard_writer_prints_the_overrides_to_use_next(tmp_path, capsys, split, key):
    import shlex

    from conftest import make_tree

    import imgcls.data.shards as shards
    from imgcls.config import load_config, parse_override

    tree = make_tree(tmp_path / "tree", {"a": (3, 2), "b": (3, 2)}, ext=".jpg")
    assert shards.main(["--from", str(tree / split), "--to", str(tmp_path / f"{split} shards"),
                        "--shard-size", "2"]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("train.py overrides: ")
    overrides = dict(parse_override(word) for word in shlex.split(line.split(": ", 1)[1]))  # as the shell passes them
    written = sorted(str(p) for p in (tmp_path / f"{split} shards").glob("shard-*.tar"))
    assert len(written) == (3 if split == "train" else 2)
    assert shards.expand_shards(overrides[key]) == written
    if split == "train":
        assert overrides["data.format"] == "webdataset"
        assert Path(overrides["data.classes"]).read_text().split() == ["a", "b"]
        load_config("base", [f"{k}={v}" for k, v in overrides.items()] + ["data.root=null",
                                                                             "data.val_shards=v.tar"])  # valid



def test_a_batch_larger_than_a_small_folder_names_one_that_works(tmp_path):
    from conftest import make_tree, tiny_overrides

    from imgcls.config import load_config
    from imgcls.core.errors import ConfigError
    from imgcls.data.build import build_run_data, small_folder_batch

    assert [small_folder_batch(n) for n in (0, 7, 8, 40, 100, 1000)] == [1, 1, 2, 8, 16, 128]
    data = make_tree(tmp_path / "data", {"a": (10, 2), "b": (10, 2)})
    cfg = load_config("base", tiny_overrides(data, tmp_path / "run", **{"train.batch_size": 128}))
    with pytest.raises(ConfigError, match=r"\(20 images\); lower it, e.g. train.batch_size=4 \(5 batches per epoch\)"):
        build_run_data(cfg, 128, 0, 1, False)
