"""Optimizers: weight decay on conv / linear weights only; SGD momentum and Nesterov; AdamW settings."""
import pytest
import torch
from conftest import TEST_MODEL

from imgcls.config import OptimConfig
from imgcls.models.factory import create_model
from imgcls.training.optim import build_optimizer, param_groups


def test_no_weight_decay_on_norm_and_bias_parameters():
    model = create_model(TEST_MODEL, 3)
    decay, no_decay = param_groups(model, 1e-4)
    assert decay["weight_decay"] == 1e-4 and no_decay["weight_decay"] == 0.0
    decayed = {id(p) for p in decay["params"]}
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if isinstance(module, (torch.nn.BatchNorm2d, torch.nn.GroupNorm)) or pname == "bias":
                assert id(p) not in decayed, f"{name}.{pname}"
            elif isinstance(module, (torch.nn.Conv2d, torch.nn.Linear)) and pname == "weight":
                assert id(p) in decayed, f"{name}.{pname}"
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_frozen_parameters_are_left_out():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    groups = param_groups(model, 0.1)
    assert sum(len(g["params"]) for g in groups) == 3


def test_sgd_and_adamw_get_their_settings():
    model = torch.nn.Linear(4, 2)
    sgd = build_optimizer(model, OptimConfig(name="sgd", momentum=0.8, nesterov=True, weight_decay=1e-3), lr=0.3)
    assert isinstance(sgd, torch.optim.SGD)
    assert sgd.param_groups[0]["lr"] == 0.3 and sgd.param_groups[0]["momentum"] == 0.8
    assert sgd.param_groups[0]["nesterov"] is True
    # Nesterov needs momentum: with momentum 0 it is turned off instead of failing
    plain = build_optimizer(model, OptimConfig(name="sgd", momentum=0.0, nesterov=True), lr=0.1)
    assert plain.param_groups[0]["nesterov"] is False
    adamw = build_optimizer(model, OptimConfig(name="adamw", betas=[0.8, 0.99], eps=1e-6, weight_decay=0.05), lr=1e-3)
    assert isinstance(adamw, torch.optim.AdamW)
    assert adamw.param_groups[0]["betas"] == (0.8, 0.99) and adamw.param_groups[0]["eps"] == 1e-6
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.05, 0.0]
    assert adamw.param_groups[0]["lr"] == pytest.approx(1e-3)


# ---------------------------------------------------------------- optim.name: every optimizer steps and resumes exactly

OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW, "rmsprop": torch.optim.RMSprop,
              "lamb": "Lamb", "lars": "Lars", "lion": "Lion"}


def _small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, bias=False), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 3))


def _train(model, optimizer, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(6, 3, 8, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_optimizer_steps_and_resumes_exactly(name, tmp_path):
    import timm.optim

    cfg = OptimConfig(name=name, weight_decay=0.01)
    model = _small_model()
    optimizer = build_optimizer(model, cfg, lr=0.01)
    expected = OPTIMIZERS[name]
    assert isinstance(optimizer, getattr(timm.optim, expected) if isinstance(expected, str) else expected)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.01, 0.0]  # never on norm and bias
    start = [p.detach().clone() for p in model.parameters()]
    _train(model, optimizer, 3, seed=1)
    assert all(not torch.equal(a, p) for a, p in zip(start, model.parameters()))  # every tensor moved

    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "last.pt")
    saved = torch.load(tmp_path / "last.pt", weights_only=True)
    resumed = _small_model()
    resumed.load_state_dict(saved["model"])
    resumed_optimizer = build_optimizer(resumed, cfg, lr=0.01)
    resumed_optimizer.load_state_dict(saved["optimizer"])
    _train(model, optimizer, 3, seed=2)
    _train(resumed, resumed_optimizer, 3, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), resumed.state_dict().values()))


def test_optimizers_get_the_options_they_take():
    model = torch.nn.Linear(4, 2)
    lamb = build_optimizer(model, OptimConfig(name="lamb", betas=[0.8, 0.9], eps=1e-6), lr=1e-3)
    assert lamb.param_groups[0]["betas"] == (0.8, 0.9) and lamb.param_groups[0]["eps"] == 1e-6
    lars = build_optimizer(model, OptimConfig(name="lars", momentum=0.8, nesterov=True), lr=1.0)
    assert lars.param_groups[0]["momentum"] == 0.8 and lars.param_groups[0]["nesterov"] is True
    lion = build_optimizer(model, OptimConfig(name="lion", betas=[0.9, 0.99]), lr=1e-4)
    assert lion.param_groups[0]["betas"] == (0.9, 0.99)
    rmsprop = build_optimizer(model, OptimConfig(name="rmsprop", momentum=0.5, eps=1e-3), lr=1e-2)
    assert rmsprop.param_groups[0]["momentum"] == 0.5 and rmsprop.param_groups[0]["eps"] == 1e-3


@pytest.mark.parametrize("name, override", [("adamw", "optim.momentum=0.8"), ("lion", "optim.eps=1e-6"),
                                            ("sgd", "optim.betas=[0.8,0.9]"), ("lamb", "optim.nesterov=false")])
def test_an_option_the_optimizer_does_not_take_is_a_usage_error(name, override):
    from imgcls.config import ConfigError, load_config
    from imgcls.training.optim import check_optimizer

    cfg = load_config("base", [f"optim.name={name}", override])  # torch-free validation cannot know
    with pytest.raises(ConfigError) as err:
        check_optimizer(cfg.optim)
    key = override.split("=")[0]
    assert f"'{key}'" in str(err.value) and f"optim.name={name} does not take it" in str(err.value)


def test_an_optimizer_timm_knows_needs_no_code_and_optim_options_reach_it():
    """adan is in no list of ours: its three betas and optim.options (no_prox) go to timm's constructor."""
    from imgcls.config import load_config
    from imgcls.training.optim import check_optimizer

    cfg = load_config("base", ["optim.name=adan", "optim.betas=[0.98,0.92,0.99]", "optim.options.no_prox=true",
                               "optim.eps=1e-6"])
    check_optimizer(cfg.optim)
    adan = build_optimizer(torch.nn.Linear(4, 2), cfg.optim, lr=1e-3)
    assert type(adan).__name__ == "Adan"
    group = adan.param_groups[0]
    assert group["betas"] == (0.98, 0.92, 0.99) and group["no_prox"] is True and group["eps"] == 1e-6
    lamb = build_optimizer(torch.nn.Linear(4, 2), load_config("base", ["optim.name=lamb",
                                                                       "optim.options={trust_clip: true}"]).optim, 1e-3)
    assert lamb.param_groups[0]["trust_clip"] is True


@pytest.mark.parametrize("overrides, names", [
    (["optim.name=adamz"], ["'optim.name' = 'adamz'", "did you mean 'adam'", "lamb", "lion"]),
    (["optim.name=adan"], ["'optim.betas'", "takes 3 betas"]),
    (["optim.name=lamb", "optim.options.trust_clipping=true"], ["'optim.options.trust_clipping'", "trust_clip"]),
    (["optim.name=adamw", "optim.options.betas=[0.8,0.9]"], ["'optim.options.betas'", "optim.betas instead"]),
])
def test_a_name_or_option_timm_does_not_have_is_a_usage_error(overrides, names):
    from imgcls.config import ConfigError, load_config
    from imgcls.training.optim import check_optimizer

    with pytest.raises(ConfigError) as err:
        check_optimizer(load_config("base", overrides).optim)
    assert all(name in str(err.value) for name in names), str(err.value)


def test_an_unknown_optimizer_exits_2_before_any_work(monkeypatch, capsys, tiny_tree, tmp_path):
    from conftest import run_train_in_process, tiny_overrides

    code, err = run_train_in_process(monkeypatch, capsys, "--config", "base",
                                     *tiny_overrides(tiny_tree, tmp_path / "run"), "optim.name=adamz")
    assert code == 2 and "'optim.name' = 'adamz'" in err and "adamw" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, carries", [("sgd", True), ("adamw", True), ("lamb", True), ("lars", True),
                                           ("rmsprop", True), ("adan", True), ("lion", False), ("clion", False)])
def test_whether_a_nonfinite_gradient_reaches_the_weights_is_measured_not_listed(name, carries):
    """The step checks its gradients itself only where the optimizer would hide a NaN (a sign step)."""
    from imgcls.config import load_config
    from imgcls.training.optim import update_carries_nonfinite

    betas = ["optim.betas=[0.98,0.92,0.99]"] if name == "adan" else []
    assert update_carries_nonfinite(load_config("base", [f"optim.name={name}", *betas]).optim) is carries
