"""tune.py: the sweep's arithmetic on synthetic curves (smoothing, the loss after the same samples, time
to target, knee, verdict), its losses reproducible per seed on real steps, the LR range test's suggestion on
a synthetic curve and identical on both ranks of a 2-process gloo group, bad input exiting 2 (a batch BatchNorm
cannot train on, warm-up as long as the run), small batches swept, and SIGTERM keeping the sizes so far."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from argparse import Namespace

import pytest
import torch
from conftest import REPO, make_tree, run_script, tiny_overrides, wait_for

from imgcls.compute.device import Runtime
from imgcls.compute.distributed import DistInfo
from imgcls.config import load_config
from imgcls.core.errors import ConfigError
from imgcls.training.arithmetic import (Curve, exponential_lrs, learning_failure, loss_after_samples, loss_at_seconds,
                                        lr_suggestion, smooth, sweep_rows, sweep_verdict, throughput_knee,
                                        time_to_target_noise)
from imgcls.tuning.sweep import MemoryCheck, attempts_for, chance_loss, sweep_batch_sizes


def curve(batch, losses, seconds_per_step):
    steps = list(range(1, len(losses) + 1))
    return Curve(batch, 1, batch, steps, [s * batch for s in steps], [s * seconds_per_step for s in steps], losses)


def test_smoothing_is_debiased():
    assert smooth([2.0] * 5) == pytest.approx([2.0] * 5)
    assert smooth([1.0, 3.0], beta=0.5) == pytest.approx([1.0, (0.25 + 0.75 * 1 + 0.5 * 3 - 0.75) / 0.75])


def test_time_to_target_on_known_step_times():
    """Batch 64 at 0.1 s/step reaches 0.5 at step 30 (3.0 s); batch 256 at 0.25 s/step at step 10 (2.5 s);
    batch 1024 at 0.8 s/step at step 5 (4.0 s): 256 wins though 1024 has the most img/s. Step times are
    steady, so each time's noise is one logged step: 0.1, 0.25 and 0.8 s, less than the differences."""
    def falling(to_target):  # loss 1 -> 0.5 exactly at step `to_target`, lower after
        return [1.0 - 0.5 * s / to_target for s in range(1, 41)]

    results = [{"size": b, "how": "as is", "fits": True, "curve": curve(b, falling(k), t), "img_per_s": b / t,
                "seconds_per_step": t, "peak_memory_mb": 1.0}
               for b, k, t in ((64, 30, 0.1), (256, 10, 0.25), (1024, 5, 0.8))]
    rows, target, common = sweep_rows(results, 0.5)
    assert [r["steps_to_target"] for r in rows] == [30, 10, 5]
    assert [r["time_to_target_s"] for r in rows] == pytest.approx([3.0, 2.5, 4.0])
    assert [r["time_to_target_noise_s"] for r in rows] == pytest.approx([0.1, 0.25, 0.8])
    assert common == 40 * 64
    # after the 2560 samples batch 64 saw: batch 256 took 10 steps, batch 1024 2.5 (interpolated)
    assert rows[1]["loss_at_common_samples"] == pytest.approx(0.5)
    assert rows[2]["loss_at_common_samples"] == pytest.approx(1.0 - 0.5 * 2.5 / 5)
    verdict = sweep_verdict(rows)
    assert verdict == {"lowest_loss_at_equal_time": 256, "not_reaching_target": [], "not_learning": [],
                       "least_time_to_target": 256, "within_noise": [256], "throughput_knee": 1024,
                       "largest_that_fits": 1024}
    # no target given: the loss half of the sizes reached (the median of the minima), not the worst size's
    minima = sorted(min(r["curve"].losses) for r in results)
    assert sweep_rows(results, None)[1] == pytest.approx(minima[1]) and minima[1] < minima[2]


def test_the_verdict_compares_what_the_plot_shows_loss_at_equal_wall_time():
    """The issue's case: 20 steps each; batch 16 is lower than 32 and 64 at every wall-clock time but, having
    seen 320 samples, never reaches the default target, so the least time to it goes to batch 32. The verdict
    names batch 16 at equal wall time (the plot's comparison) and says why 16 has no time to target."""
    from imgcls.commands.tune import format_verdict

    steps = list(range(1, 21))
    # wall time per step 0.5, 1.0, 2.0 s; by wall time batch 16 falls fastest while it runs (10 s), the others
    # slowly over those 10 s and faster after, to 0.9 (batch 32, at 20 s) and 1.0 (batch 64, at 40 s)
    def loss(b, t):
        if b == 16:
            return 2.0 - 0.05 * t
        slow = {32: 0.02, 64: 0.01}[b]
        end, last = {32: (20.0, 0.9), 64: (40.0, 1.0)}[b]
        return 2.0 - slow * t if t <= 10 else (2.0 - slow * 10) + ((last - (2.0 - slow * 10)) * (t - 10) / (end - 10))

    results = [{"size": b, "how": "as is", "fits": True, "img_per_s": b / t, "seconds_per_step": t,
                "peak_memory_mb": 1.0,
                "curve": Curve(b, 1, b, steps, [s * b for s in steps], [s * t for s in steps],
                               [loss(b, s * t) for s in steps])}
               for b, t in ((16, 0.5), (32, 1.0), (64, 2.0))]
    rows, target, _ = sweep_rows(results, None)
    at = rows[0]["common_seconds"]
    assert at == pytest.approx(10.0)
    # at every logged time batch 16 is the lowest of the three
    for r in results[1:]:
        for t, loss in zip(r["curve"].seconds, r["curve"].losses):
            if t <= at:
                assert loss_at_seconds(results[0]["curve"], t) < loss
    verdict = sweep_verdict(rows)
    assert verdict["lowest_loss_at_equal_time"] == 16
    assert verdict["least_time_to_target"] == 32 and verdict["not_reaching_target"] == [16]
    text = format_verdict(verdict, target, rows)
    assert "lowest smoothed loss at equal wall time (10.0 s" in text and ": batch 16 (" in text
    assert "batch 16 did not reach it within them" in text and "smaller batches saw fewer samples" in text


def test_a_difference_within_the_measurement_noise_names_no_winner():
    """The issue's case: 16.5 s against 16.9 s, each step's time moving by up to 15% while measured."""
    import random

    from imgcls.commands.tune import format_verdict

    rng = random.Random(0)

    def jittery(batch, per_step, steps):
        seconds, t = [], 0.0
        for _ in range(steps):
            t += per_step * rng.uniform(0.85, 1.15)
            seconds.append(t)
        return Curve(batch, 1, batch, list(range(1, steps + 1)), [s * batch for s in range(1, steps + 1)], seconds,
                     [1.0 - 0.5 * s / steps for s in range(1, steps + 1)])

    rows = [{"effective_batch": b, "img_per_s": 1.0, "fits": True, "time_to_target_s": t,
             "time_to_target_noise_s": None} for b, t in ((64, 16.5), (128, 16.9))]
    for row, per_step in zip(rows, (0.165, 0.169)):
        curve_ = jittery(row["effective_batch"], per_step, 100)
        row["time_to_target_noise_s"] = time_to_target_noise(curve_, row["time_to_target_s"], per_step)
        # two standard errors of the mean step time (~0.09 / sqrt(98) x 2 of 16.5 s) plus one step (~0.17 s)
        assert 0.3 < row["time_to_target_noise_s"] < 0.8
    verdict = sweep_verdict(rows)
    assert verdict["within_noise"] == [64, 128]
    assert "batch 64 and 128 are within the measurement noise" in format_verdict(verdict, 0.5)
    steady = [dict(r, time_to_target_noise_s=0.17) for r in rows]
    assert sweep_verdict(steady)["within_noise"] == [64]
    assert "least time to loss 0.5: batch 64;" in format_verdict(sweep_verdict(steady), 0.5)


def test_knee_and_interpolation():
    assert throughput_knee({32: 90.0, 64: 97.0, 128: 100.0, 256: 99.0}) == 64
    c = Curve(8, 1, 8, [1, 2], [8, 16], [1.0, 2.0], [1.0, 0.5])
    assert loss_after_samples(c, 12) == pytest.approx(0.75)
    assert loss_after_samples(c, 17) is None


def test_attempts_keep_the_batch_and_add_checkpointing_only_when_asked():
    assert attempts_for(64, False, False)[:3] == [(64, 1, False), (32, 2, False), (16, 4, False)]
    assert attempts_for(64, False, True)[:3] == [(64, 1, False), (64, 1, True), (32, 2, False)]
    assert all(b * a == 48 for b, a, _ in attempts_for(48, False, False))


def synthetic_range_curve(lrs):
    """A loss that is flat at 2.3 for small LRs, falls steeply around LR 1e-2 and explodes above LR 1."""
    return [0.3 + 2.0 / (1 + (lr / 1e-2) ** 2) + (50 * (lr - 1) if lr > 1 else 0.0) for lr in lrs]


def test_lr_suggestion_lands_in_the_steep_part():
    lrs = exponential_lrs(1e-5, 10, 100)
    assert lrs[0] == pytest.approx(1e-5) and lrs[-1] == pytest.approx(10)
    found = lr_suggestion(lrs, smooth(synthetic_range_curve(lrs), beta=0.5))
    assert 3e-3 <= found["steepest_lr"] <= 3e-2   # the steepest fall in log(LR) is near 1e-2
    assert 1.0 < found["divergence_lr"] <= 10
    assert found["steepest_index"] < found["divergence_index"]


@pytest.mark.slow
def test_lr_range_identical_on_both_ranks(tmp_path):
    from tune_workers import lr_range_on_rank

    root = make_tree(tmp_path / "data", {"a": (8, 1), "b": (8, 1)}, size=(16, 16))
    overrides = tiny_overrides(root, tmp_path / "run", **{"train.batch_size": 4})
    torch.multiprocessing.spawn(lr_range_on_rank, args=(2, str(tmp_path / "store"), overrides, str(tmp_path)),
                                nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    assert ranks[0]["lrs"] == pytest.approx(exponential_lrs(1e-3, 10.0, 6)[:len(ranks[0]["lrs"])])
    assert all(math.isfinite(v) for v in ranks[0]["losses"])
    assert not (tmp_path / "run").exists()


def sweep_losses(cfg):
    ctx = Runtime(torch.device("cpu"), None, DistInfo())
    memory = MemoryCheck(cfg, ctx, 3, None, 4)
    entries = sweep_batch_sizes(cfg, ctx, [4, 8], steps=4, warmup=1, log_every=1, memory=memory,
                                try_checkpointing=False)
    return [(e.size, e.run.curve.samples, e.run.curve.losses) for e in entries]


def test_sweep_losses_reproducible_per_seed(tmp_path):
    root = make_tree(tmp_path / "data", {"a": (8, 1), "b": (8, 1), "c": (8, 1)}, size=(16, 16))
    cfg = load_config("base", tiny_overrides(root, tmp_path / "run"))
    first, second = sweep_losses(cfg), sweep_losses(cfg)
    assert first == second
    assert [samples for _, samples, _ in first] == [[4, 8, 12, 16], [8, 16, 24, 32]]
    assert first[0][2] != first[1][2]
    assert not (tmp_path / "run").exists()  # tune writes no run directory


def test_unreachable_target_is_an_error_after_the_table(tmp_path, capsys):
    from imgcls.commands.tune import run_sweep

    root = make_tree(tmp_path / "data", {"a": (8, 1), "b": (8, 1)}, size=(16, 16))
    cfg = load_config("base", tiny_overrides(root, tmp_path / "run"))
    args = Namespace(steps=2, warmup_steps=0, target_loss=1e-9, checkpointing=False, json=None, plot=None)
    with pytest.raises(ConfigError, match="no batch size reached it"):
        run_sweep(cfg, args, [4])
    assert "verdict" in capsys.readouterr().out


def test_lr_range_test_says_how_long_it_will_take(tmp_path, capsys):
    from imgcls.commands.tune import LrEstimateOnce, run_lr_test

    estimate = LrEstimateOnce(Runtime(torch.device("cpu"), None, DistInfo()), steps=11)
    for step, seconds in ((1, 2.0), (2, 2.5), (3, 3.0), (4, 3.5)):
        estimate(step, seconds)
    # the first step (start-up) as it was, the other 10 at the 0.5 s the next ones took; said once
    assert capsys.readouterr().err.count("LR range test: about 7 s in all") == 1

    root = make_tree(tmp_path / "data", {"a": (8, 1), "b": (8, 1)}, size=(16, 16))
    cfg = load_config("base", tiny_overrides(root, tmp_path / "run", **{"train.batch_size": 4}))
    args = Namespace(steps=5, json=None, plot=None)
    assert run_lr_test(cfg, args, (1e-3, 1.0)) == 0
    out, err = capsys.readouterr()
    assert "s in all (at most: it stops once the loss diverges; from the first 3 steps)" in err


def test_tune_computes_with_the_thread_count_train_py_would_take(tmp_path, tiny_tree):
    from imgcls.commands.tune import prepare

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        prepare(load_config("base", tiny_overrides(tiny_tree, tmp_path / "run", **{"train.threads": 1})))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_tune_py_end_to_end(tmp_path, tiny_tree):
    result = run_script("tune.py", "--config", "base", *tiny_overrides(tiny_tree, tmp_path / "run"),
                        "--batch-sizes", "4,8", "--steps", "12", "--json", str(tmp_path / "t.json"),  # 4: no learning yet
                        "--plot", str(tmp_path / "t.png"),
                        env={"MPLCONFIGDIR": str(tmp_path / "mpl")})  # no font cache: matplotlib builds one
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads((tmp_path / "t.json").read_text())
    assert [r["effective_batch"] for r in doc["rows"]] == [4, 8]
    assert doc["verdict"]["least_time_to_target"] in (4, 8)
    assert doc["memory_breakdown"]["parameters_mb"] > 0
    assert "verdict:" in result.stdout and "s in all" in result.stderr
    assert "fontManager" not in result.stderr + result.stdout
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("args,words", [
    (["--batch-sizes", "64,-8"], "'-8' is not a positive integer"),
    (["--batch-sizes", "64,abc"], "'abc' is not a positive integer"),
    (["--lr-range", "1,1e-3"], "0 < LOW < HIGH"),
    (["--lr-range", "1e-3"], "0 < LOW < HIGH"),
    (["--target-loss", "-1"], "must be a positive number"),
    (["--batch-sizes", "100000"], "larger than the training split"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, tiny_tree, args, words):
    result = run_script("tune.py", "--config", "base", *tiny_overrides(tiny_tree, tmp_path / "run"), *args)
    assert result.returncode == 2, result.stderr[-2000:]
    said = [line for line in result.stderr.strip().splitlines() if not line.endswith("(loading torch...)")]
    assert words in result.stderr and len(said) == 1  # the error, besides the first line found after the parse


@pytest.mark.slow
def test_refuses_to_write_into_a_run_directory(tmp_path, tiny_tree):
    run_dir = tmp_path / "old_run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("{}\n")
    result = run_script("tune.py", "--config", "base", *tiny_overrides(tiny_tree, tmp_path / "run"),
                        "--json", str(run_dir / "tune.json"))
    assert result.returncode == 2 and "run directory" in result.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]


@pytest.mark.slow
def test_tune_sweeps_small_batches_whose_memory_probe_would_be_one_sample(tiny_tree, tmp_path, capsys):
    """`--batch-sizes 2,4` probed memory at batch 1 and died in BatchNorm ('Expected more than 1 value per
    channel'), exit 1, no table."""
    from imgcls.commands.tune import run_sweep

    cfg = load_config("base", tiny_overrides(tiny_tree, tmp_path / "run"))
    out = tmp_path / "t.json"
    args = Namespace(steps=2, warmup_steps=0, target_loss=None, checkpointing=False, json=str(out), plot=None)
    assert run_sweep(cfg, args, [2, 4]) == 0
    assert [row["effective_batch"] for row in json.loads(out.read_text())["rows"]] == [2, 4]
    assert "verdict" in capsys.readouterr().out


def test_tune_refuses_a_one_image_batch_that_batchnorm_cannot_train_on():
    from imgcls.commands.tune import check_sizes

    with pytest.raises(ConfigError, match="--batch-sizes: 1 is one image per process, and BatchNorm cannot train"):
        check_sizes([1, 2], 24, 1)
    with pytest.raises(ConfigError, match="--batch-sizes: 2 is one image per process"):
        check_sizes([2, 4], 24, 2)
    check_sizes([1, 2], 24, 1, norm="group")


def test_tune_refuses_warmup_at_least_as_long_as_the_steps():
    from imgcls.cli.tune import check_arguments

    base = dict(batch_sizes=None, target_loss=None, lr_range=None, checkpointing=False, json=None, plot=None)
    with pytest.raises(ConfigError, match="--warmup-steps 100 is not below --steps 2"):
        check_arguments(Namespace(steps=2, warmup_steps=100, **base))
    with pytest.raises(ConfigError, match="--warmup-steps 100 is not below --steps 100"):
        check_arguments(Namespace(steps=None, warmup_steps=100, **base))
    check_arguments(Namespace(steps=4, warmup_steps=3, **base))


@pytest.mark.slow
def test_tune_on_sigterm_writes_the_table_and_json_of_the_sizes_so_far(tiny_tree, tmp_path):
    out, err = tmp_path / "t.json", tmp_path / "stderr.txt"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, str(REPO / "tune.py"), "--config", "base",
                                 *tiny_overrides(tiny_tree, tmp_path / "run"), "--batch-sizes", "4,8",
                                 "--steps", "400", "--json", str(out)], cwd=REPO, stdout=subprocess.PIPE,
                                stderr=stderr, text=True, start_new_session=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
        wait_for(proc, lambda: "s in all" in err.read_text(), "the sweep's first points")
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, err.read_text()[-2000:]
    assert "verdict" in stdout and "(interrupted: the sizes so far)" in stdout
    doc = json.loads(out.read_text())
    assert doc["interrupted"] is True and [row["effective_batch"] for row in doc["rows"]] == [4]


def test_a_sweep_whose_loss_climbs_or_stays_above_chance_ranks_nothing():
    """Issue 64: a recipe whose smoothed loss climbed from 6.4 to 9-11 (chance for 7 classes: 1.95) still got
    `least time to loss 6.217: batch 16`. Curves that rise, or never fall below ln C, are named and ranked
    nowhere; when no size learned, the verdict says so and names no batch."""
    from imgcls.commands.tune import format_verdict

    chance = math.log(7)
    climbing = {16: [6.4, 6.2, 7.5, 9.0, 10.5], 32: [6.4, 6.3, 6.8, 8.1, 9.2]}
    results = [{"size": b, "how": "as is", "fits": True, "curve": curve(b, losses, 0.1 * b / 16),
                "img_per_s": 160.0, "seconds_per_step": 0.1 * b / 16, "peak_memory_mb": 1.0}
               for b, losses in climbing.items()]
    rows, target, _ = sweep_rows(results, None, chance)
    assert target is None and all(r["steps_to_target"] is None for r in rows)
    assert rows[0]["not_learning"] == "the smoothed loss rose from 6.4 to 10.5"
    verdict = sweep_verdict(rows)
    assert verdict["not_learning"] == [16, 32] and verdict["least_time_to_target"] is None
    assert verdict["lowest_loss_at_equal_time"] is None and verdict["within_noise"] == []
    text = format_verdict(verdict, target, rows)
    assert text.startswith("verdict: no batch size learned") and "nothing is ranked" in text
    assert "least time" not in text and "lowest smoothed loss" not in text

    # flat above chance, and one size that learns: only the learner is compared, the other is named
    results[1]["curve"] = curve(32, [2.3, 2.2, 2.1, 2.05, 2.0], 0.2)
    results.append({"size": 64, "how": "as is", "fits": True, "curve": curve(64, [2.0, 1.7, 1.4, 1.2, 1.0], 0.4),
                    "img_per_s": 160.0, "seconds_per_step": 0.4, "peak_memory_mb": 1.0})
    rows, target, _ = sweep_rows(results, None, chance)
    assert "stayed above chance (2, chance 1.946)" in rows[1]["not_learning"]
    assert target == 1.0 and sweep_verdict(rows)["least_time_to_target"] == 64
    text = format_verdict(sweep_verdict(rows), target, rows)
    assert "did not learn: batch 16: the smoothed loss rose" in text and "batch 32: the smoothed loss stayed" in text
    assert learning_failure([1.0, float("nan")], None) == "the loss became non-finite"
    assert learning_failure([2.0, 1.0], None, diverged=True) == "the loss became non-finite"
    assert learning_failure([2.0, 1.9], None) is None and learning_failure([2.0, 1.9], 1.5) is not None


def test_a_real_sweep_at_a_diverging_lr_says_so(tmp_path, capsys):
    """The same at tune.py's level: a huge LR on real images, two batch sizes, a few steps."""
    from imgcls.commands.tune import run_sweep

    root = make_tree(tmp_path / "data", {"a": (8, 1), "b": (8, 1), "c": (8, 1)}, size=(16, 16))
    cfg = load_config("base", tiny_overrides(root, tmp_path / "run", **{"optim.lr": 50.0, "train.nonfinite": "skip"}))
    assert chance_loss(cfg, 3) == pytest.approx(math.log(3))
    args = Namespace(steps=6, warmup_steps=1, target_loss=None, checkpointing=False, json=str(tmp_path / "t.json"),
                     plot=None)
    assert run_sweep(cfg, args, [4, 8]) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["verdict"]["not_learning"] == [4, 8], doc["rows"]
    assert "verdict: no batch size learned" in out and "least time" not in out
