"""Fine-tuning: pretrained weights from a local-dir: folder the test writes (nothing is downloaded), the
pretrained preprocessing as data.* defaults, freezing the backbone until model.unfreeze_epoch, layer-wise LR
decay and the classifier's LR multiplier, and the one-line exit 2 when hub weights cannot be had offline."""
from __future__ import annotations

import urllib.error

import pytest
import torch
import yaml
from conftest import (PRETRAINED_PREPROCESSING, make_tree, run_script, run_train_in_process, tiny_overrides,
                      write_pretrained_folder)

import imgcls.training.trainer as trainer_module
from imgcls.config import ConfigError, OptimConfig, load_config
from imgcls.core.errors import ModelError
from imgcls.model_files.checkpoint_files import read_checkpoint
from imgcls.models.factory import (build_model, check_model_name, create_model, load_pretrained,
                                   load_pretrained_weights, pretrained_preprocessing)
from imgcls.training.optim import base_lr, build_optimizer, param_groups
from imgcls.training.schedule import build_scheduler


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """(folder, its state_dict): a 5-class test_resnet with its own preprocessing."""
    folder = tmp_path_factory.mktemp("pretrained") / "test_resnet_folder"
    return folder, write_pretrained_folder(folder)


def test_hub_and_local_dir_names_are_checked(pretrained, tmp_path):
    check_model_name("hf-hub:timm/resnet50.a1_in1k")
    check_model_name(f"local-dir:{pretrained[0]}")
    with pytest.raises(ModelError, match="hf-hub:ORG/NAME"):
        check_model_name("hf-hub:resnet50")
    with pytest.raises(ModelError, match="config.json"):
        check_model_name(f"local-dir:{tmp_path / 'missing'}")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"architecture": "no_such_net"}')
    with pytest.raises(ModelError, match="no_such_net"):
        check_model_name(f"local-dir:{tmp_path / 'odd'}")


@pytest.mark.slow
def test_freeze_then_unfreeze_with_pretrained_folder(pretrained, tmp_path, monkeypatch, capsys):
    """One run: the folder's tensors are loaded before the first step (new 3-class classifier), the preprocessing
    follows its config except the key set on the command line, epoch 1 trains the classifier alone (every other
    tensor, BatchNorm statistics included, bitwise the folder's, and no optimizer state for them), epoch 2 all."""
    folder, source = pretrained
    data = make_tree(tmp_path / "data", {"a": (8, 3), "b": (8, 3), "c": (8, 3)})
    run = tmp_path / "run"
    snapshots = []

    def record(self):  # the model and which parameters have optimizer state, at setup and after each epoch
        model = self.run.models.model
        names = {id(p): n for n, p in model.named_parameters()}
        snapshots.append(({k: v.clone() for k, v in model.state_dict().items()},
                          {names[id(p)] for p in self.run.step.optimizer.state}))

    real_fit, real_end = trainer_module.Trainer.fit, trainer_module.Trainer.end_epoch
    monkeypatch.setattr(trainer_module.Trainer, "fit", lambda self: (record(self), real_fit(self))[1])
    monkeypatch.setattr(trainer_module.Trainer, "end_epoch", lambda self, *a: (record(self), real_end(self, *a)))
    overrides = tiny_overrides(data, run, **{"model.name": f"local-dir:{folder}", "model.pretrained": "true",
                                             "data.std": "[0.3,0.3,0.3]", "model.freeze": "backbone",
                                             "model.unfreeze_epoch": 1, "optim.lr": 0.5})
    code, err = run_train_in_process(monkeypatch, capsys, "--config", "base", *overrides)
    assert code == 0, err[-3000:]

    (start, start_state), (epoch1, state1), (epoch2, state2) = snapshots
    backbone = [k for k in source if not k.startswith("fc.")]
    assert all(torch.equal(start[k], source[k]) for k in backbone)
    assert start["fc.weight"].shape == (3, source["fc.weight"].shape[1]) and not start_state
    assert "new classifier initialised for our 3 classes" in err
    frozen_changed = [k for k in backbone if not torch.equal(epoch1[k], source[k])]
    assert not frozen_changed, f"frozen tensors changed in epoch 1: {frozen_changed[:5]}"
    assert not torch.equal(epoch1["fc.weight"], start["fc.weight"])
    assert state1 == {"fc.weight", "fc.bias"}, "frozen parameters must have no optimizer state"
    params = [k for k in backbone if k.endswith(("weight", "bias"))]
    assert all(not torch.equal(epoch2[k], source[k]) for k in params), "the backbone trains from unfreeze_epoch on"
    assert not torch.equal(epoch2["layer1.0.bn1.running_mean"], source["layer1.0.bn1.running_mean"])
    assert len(state2) == len(list(create_model("test_resnet", 3).parameters()))
    assert "epoch 2: backbone unfrozen" in err

    expected = dict(PRETRAINED_PREPROCESSING, std=[0.3, 0.3, 0.3])
    assert "data.std = [0.3, 0.3, 0.3] (set in the config;" in err and "data.mean = [0.5, 0.4, 0.3] (from local-dir:" in err
    saved = yaml.safe_load((run / "config.yaml").read_text())["data"]
    assert {k: saved[k] for k in expected} == expected
    best = torch.load(run / "best.pt", weights_only=True)["preprocessing"]
    assert {k: best[k] for k in expected} == expected
    loaded = read_checkpoint(run / "best.pt")  # what eval.py and infer.py apply
    assert {k: getattr(loaded.cfg.data, k) for k in expected} == expected


def test_layer_decay_and_head_lr_scale_give_per_group_lrs():
    model = create_model("test_resnet", 3)  # group_matcher: stem 0, layer1..4 -> 1..4, classifier 5
    cfg = OptimConfig(name="sgd", weight_decay=1e-4, layer_decay=0.5, head_lr_scale=10.0)
    optimizer = build_optimizer(model, cfg, lr=0.2)
    lr_of = {id(p): (g["lr"], g["weight_decay"]) for g in optimizer.param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    expected = {"conv1.0.weight": 0.2 * 0.5 ** 5, "layer1.0.conv1.weight": 0.2 * 0.5 ** 4,
                "layer4.0.conv2.weight": 0.2 * 0.5, "fc.weight": 0.2 * 10, "fc.bias": 0.2 * 10}
    for name, lr in expected.items():
        assert lr_of[id(named[name])][0] == pytest.approx(lr), name
    for name, p in named.items():  # the no-decay rule holds in every group
        assert lr_of[id(p)][1] == (0.0 if p.ndim <= 1 else 1e-4), name
    assert len(lr_of) == len(named)
    scheduler = build_scheduler(optimizer, 2, 10, 0.0, 0.0)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    lrs = {g["lr"] / g["lr_scale"] for g in optimizer.param_groups}
    assert max(lrs) == pytest.approx(min(lrs)) == pytest.approx(base_lr(optimizer))  # the schedule keeps the ratios

    head_only = param_groups(model, 1e-4, head_lr_scale=3.0)
    assert [(g["lr_scale"], g["weight_decay"], len(g["params"])) for g in head_only][2:] == [(3.0, 1e-4, 1), (3.0, 0.0, 1)]
    with pytest.raises(ConfigError, match="optim.layer_decay"):
        param_groups(create_model("tv:resnet18", 3), 1e-4, layer_decay=0.7)


@pytest.mark.slow
def test_offline_hub_model_exits_2_with_one_line(tmp_path):
    data = make_tree(tmp_path / "data", {"a": 2, "b": 2})
    name = "hf-hub:timm/resnet10t.c3_in1k"
    result = run_script("train.py", "--config", "base", *tiny_overrides(data, tmp_path / "run", **{
        "model.name": name, "model.pretrained": "true"}), env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr
    for part in (name, "model.weights=FILE", "local-dir:", "HF_HUB_OFFLINE"):
        assert part in errors[0]
    assert not (tmp_path / "run" / "last.pt").exists()


def test_torchvision_weights_offline_and_unknown_tags_are_model_errors(monkeypatch):
    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -2] Name or service not known")

    with pytest.raises(ModelError, match="no pretrained weights with that tag"):
        load_pretrained(load_config(None, ["model.name=resnet10t.no_such_tag", "model.pretrained=true"]).model)
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", offline)
    with pytest.raises(ModelError, match="tv:resnet18.*model.weights=FILE.*TORCH_HOME"):
        load_pretrained(load_config(None, ["model.name=tv:resnet18", "model.pretrained=true"]).model)


def test_torchvision_and_timm_preprocessing_come_from_their_weights_configs():
    tv = pretrained_preprocessing("tv:resnet18", None)  # the weights' transforms: nothing downloaded
    assert tv == {"data.mean": [0.485, 0.456, 0.406], "data.std": [0.229, 0.224, 0.225],
                  "data.interpolation": "bilinear", "data.crop_pct": 224 / 256}
    timm_values = pretrained_preprocessing("test_resnet", create_model("test_resnet", 3))
    assert timm_values["data.mean"] == [0.5, 0.5, 0.5] and timm_values["data.crop_pct"] == 0.95


@pytest.mark.parametrize("labels, kept", [(["a", "b", "c"], True), (None, False), (["x", "y", "z"], False)])
def test_the_pretrained_classifier_is_kept_only_for_our_classes(tmp_path, caplog, labels, kept):
    """Three pretrained classes are not ours unless the folder's label_names say so: the classifier is new."""
    import logging

    source = write_pretrained_folder(tmp_path / "folder", num_classes=3, label_names=labels)
    cfg = load_config(None, [f"model.name=local-dir:{tmp_path / 'folder'}", "model.pretrained=true"])
    torch.manual_seed(5)
    model = build_model(cfg.model, 3)
    fresh = model.fc.weight.detach().clone()
    with caplog.at_level(logging.INFO):
        load_pretrained_weights(model, load_pretrained(cfg.model), cfg.model.name, ["a", "b", "c"])
    assert torch.equal(model.fc.weight, source["fc.weight"] if kept else fresh)
    assert torch.equal(model.conv1[0].weight, source["conv1.0.weight"])
    assert ("classifier loaded too" if kept else "new classifier initialised for our 3 classes") in caplog.text


@pytest.mark.parametrize("source, target", [(4, 1), (4, 2), (4, 3), (1, 2)])
def test_finetuning_across_channel_counts_adapts_the_stem_and_loads_every_tensor(source, target, caplog):
    """A checkpoint of `source` input channels into a run of data.channels=`target`: the stem is adapted by timm's
    rule for any count (one channel sums the filters, N repeat them scaled by source / N) and nothing starts from
    random (main: AssertionError for 4 -> 1, NotImplementedError for 4 -> 2 and 1 -> 2, a random stem for 4 -> 3)."""
    from imgcls.models.factory import stem_conv
    from imgcls.training.rundir import apply_finetune

    cfg = load_config("base", ["model.name=test_resnet"])
    trained = build_model(cfg.model, 2, source)
    ckpt = {"model": trained.state_dict(), "config": {"model": {"name": "test_resnet"}}}
    model = build_model(cfg.model, 2, target)
    with caplog.at_level("INFO"):
        assert apply_finetune(model, ckpt, "four.pt") == 1.0
    assert f"{source}-channel weights adapted to {target} input channels" in caplog.text
    assert "starting from random" not in caplog.text
    (stem, stem_in), (_, stem_out) = stem_conv(trained), stem_conv(model)
    assert stem_out.weight.shape[1] == target
    for j in range(target):  # band j takes source band j mod source (all of them summed for one channel)
        want = stem_in.weight.sum(1) if target == 1 else stem_in.weight[:, j % source] * (source / target)
        assert torch.allclose(stem_out.weight[:, j], want)
    if target == 1 or target % source == 0:  # then a constant image gives the source model's stem response
        flat_in, flat_out = torch.full((1, source, 8, 8), 0.5), torch.full((1, target, 8, 8), 0.5)
        with torch.no_grad():
            assert torch.allclose(stem_out(flat_out), stem_in(flat_in), atol=1e-5)
    others = {k for k in ckpt["model"] if k != f"{stem}.weight"}
    assert all(torch.equal(model.state_dict()[k], ckpt["model"][k]) for k in others)
