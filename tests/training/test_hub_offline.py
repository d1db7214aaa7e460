"""Pretrained weights without a network: the hub is tried once (one probe, counted with every name lookup
failing), then offline mode answers from the cache at once; HF_HUB_OFFLINE means no probe."""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import write_pretrained_folder

HF_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT", "https_proxy", "HTTPS_PROXY", "all_proxy",
          "ALL_PROXY")


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """Every name lookup fails (as without a network) and is counted; an empty hub cache; offline mode not set
    and not yet decided. Whatever the code under test switches on is undone afterwards."""
    import huggingface_hub.constants as hf_constants

    import imgcls.models.factory as hub_access

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
    from imgcls.core.errors import ModelError
    from imgcls.models.factory import load_pretrained

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

    from imgcls.models.factory import load_pretrained

    expected = write_pretrained_folder(tmp_path / "saved", num_classes=3)
    fake_hub_cache(tmp_path / "hub", "local/tiny-test", tmp_path / "saved")
    model = load_pretrained(SimpleNamespace(name="hf-hub:local/tiny-test"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    assert no_network == ["huggingface.co"]


def test_hf_hub_offline_set_means_no_probe(no_network, monkeypatch):
    from imgcls.core.errors import ModelError
    from imgcls.models.factory import load_pretrained

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError, match="HF_HUB_OFFLINE is set"):
        load_pretrained(SimpleNamespace(name="hf-hub:timm/resnet10t.c3_in1k"))
    assert no_network == []
