"""benchmarking/kd_compare.py without timm's train.py: the recipe's mapping onto timm's flags, the settings it
refuses, and reading both programs' result files."""
import pytest

from imgcls.benchmarking.kd_compare import (UnmappedSetting, main, markdown_table, parse_env, summarise_ours,
                                            summarise_timm, timm_flags)
from imgcls.config import load_config

STUDENT = ["model.name=resnet10t", "train.epochs=6", "distill.teacher=/nowhere/best.pt"]


def flag_values(flags: list[str], name: str) -> list[str]:
    """The values after `name` up to the next flag."""
    start = flags.index(name) + 1
    end = next((i for i in range(start, len(flags)) if flags[i].startswith("-") and not flags[i][1:2].isdigit()),
               len(flags))
    return flags[start:end]


def test_quickstart_recipe_maps_onto_timm_flags():
    flags = timm_flags(load_config("quickstart", STUDENT), 10, "/t/teacher", amp_bf16=True, device="cpu")
    # our 6 epochs hold 1 warmup epoch, then a per-step cosine over 5: timm's warmup prefix on top of --epochs 5
    assert flag_values(flags, "--epochs") == ["5"] and flag_values(flags, "--warmup-epochs") == ["1"]
    assert "--warmup-prefix" in flags and "--sched-on-updates" in flags
    assert flag_values(flags, "--warmup-lr") == ["0"] and flag_values(flags, "--min-lr") == ["0"]
    assert flag_values(flags, "--lr") == ["0.1"]  # 0.4 at batch 256, linearly scaled to batch 64
    assert flag_values(flags, "-b") == ["64"] and flag_values(flags, "--opt") == ["sgd"]
    assert flag_values(flags, "--scale") == ["0.7", "1"] and flag_values(flags, "--ratio") == ["0.9", "1.1"]
    assert flag_values(flags, "--hflip") == ["0"] and flag_values(flags, "--color-jitter") == ["0"]
    assert flag_values(flags, "--train-interpolation") == ["bilinear"]
    assert flag_values(flags, "--smoothing") == ["0.1"] and flag_values(flags, "--num-classes") == ["10"]
    assert flag_values(flags, "--kd-model-name") == ["local-dir:/t/teacher"]
    assert flag_values(flags, "--kd-temperature") == ["4"]
    assert flag_values(flags, "--task-loss-weight") == ["0.5"]  # alpha 0.5: timm's complementary weights
    assert flag_values(flags, "--amp-dtype") == ["bfloat16"] and flag_values(flags, "--device") == ["cpu"]
    assert "--amp" not in timm_flags(load_config("quickstart", STUDENT), 10, "/t", amp_bf16=False, device="cpu")
    alpha = timm_flags(load_config("quickstart", STUDENT + ["distill.alpha=0.7"]), 10, "/t", False, "cpu")
    assert flag_values(alpha, "--task-loss-weight") == ["0.3"]


@pytest.mark.parametrize("override,key", [("train.mixup_alpha=0.2", "train.mixup_alpha"),
                                          ("distill.type=hard", "distill.type"),
                                          ("schedule.warmup_epochs=0.5", "schedule.warmup_epochs"),
                                          ("optim.nesterov=false", "optim.nesterov")])
def test_settings_timm_cannot_express_are_refused_by_name(override, key):
    with pytest.raises(UnmappedSetting, match=key):
        timm_flags(load_config("quickstart", STUDENT + [override]), 10, "/t", False, "cpu")


def test_refused_setting_exits_2_before_any_run(tmp_path, capsys):
    (tmp_path / "data" / "train" / "a").mkdir(parents=True)
    teacher = tmp_path / "best.pt"
    teacher.write_bytes(b"")
    rc = main(["--timm-train", str(tmp_path / "train.py"), "--teacher", str(teacher), "--data",
               str(tmp_path / "data"), "--out", str(tmp_path / "out"), "--seeds", "0", "train.cutmix_alpha=1.0"])
    assert rc == 2 and "train.cutmix_alpha" in capsys.readouterr().err
    assert not (tmp_path / "out" / "teacher_timm").exists()


def test_results_are_read_from_both_programs_files():
    timm_csv = ("epoch,train_loss,eval_loss,eval_top1,eval_top5,lr\n0,1.1,1.2,60.0,92.0,0.1\n"
                "1,0.5,0.2,99.0,100,0.05\n2,0.4,0.2,99.0,100,0.0\n3,0.4,0.2,98.5,100,0.0\n")
    assert summarise_timm(timm_csv) == {"best_top1": 99.0, "best_epoch": 2, "last_top1": 98.5, "epochs": 4}
    metrics = "epoch,val_top1,val_teacher_agreement\n1,10.0,9.0\n2,99.4,99.1\n3,99.1,99.0\n"
    summary = {"best": {"top1": 99.4}, "best_epoch": 2, "epochs_completed": 3}
    assert summarise_ours(summary, metrics) == {"best_top1": 99.4, "best_epoch": 2, "last_top1": 99.1, "epochs": 3}
    row = dict(run="ours", seed=0, best_top1=99.4, best_epoch=2, last_top1=99.1, wall_s=249.4, cpu_s=301.2,
               load_before=1.5, load_after=3.25)
    assert markdown_table([row]).splitlines()[-1] == "| ours | 0 | 99.40 | 2 | 99.10 | 4m09s | 301.2 | 1.50 / 3.25 |"


def test_timm_env_is_name_value_pairs():
    assert parse_env("OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=1000") == {"OMP_WAIT_POLICY": "PASSIVE",
                                                                        "GOMP_SPINCOUNT": "1000"}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_env("OMP_WAIT_POLICY")
