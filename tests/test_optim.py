"""Optimizers: weight decay on conv / linear weights only; SGD momentum and Nesterov; AdamW settings."""
import pytest
import torch

from conftest import TEST_MODEL
from core.config import OptimConfig
from engine.optim import build_optimizer, param_groups
from models.factory import create_model


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
