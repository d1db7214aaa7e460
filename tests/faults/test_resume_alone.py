"""`train.py --resume PATH` without `--config`: the config comes from what last.pt recorded, overrides on top;
a file without a recorded config, or no file, is a usage error naming what to pass. (The whole path, the stop
message's command run verbatim and resumed bitwise equal: test_resume.py.)"""
from __future__ import annotations

import pytest
import torch

from imgcls.config import config_from_checkpoint, load_config
from imgcls.core.errors import ConfigError
from imgcls.training.rundir import continue_command


def test_the_recorded_config_with_the_overrides_on_top(tmp_path):
    recorded = load_config("base", ["data.root=/data/x", "train.batch_size=16", "model.name=resnet18",
                                    "output.dir=runs/x"])
    path = tmp_path / "last.pt"
    torch.save({"config": recorded.to_dict(), "model": {}}, path)
    cfg = config_from_checkpoint(str(path), ["data.num_workers=0"])
    assert cfg.to_dict() == {**recorded.to_dict(), "data": {**recorded.to_dict()["data"], "num_workers": 0}}
    assert cfg.explicit_keys == {"data.num_workers"}
    with pytest.raises(ConfigError, match="train.epochz"):
        config_from_checkpoint(str(path), ["train.epochz=3"])


def test_no_recorded_config_or_no_file_is_a_usage_error(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"model": {}}, path)
    with pytest.raises(ConfigError, match=r"records no config .* pass --config CONFIG"):
        config_from_checkpoint(str(path), [])
    with pytest.raises(ConfigError, match="does not exist"):
        config_from_checkpoint(str(tmp_path / "missing.pt"), [])


def test_the_continue_command_quotes_paths_and_names_torchrun_under_ddp(tmp_path):
    assert continue_command(tmp_path / "last.pt", 1, "train.py") == f"python train.py --resume {tmp_path / 'last.pt'}"
    assert continue_command("runs/my run/last.pt", 4, "train.py") == \
        "torchrun --nproc_per_node 4 train.py --resume 'runs/my run/last.pt'"
