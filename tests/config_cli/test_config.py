"""Config: loading, overrides, validation errors (exit 2 naming the key), base.yaml in step with the defaults."""
import re

import pytest
import yaml
from conftest import run_script, run_train_in_process, tiny_overrides

from imgcls.config import CONFIG_DIR, Config, ConfigError, all_keys, load_config, read_yaml, resolve_config_path


@pytest.mark.slow
def test_unknown_key_exits_2_naming_it_and_the_close_match(tmp_path):
    result = run_script("train.py", "--config", "quickstart", "train.epochz=3", f"output.dir={tmp_path / 'run'}")
    assert result.returncode == 2
    assert "train.epochz" in result.stderr and "train.epochs" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()     # refused before any work


@pytest.mark.parametrize("override, close", [
    ("optim.lr_scalling=sqrt", "optim.lr_scaling"),
    ("data.img_sise=64", "data.img_size"),
    ("epochs=3", "train.epochs"),
])
def test_unknown_keys_suggest_the_close_match(override, close):
    with pytest.raises(ConfigError) as err:
        load_config("quickstart", [override])
    assert override.split("=")[0] in str(err.value) and close in str(err.value)


def test_an_unknown_key_lists_what_its_section_has():
    with pytest.raises(ConfigError) as err:
        load_config("base", ["optim.momentun=0.8"])
    assert "did you mean 'optim.momentum'" in str(err.value)
    assert "section 'optim' has: name, lr, lr_scaling, base_batch_size, momentum" in str(err.value)
    with pytest.raises(ConfigError, match=r"did you mean 'train'\? \(the sections are: data, model, train"):
        load_config("base", ["trian.epochs=3"])


def test_unknown_key_in_a_yaml_file_names_file_and_key(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("train:\n  epochs: 3\n  bach_size: 32\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert str(path) in str(err.value) and "train.bach_size" in str(err.value) and "train.batch_size" in str(err.value)


@pytest.mark.parametrize("override, key, allowed", [
    ("train.epochs=three", "train.epochs", "int"),
    ("train.epochs=2.5", "train.epochs", "int"),
    ("optim.lr=fast", "optim.lr", "float"),
    ("data.sampler=balanced", "data.sampler", "'weighted'"),
    ("train.amp=fp8", "train.amp", "'bf16'"),
    ("data.scale=0.5", "data.scale", "list"),
    ("train.channels_last=maybe", "train.channels_last", "bool"),
    ("train.batch_size=big", "train.batch_size", "'auto'"),
    ("train=3", "train", "mapping"),
])
def test_wrong_type_is_refused_naming_key_and_what_is_allowed(override, key, allowed):
    with pytest.raises(ConfigError) as err:
        load_config("quickstart", [override])
    assert f"'{key}'" in str(err.value) and allowed in str(err.value)


@pytest.mark.parametrize("override, key", [
    ("train.epochs=0", "train.epochs"),
    ("optim.lr=0", "optim.lr"),
    ("optim.lr=-0.1", "optim.lr"),
    ("data.hflip=1.5", "data.hflip"),
    ("train.accum_steps=0", "train.accum_steps"),
    ("train.batch_size=0", "train.batch_size"),
    ("data.scale=[0.9,0.2]", "data.scale"),
    ("data.scale=[0.5,1.5]", "data.scale"),
    ("data.std=[0.2,0,0.2]", "data.std"),
    ("data.mean=[0.5,0.5]", "data.mean"),
    ("early_stop.patience=0", "early_stop.patience"),
    ("optim.betas=[0.9,1.0]", "optim.betas"),
    ("data.val_fraction=0", "data.val_fraction"),
])
def test_out_of_range_is_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config("quickstart", [override])
    assert f"'{key}'" in str(err.value)


@pytest.mark.parametrize("override", [
    "data.max_bad_fraction=.nan", "optim.lr=.nan", "optim.lr=.inf", "optim.momentum=.nan",
    "train.clip_grad_norm=.nan", "optim.weight_decay=.inf", "data.mean=[.nan,0,0]", "schedule.warmup_epochs=.inf",
    "data.crop_pct=.nan", "data.crop_pct=1e-300", "optim.lr=1e308", "train.seed=99999999999999999999999",
    "data.std=[.inf,1,1]", "train.label_smoothing=.nan", "data.hflip=.nan", "schedule.min_lr=.nan",
    "early_stop.min_delta=.nan", "data.img_size=100000", "train.epochs=99999999999", "data.ratio=[1e-300,1]",
    "optim.lr=nan", "train.clip_grad_norm=-inf",
])
def test_nan_inf_and_extreme_config_values_are_refused_naming_the_key(override):
    """No range test catches NaN; `nan` and `-inf` spelt as words (YAML reads them as text) are named as
    non-finite numbers, not as text where a float belongs."""
    key, value = override.split("=")
    with pytest.raises(ConfigError) as err:
        load_config("quickstart", [override])
    assert f"'{key}'" in str(err.value)
    if value in ("nan", "-inf"):
        assert "NaN and infinity are refused" in str(err.value)
    elif "nan" in value or "inf" in value:
        assert "must be a finite number" in str(err.value)


def test_a_yaml_typo_is_not_called_a_tag(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("train:\n  epochs: [3\n")
    with pytest.raises(ConfigError) as err:
        read_yaml(path)
    assert "is not valid YAML" in str(err.value) and "tags" not in str(err.value)


def test_bad_values_exit_2_through_train_py(monkeypatch, capsys, tmp_path):
    code, err = run_train_in_process(monkeypatch, capsys, "--config", "quickstart", "train.epochs=0",
                                     f"output.dir={tmp_path / 'run'}")
    assert code == 2 and "'train.epochs'" in err and ">= 1" in err
    code, err = run_train_in_process(monkeypatch, capsys, "--config", "quickstart", "data.sampler=balanced",
                                     f"output.dir={tmp_path / 'run'}")
    assert code == 2 and "'data.sampler'" in err and "'weighted'" in err
    code, err = run_train_in_process(monkeypatch, capsys, "--config", "quickstart", "optim.lr=.nan",
                                     f"output.dir={tmp_path / 'run'}")
    assert code == 2 and "'optim.lr' = nan" in err and "finite" in err
    assert not (tmp_path / "run").exists()


def test_missing_data_root_exits_2_naming_the_path(monkeypatch, capsys, tmp_path):
    missing = tmp_path / "no" / "such" / "images"
    code, err = run_train_in_process(monkeypatch, capsys, "--config", "resnet18", f"data.root={missing}",
                                     f"output.dir={tmp_path / 'run'}")
    assert code == 2 and str(missing) in err
    assert not (tmp_path / "run").exists()


def test_data_root_without_val_split_exits_2_naming_the_split(monkeypatch, capsys, tmp_path):
    (tmp_path / "data" / "train" / "a").mkdir(parents=True)
    code, err = run_train_in_process(monkeypatch, capsys, "--config", "resnet18", f"data.root={tmp_path / 'data'}",
                                     f"output.dir={tmp_path / 'run'}")
    assert code == 2 and "val/" in err


def test_unset_data_root_exits_2_saying_how_to_set_it(monkeypatch, capsys, tmp_path):
    code, err = run_train_in_process(monkeypatch, capsys, "--config", "resnet50", f"output.dir={tmp_path / 'run'}")
    assert code == 2 and "data.root" in err


def test_config_names_resolve(tmp_path):
    by_name = resolve_config_path("resnet50")
    assert by_name == CONFIG_DIR / "resnet50.yaml"
    assert resolve_config_path("resnet50.yaml") == by_name
    assert resolve_config_path(str(by_name)) == by_name
    own = tmp_path / "mine.yml"
    own.write_text("train:\n  epochs: 7\noptim:\n  weight_decay: 1e-4\n")
    cfg = load_config(str(own))
    assert cfg.train.epochs == 7
    assert cfg.optim.weight_decay == pytest.approx(1e-4)   # YAML 1.1 reads 1e-4 as a string; still a number
    with pytest.raises(ConfigError) as err:
        resolve_config_path("resnet05")
    assert "resnet50" in str(err.value)


def test_overrides_are_parsed_as_yaml_and_win_over_the_file():
    cfg = load_config("quickstart", ["train.epochs=3", "data.scale=[0.5,1.0]", "train.amp=bf16",
                                     "model.name=resnet18", "optim.lr=1e-3", "train.clip_grad_norm=null",
                                     "output.progress_bar=off"])
    assert cfg.train.epochs == 3 and cfg.data.scale == [0.5, 1.0] and cfg.train.amp == "bf16"
    assert cfg.optim.lr == pytest.approx(1e-3) and isinstance(cfg.optim.lr, float)
    assert cfg.train.clip_grad_norm is None and cfg.output.progress_bar is False
    assert cfg.data.img_size == 32                      # from quickstart.yaml
    assert cfg.optim.momentum == Config().optim.momentum  # from the defaults


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    needs = {"multilabel": ["data.train_csv=tags.csv", "data.val_fraction=0.2"]}  # its data comes as a tag list
    cfg = load_config(path.stem, needs.get(path.stem, []))
    assert isinstance(cfg, Config)


def test_resnet50_config_is_the_standard_recipe():
    cfg = load_config("resnet50")
    assert (cfg.model.name, cfg.data.img_size, cfg.optim.name, cfg.optim.lr, cfg.optim.base_batch_size,
            cfg.optim.lr_scaling, cfg.schedule.warmup_epochs, cfg.train.label_smoothing) == \
        ("resnet50", 224, "sgd", 0.1, 256, "linear", 5, 0.1)


def test_base_yaml_equals_the_dataclass_defaults():
    assert read_yaml(CONFIG_DIR / "base.yaml") == Config().to_dict()


def test_every_base_yaml_key_is_documented_on_its_line():
    lines = (CONFIG_DIR / "base.yaml").read_text().splitlines()
    section, documented, undocumented = None, [], []
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        top = re.match(r"^(\w+):\s*(#.*)?$", line)
        if top:
            section = top.group(1)
            continue
        leaf = re.match(r"^\s+(\w+):\s*\S", line)
        assert leaf, f"unexpected line in base.yaml: {line!r}"
        key = f"{section}.{leaf.group(1)}"
        value_and_comment = line.split(":", 1)[1]
        (documented if re.search(r"\s#\s*\S", value_and_comment) else undocumented).append(key)
    assert undocumented == []
    assert sorted(documented) == sorted(all_keys())


def test_resolved_config_round_trips(tmp_path):
    from imgcls.config import config_from_dict, dump_yaml

    cfg = load_config("quickstart", tiny_overrides(tmp_path / "data", tmp_path / "run"))
    path = tmp_path / "config.yaml"
    path.write_text(dump_yaml(cfg))
    assert load_config(str(path)) == cfg
    assert config_from_dict(yaml.safe_load(path.read_text())) == cfg


def test_min_lr_above_the_scaled_peak_exits_2(monkeypatch, capsys, tiny_tree, tmp_path):
    # peak = 0.05 x 8 / 256 = 0.0015625 after linear scaling; a min_lr above it would make the cosine rise
    code, err = run_train_in_process(monkeypatch, capsys, "--config", "base",
                                     *tiny_overrides(tiny_tree, tmp_path / "run", **{"schedule.min_lr": 0.01}))
    assert code == 2 and "'schedule.min_lr'" in err and "0.0015625" in err
    assert not (tmp_path / "run" / "last.pt").exists()


@pytest.mark.parametrize("overrides, names", [
    (["schedule.name=multistep", "schedule.milestones=[30,20]"], ["schedule.milestones", "strictly increasing"]),
    (["schedule.name=multistep", "schedule.milestones=[]"], ["schedule.milestones", "non-empty"]),
    (["schedule.name=plateau", "schedule.plateau_patience=5", "early_stop.patience=3"],
     ["early_stop.patience", "schedule.plateau_patience"]),
    (["train.bce_target_thresh=0.2"], ["train.bce_target_thresh", "train.loss=bce"]),
    (["model.ema_every_steps=4"], ["model.ema_every_steps", "model.ema_decay"]),
    (["model.ema_warmup=true"], ["model.ema_warmup", "model.ema_decay"]),
    (["train.mix_prob=1.5"], ["train.mix_prob", "<= 1.0"]),
    (["data.random_erasing=-0.1"], ["data.random_erasing", ">= 0.0"]),
    (["schedule.name=linear"], ["schedule.name", "'multistep'"]),
])
def test_bad_recipe_combinations_are_refused_naming_the_keys(overrides, names):
    with pytest.raises(ConfigError) as err:
        load_config("base", overrides)
    assert all(name in str(err.value) for name in names), str(err.value)


def test_a_bad_recipe_combination_exits_2_through_train_py(monkeypatch, capsys, tiny_tree, tmp_path):
    code, err = run_train_in_process(monkeypatch, capsys, "--config", "base",
                                     *tiny_overrides(tiny_tree, tmp_path / "run"), "schedule.name=multistep",
                                     "schedule.milestones=[2,1]")
    assert code == 2 and "schedule.milestones" in err
    assert not (tmp_path / "run").exists()


def test_resume_of_a_checkpoint_written_before_the_recipe_keys_sees_no_difference():
    from imgcls.config import config_differences

    saved = Config().to_dict()
    for section, key in (("train", "mixup_alpha"), ("train", "loss"), ("schedule", "name"), ("data", "random_erasing"),
                         ("model", "ema_every_steps")):
        del saved[section][key]
    assert config_differences(saved, Config().to_dict()) == []
    current = Config()
    current.train.mixup_alpha = 0.2
    assert config_differences(saved, current.to_dict()) == ["train.mixup_alpha: 0.0 -> 0.2"]
def test_the_loader_records_the_keys_a_config_or_an_override_set():
    cfg = load_config("quickstart", ["train.epochs=3", "data.mean=[0.5,0.5,0.5]"])
    assert {"data.crop_pct", "data.img_size", "train.epochs", "data.mean"} <= cfg.explicit_keys
    assert "data.std" not in cfg.explicit_keys and "explicit_keys" not in cfg.to_dict()
    assert load_config("base").explicit_keys == set()  # base.yaml restates the defaults: nothing set by the user


def test_fill_unset_keeps_what_the_user_set():
    from imgcls.config import fill_unset

    cfg = load_config(None, ["data.std=[0.3,0.3,0.3]"])
    lines = fill_unset(cfg, {"data.mean": (0.5, 0.4, 0.3), "data.std": [0.2, 0.2, 0.2], "data.crop_pct": 0.95}, "X")
    assert (cfg.data.mean, cfg.data.std, cfg.data.crop_pct) == ([0.5, 0.4, 0.3], [0.3, 0.3, 0.3], 0.95)
    assert lines[1] == "data.std = [0.3, 0.3, 0.3] (set in the config; X has [0.2, 0.2, 0.2])"
    with pytest.raises(ConfigError, match="data.crop_pct"):
        fill_unset(cfg, {"data.crop_pct": 1.5}, "X")


@pytest.mark.parametrize("overrides, message", [
    (["model.unfreeze_epoch=2"], "model.freeze"),
    (["model.freeze=head"], "model.freeze"),
    (["model.pretrained=true", "model.weights=w.pt"], "model.weights"),
    (["optim.layer_decay=0"], "optim.layer_decay"),
    (["optim.head_lr_scale=-1"], "optim.head_lr_scale"),
])
def test_fine_tuning_keys_are_validated(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
