"""A newcomer's first hour (issue 29): pretrained weights without a network (the hub tried once), the shards
hint. (Resume with `--resume PATH` alone: tests/test_resume.py; file modes, the top-5 name and the batch of a
fixed-batch export: tests/test_export.py.)"""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO, run_script, write_pretrained_folder

HF_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", "https_proxy", "HTTPS_PROXY", "all_proxy",
          "ALL_PROXY")


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """Every name lookup fails (as without a network) and is counted; an empty hub cache; offline mode not set
    and not yet decided. Whatever the code under test switches on is undone afterwards."""
    import huggingface_hub.constants as hf_constants

    from models import hub_access

    lookups = []

    def fail(host, *args, **kwargs):
        lookups.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    for key in HF_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # recorded, so that the teardown restores the environment
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_access, "_decided", None)
    return lookups


def fake_hub_cache(cache: Path, repo: str, folder: Path) -> None:
    """`folder`'s files as the hub cache holds a download of `repo` (refs/main -> a snapshot)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for path in folder.iterdir():
        (snapshot / path.name).write_bytes(path.read_bytes())


def test_unreachable_hub_is_tried_once_and_fails_in_one_line(no_network):
    from core.errors import ModelError
    from models.factory import load_pretrained

    started = time.monotonic()
    with pytest.raises(ModelError) as err:
        load_pretrained(SimpleNamespace(name="hf-hub:timm/resnet10t.c3_in1k"))
    assert no_network == ["huggingface.co"], "one probe, no retries"
    message = str(err.value)
    assert "\n" not in message and "huggingface.co:443 cannot be reached" in message
    assert "model.weights=FILE" in message and "local-dir:" in message
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    with pytest.raises(ModelError):  # a second model in the same process: decided, not probed again
        load_pretrained(SimpleNamespace(name="resnet10t.c3_in1k"))
    assert no_network == ["huggingface.co"]
    assert time.monotonic() - started < 30  # the retries took ~50 s; generous for a loaded machine


def test_unreachable_hub_still_loads_cached_weights_without_retries(no_network, tmp_path):
    import torch

    from models.factory import load_pretrained

    expected = write_pretrained_folder(tmp_path / "saved", num_classes=3)
    fake_hub_cache(tmp_path / "hub", "local/tiny-test", tmp_path / "saved")
    model = load_pretrained(SimpleNamespace(name="hf-hub:local/tiny-test"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    assert no_network == ["huggingface.co"]


def test_hf_hub_offline_set_means_no_probe(no_network, monkeypatch):
    from core.errors import ModelError
    from models.factory import load_pretrained

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="HF_HUB_OFFLINE is set"):
        load_pretrained(SimpleNamespace(name="hf-hub:timm/resnet10t.c3_in1k"))
    assert no_network == []


@pytest.mark.parametrize("split, key", [("train", "data.train_shards"), ("val", "data.val_shards")])
def test_shard_writer_prints_the_overrides_to_use_next(tmp_path, capsys, split, key):
    import shlex

    from conftest import make_tree
    from core.config import load_config, parse_override
    from data import shards

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
    from core.config import load_config
    from core.errors import ConfigError
    from data.build import build_run_data, small_folder_batch

    assert [small_folder_batch(n) for n in (0, 7, 8, 40, 100, 1000)] == [1, 1, 2, 8, 16, 128]
    data = make_tree(tmp_path / "data", {"a": (10, 2), "b": (10, 2)})
    cfg = load_config("base", tiny_overrides(data, tmp_path / "run", **{"train.batch_size": 128}))
    with pytest.raises(ConfigError, match=r"\(20 images\); lower it, e.g. train.batch_size=4 \(5 batches per epoch\)"):
        build_run_data(cfg, 128, 0, 1, False)
