"""Model factory: timm and tv: names, GroupNorm swap, local weights with a mismatched classifier."""
import logging
import sys

import pytest
import torch
import torchvision
from conftest import TEST_MODEL, tiny_overrides

import train
from imgcls.cli import run_main
from imgcls.models.factory import ModelError, batchnorm_to_groupnorm, create_model, fold_batchnorm, load_local_weights


def has_batchnorm(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def test_group_norm_swap_leaves_no_batchnorm_and_runs():
    model = create_model(TEST_MODEL, 3, norm="group", group_norm_groups=32)
    assert not has_batchnorm(model)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert norms and all(m.num_channels % m.num_groups == 0 for m in norms)
    assert any(m.num_groups == 32 for m in norms)
    out = model(torch.randn(2, 3, 16, 16))
    assert out.shape == (2, 3)
    # a single sample trains without BatchNorm's batch statistics
    model.train()
    model(torch.randn(1, 3, 16, 16)).sum().backward()


def test_group_norm_groups_shrink_to_a_divisor_and_keep_affine_values():
    bn = torch.nn.BatchNorm2d(24)
    with torch.no_grad():
        bn.weight.fill_(2.0)
        bn.bias.fill_(0.5)
    gn = batchnorm_to_groupnorm(torch.nn.Sequential(bn), groups=16)[0]
    assert isinstance(gn, torch.nn.GroupNorm) and gn.num_groups == 12
    assert torch.all(gn.weight == 2.0) and torch.all(gn.bias == 0.5)


def test_batch_norm_is_kept_by_default():
    assert has_batchnorm(create_model(TEST_MODEL, 3))


def _check_loaded_all_but_classifier(model, source, caplog):
    own = model.state_dict()
    for name, tensor in source.items():
        if name.startswith("fc."):
            assert own[name].shape != tensor.shape
        else:
            assert torch.equal(own[name], tensor), name
    assert "fc.weight" in caplog.text and "fc.bias" in caplog.text and "not loaded" in caplog.text


@pytest.mark.parametrize("form", ["state_dict", "checkpoint", "safetensors"])
def test_local_weights_load_all_but_a_mismatched_classifier(tmp_path, caplog, form):
    torch.manual_seed(1)
    source = create_model(TEST_MODEL, 5).state_dict()
    if form == "state_dict":
        path = tmp_path / "weights.pth"
        torch.save(source, path)
    elif form == "checkpoint":   # one of our checkpoints, or a DDP state_dict with module. prefixes
        path = tmp_path / "ckpt.pt"
        torch.save({"model": {f"module.{k}": v for k, v in source.items()}, "epoch": 3}, path)
    else:
        from safetensors.torch import save_file

        path = tmp_path / "weights.safetensors"
        save_file({k: v.contiguous() for k, v in source.items()}, str(path))
    torch.manual_seed(2)
    model = create_model(TEST_MODEL, 3)
    fc_before = model.fc.weight.detach().clone()
    with caplog.at_level(logging.INFO):
        load_local_weights(model, str(path))
    _check_loaded_all_but_classifier(model, source, caplog)
    assert torch.equal(model.fc.weight, fc_before)   # the new classifier keeps its fresh initialisation


def test_weights_file_matching_nothing_is_an_error(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"encoder.weight": torch.zeros(3)}, path)
    with pytest.raises(ModelError, match="no tensor matches"):
        load_local_weights(create_model(TEST_MODEL, 3), str(path))
    with pytest.raises(ModelError, match="no such file"):
        load_local_weights(create_model(TEST_MODEL, 3), str(tmp_path / "missing.pt"))


def test_weights_file_with_pickled_code_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": torch.nn.Linear(2, 2)}, path)  # a whole module: not plain data
    with pytest.raises(ModelError):
        load_local_weights(create_model(TEST_MODEL, 3), str(path))


def test_torchvision_models_by_tv_prefix():
    model = create_model("tv:resnet18", 4)
    assert isinstance(model, torchvision.models.ResNet)
    assert model.fc.out_features == 4
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 4)
    small = create_model("tv:mobilenet_v3_small", 3, drop_rate=0.3)
    assert any(isinstance(m, torch.nn.Dropout) and m.p == 0.3 for m in small.modules())
    with pytest.raises(ModelError, match="model.drop_rate"):
        create_model("tv:resnet18", 4, drop_rate=0.2)   # ResNet has no dropout: said, not silently ignored


def test_timm_drop_rate_reaches_the_model():
    model = create_model(TEST_MODEL, 3, drop_rate=0.25)
    assert model.drop_rate == 0.25


@pytest.mark.parametrize("name, suggestion", [("resnt18", "resnet18"), ("tv:resnet81", "tv:resnet18")])
def test_unknown_model_name_suggests_a_close_one(name, suggestion):
    with pytest.raises(ModelError) as err:
        create_model(name, 3)
    assert name in str(err.value) and suggestion in str(err.value)


def test_unknown_model_exits_2_before_any_work(monkeypatch, capsys, tiny_tree, tmp_path):
    run_dir = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["train.py", "--config", "base",
                                      *tiny_overrides(tiny_tree, run_dir, **{"model.name": "resnet5O"})])
    with pytest.raises(SystemExit) as exit_info:
        run_main(train.main)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "resnet5O" in err and "resnet50" in err
    assert not run_dir.exists()


def test_list_models_prints_timm_and_torchvision_names_that_build(monkeypatch, capsys):
    from imgcls.models.factory import model_exists

    monkeypatch.setattr(sys, "argv", ["train.py", "--list-models", "mobilenetv3_small"])
    with pytest.raises(SystemExit) as exit_info:
        run_main(train.main)
    names = capsys.readouterr().out.split()
    assert exit_info.value.code == 0
    assert "mobilenetv3_small_100" in names and all("mobilenetv3_small" in n for n in names)
    assert all(model_exists(n) for n in names)
    monkeypatch.setattr(sys, "argv", ["train.py", "--list-models", "tv:mobilenet_v3*"])
    with pytest.raises(SystemExit):
        run_main(train.main)
    assert capsys.readouterr().out.split() == ["tv:mobilenet_v3_large", "tv:mobilenet_v3_small"]
    monkeypatch.setattr(sys, "argv", ["train.py", "--list-models", "no-such-model"])
    with pytest.raises(SystemExit) as exit_info:
        run_main(train.main)
    assert exit_info.value.code == 2 and "--list-models no-such-model" in capsys.readouterr().err


def test_cpu_model_guide_rows_are_measured_from_the_model():
    from imgcls.benchmarking.cpu_models import markdown, model_row

    row = model_row("resnet10t", 32, 2, 1, classes=10)
    model = create_model("resnet10t", 10)
    assert row["params_m"] == round(sum(p.numel() for p in model.parameters()) / 1e6, 2)
    assert row["gflops"] > 0 and row["img_per_s"] > 0
    assert "| `resnet10t` | " in markdown([row])


def test_group_norm_swap_keeps_timm_fused_activations():
    """timm's BatchNormAct2d carries the activation: the swap must keep it (GroupNormAct), not drop it."""
    from timm.layers import BatchNormAct2d

    batch = create_model("test_efficientnet", 3)
    group = create_model("test_efficientnet", 3, norm="group")
    assert any(isinstance(m, BatchNormAct2d) for m in batch.modules())
    acts = lambda model: sum(isinstance(m, (torch.nn.SiLU, torch.nn.ReLU, torch.nn.GELU)) for m in model.modules())
    assert acts(group) == acts(batch) > 0
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in group.modules())
    assert group(torch.randn(2, 3, 32, 32)).shape == (2, 3)


def _with_running_stats(model: torch.nn.Module) -> torch.nn.Module:
    """Non-trivial BatchNorm statistics and affine parameters, so folding them is visible in the numbers."""
    generator = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=generator) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=generator) + 0.5)
            m.weight.data.copy_(torch.rand(m.num_features, generator=generator) + 0.5)
            m.bias.data.copy_(torch.randn(m.num_features, generator=generator) * 0.1)
    return model.eval()


@pytest.mark.parametrize("name", [TEST_MODEL, "tv:resnet18"])
def test_fold_batchnorm_removes_the_norms_and_keeps_the_outputs(name):
    model = _with_running_stats(create_model(name, 5))
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        expected = model(x)
        folded, count = fold_batchnorm(model)
        assert count > 0 and not has_batchnorm(folded)
        assert torch.allclose(folded(x), expected, rtol=1e-4, atol=1e-4)
    assert has_batchnorm(model)  # the original is left alone (eval.py must reproduce validation exactly)


def test_fold_batchnorm_leaves_training_and_untraceable_models_alone():
    model = create_model(TEST_MODEL, 5)
    assert fold_batchnorm(model.train()) == (model, 0)

    class DataDependent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3)
            self.bn = torch.nn.BatchNorm2d(4)

        def forward(self, x):
            y = self.bn(self.conv(x))
            return y if y.sum() > 0 else -y  # fx cannot trace a branch on a tensor value

    odd = DataDependent().eval()
    assert fold_batchnorm(odd) == (odd, 0)


# ---------------------------------------------------------------- the classifier and the feature tap


def test_feature_tap_catches_timms_pre_logits():
    """The tap's features are what timm's forward_head(pre_logits=True) returns, and the classifier maps them
    to the logits; a model without a classifier has none to tap."""
    import timm

    from imgcls.models.feature_tap import FeatureTap, classifier_of

    model = timm.create_model("resnet10t", num_classes=4).eval()
    assert classifier_of(model) == ("fc", model.get_classifier())
    tap = FeatureTap(model)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        logits = model(x)
        features = tap.take()
        assert torch.allclose(features, model.forward_head(model.forward_features(x), pre_logits=True))
        assert torch.allclose(model.get_classifier()(features), logits, atol=1e-5)
    tap.close()
    assert not FeatureTap(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))).available
    assert classifier_of(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4, 2))) \
        is None  # neither timm's nor torchvision's: no guess at the last Linear


@pytest.mark.parametrize("name, head", [("resnet18", "fc"), ("mobilenet_v3_small", "classifier.3"),
                                        ("efficientnet_b0", "classifier.1")])
def test_torchvisions_classifier_is_the_last_linear_of_its_head(name, head):
    """fc / classifier / heads; in a Sequential head the last Linear, whose input is the penultimate features
    (mobilenet_v3's classifier has two Linear layers): one rule for the freeze, distillation and rejection."""
    from imgcls.models.factory import classifier_parameter_names
    from imgcls.models.feature_tap import FeatureTap, classifier_of, feature_width

    model = getattr(torchvision.models, name)(num_classes=3).eval()
    found, module = classifier_of(model)
    assert found == head and classifier_parameter_names(model) == {f"{head}.weight", f"{head}.bias"}
    tap = FeatureTap(model, keep_graph=True, keep="last")
    x = torch.randn(2, 3, 32, 32)
    logits = model(x)
    flipped = model(x.flip(3))
    features = tap.take()
    assert features.shape == (2, feature_width(model)) and features.requires_grad
    assert torch.equal(module(features), flipped) and not torch.equal(module(features), logits)  # the last forward's
