"""The published recipe configs load, keep every component they list, and train a dry run end to end."""
import json

import pytest
import yaml
from conftest import make_tree, tiny_overrides

from imgcls.config import load_config
from imgcls.training.trainer import run

RECIPES = {
    "resnet50_tv2": {"data.auto_augment": "trivialaugment", "data.random_erasing": 0.1, "data.repeated_augment": 4,
                     "data.img_size": 176, "data.eval_img_size": 224, "train.label_smoothing": 0.1,
                     "train.mixup_alpha": 0.2, "train.cutmix_alpha": 1.0, "model.ema_every_steps": 32,
                     "optim.weight_decay": 2e-5, "train.epochs": 600},
    "resnet50_a3": {"optim.name": "lamb", "train.loss": "bce", "train.bce_target_thresh": 0.2,
                    "data.auto_augment": "randaugment", "data.auto_augment_magnitude": 6, "data.img_size": 160,
                    "data.eval_img_size": 224, "data.crop_pct": 0.95, "train.mixup_alpha": 0.1,
                    "train.cutmix_alpha": 1.0, "train.epochs": 100},
}


def value(cfg, dotted):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_config_holds_its_published_components(name):
    cfg = load_config(name, ["data.root=/data/x"])
    for key, expected in RECIPES[name].items():
        assert value(cfg, key) == pytest.approx(expected) if isinstance(expected, float) else value(cfg, key) == expected, key


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_trains_a_dry_run(name, tmp_path):
    data = make_tree(tmp_path / "data", {"a": (8, 2), "b": (8, 2)})
    out = tmp_path / "run"
    small = tiny_overrides(data, out, **{"train.epochs": 1, "data.limit_train_batches": 2, "data.limit_val_batches": 1,
                                         "data.eval_img_size": 20, "optim.base_batch_size": 8})
    cfg = load_config(name, small)
    assert run(cfg) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["epochs_completed"] == 1 and summary["best"]["num_samples"] == 4
    saved = yaml.safe_load((out / "config.yaml").read_text())
    # the recipe's own components are what ran (the dry-run overrides change only sizes and lengths)
    for key in ("data.auto_augment", "train.mixup_alpha", "train.cutmix_alpha", "optim.name", "train.loss"):
        section, field = key.split(".")
        assert saved[section][field] == value(load_config(name, ["data.root=/x"]), key), key
