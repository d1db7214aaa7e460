"""train.threads (the CPU thread policy) and train.val_interval (validation every N epochs)."""
import csv
import json
import logging

import pytest
import torch
from conftest import make_tree, tiny_overrides

import imgcls.compute.cpu_tuning as cpu_tuning
from imgcls.compute.cpu_tuning import SHORT_OMP_SPIN, choose_omp_wait, choose_threads, omp_wait_for
from imgcls.config import load_config
from imgcls.core.host import busy_cores_of_others, cpu_jiffies
from imgcls.training.schedule import validation_due
from imgcls.training.trainer import open_trainer, run


@pytest.mark.parametrize("setting, cpus, env, busy, saved, expected", [
    ("auto", 2, {}, None, None, 2),                       # every usable core
    ("auto", 2, {}, 1.0, None, 2),                        # whatever the load: the same numbers beside it
    ("auto", 16, {}, 3.6, None, 16),
    ("idle_cores", 2, {}, None, None, 2),                 # load unknown (not probed): every usable core
    ("idle_cores", 2, {}, 0.3, None, 2),                  # idle enough: every usable core
    ("idle_cores", 2, {}, 1.0, None, 1),                  # one core busy: the free one
    ("idle_cores", 16, {}, 3.6, None, 12),                # rounded
    ("idle_cores", 2, {}, 2.0, None, 1),                  # every core busy: still one thread
    ("auto", 8, {"OMP_NUM_THREADS": "3"}, 6.0, 4, 3),     # torchrun (or the user) set it: kept
    ("auto", 8, {"OMP_NUM_THREADS": ""}, None, None, 8),  # empty: ignored
    ("idle_cores", 4, {}, 3.0, 2, 2),                     # a checkpoint's count wins over the load
    ("auto", 4, {}, None, 10_000, 4),                     # but never more than the machine has
    ("auto", 4, {}, None, "2", 4),                        # and only a positive int counts
    (5, 2, {"OMP_NUM_THREADS": "1"}, 1.0, 2, 5),          # an explicit train.threads wins over everything
])
def test_thread_choice(setting, cpus, env, busy, saved, expected):
    threads, source = choose_threads(setting, cpus, env, busy, saved)
    assert threads == expected and source


@pytest.mark.slow
def test_the_run_applies_and_logs_its_thread_count(tmp_path, tiny_tree, monkeypatch, trainer_of):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    cfg = load_config("base", tiny_overrides(tiny_tree, tmp_path / "run", **{"train.threads": 1}))
    try:
        trainer_of(cfg)
        assert torch.get_num_threads() == 1
        assert "1 CPU thread(s) (train.threads; " in (tmp_path / "run" / "train.log").read_text()
    finally:
        torch.set_num_threads(before)


def test_auto_precision_takes_bf16_on_cpus_with_amx_only():
    from imgcls.compute.device import bf16_is_fast

    flags = "flags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 avx512_fp16"
    assert not bf16_is_fast(flags)                          # AVX512-BF16 alone: fp32 measured faster
    assert bf16_is_fast(flags + " amx_bf16 amx_tile amx_int8")
    assert not bf16_is_fast("flags\t\t: fpu sse2 avx2")


AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n"


def test_bf16_is_emulated_on_cpus_without_avx512_bf16_amx_or_arm_bf16():
    from imgcls.compute.device import bf16_emulated

    assert "neither AVX512-BF16 nor AMX" in bf16_emulated(AVX2_ONLY)
    assert bf16_emulated("flags\t\t: fpu avx2 avx512f avx512_bf16") is None
    assert bf16_emulated("flags\t\t: fpu avx2 amx_bf16 amx_tile") is None
    assert bf16_emulated("Features\t: fp asimd sve bf16 i8mm") is None
    assert "emulates" in bf16_emulated("Features\t: fp asimd")
    assert bf16_emulated("") is None  # unknown (no /proc/cpuinfo): no claim


def test_a_onednn_isa_cap_below_bf16_counts_as_emulated():
    """ONEDNN_MAX_CPU_ISA=AVX2 (how an AVX2-only CPU is reproduced on a newer one) makes oneDNN emulate bf16
    whatever the flags say: the warning and the inference commands' fp32 follow the cap, and amp=auto keeps
    fp32 even on AMX."""
    from imgcls.compute.device import bf16_emulated, bf16_is_fast

    amx = "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile"
    assert bf16_emulated(amx, {}) is None and bf16_is_fast(amx, {})
    for cap in ("AVX2", "avx512_core", "AVX512_CORE_VNNI"):
        assert "ONEDNN_MAX_CPU_ISA" in bf16_emulated(amx, {"ONEDNN_MAX_CPU_ISA": cap})
        assert not bf16_is_fast(amx, {"ONEDNN_MAX_CPU_ISA": cap})
    assert "ONEDNN_MAX_CPU_ISA" in bf16_emulated(amx, {"DNNL_MAX_CPU_ISA": "avx2"})
    assert bf16_emulated(amx, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}) is None
    assert not bf16_is_fast(amx, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"})  # no tiles under that cap
    assert bf16_is_fast(amx, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}) and bf16_is_fast(amx, {"ONEDNN_MAX_CPU_ISA": "ALL"})


@pytest.fixture
def emulating_cpu(monkeypatch):
    import imgcls.compute.device as device

    reason = device.bf16_emulated(AVX2_ONLY)
    monkeypatch.setattr(device, "cpu_bf16_emulated", lambda: reason)
    monkeypatch.setattr(device, "_BF16_WARNINGS", {"said": set(), "pending": []})
    yield reason


def test_bf16_chosen_on_an_emulating_cpu_is_warned_once_with_the_reason(emulating_cpu, caplog):
    from imgcls.compute.device import resolve_amp

    with caplog.at_level(logging.WARNING, logger="imgcls.compute.device"):
        assert resolve_amp("bf16", torch.device("cpu")) == torch.bfloat16  # as asked, but said
        assert resolve_amp("bf16", torch.device("cpu")) == torch.bfloat16
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and emulating_cpu in warnings[0], warnings


def test_inference_runs_a_bf16_checkpoint_in_fp32_where_bf16_is_emulated_unless_amp_says(emulating_cpu):
    from types import SimpleNamespace

    from imgcls.compute.device import inference_amp
    from imgcls.model_files.predictor import prediction_runtime

    cpu = torch.device("cpu")
    assert inference_amp("bf16", cpu) == "none" and inference_amp("fp16", cpu) == "auto"
    assert inference_amp("none", cpu) == "none"
    loaded = SimpleNamespace(cfg=load_config("base", ["train.amp=bf16"]), fp32_only=False, threads=None)
    before = torch.get_num_threads()
    try:
        assert prediction_runtime(loaded, "cpu", None).amp_dtype is None
        assert prediction_runtime(loaded, "cpu", "bf16").amp_dtype == torch.bfloat16
    finally:
        torch.set_num_threads(before)


def test_inference_keeps_a_bf16_checkpoint_where_the_cpu_runs_bf16(monkeypatch):
    import imgcls.compute.device as device

    monkeypatch.setattr(device, "cpu_bf16_emulated", lambda: None)
    assert device.inference_amp("bf16", torch.device("cpu")) == "bf16"


def test_threads_must_be_positive_or_auto():
    with pytest.raises(Exception, match="train.threads"):
        load_config("base", ["train.threads=0"])
    with pytest.raises(Exception, match="train.threads"):
        load_config("base", ["train.threads=many"])
    assert load_config("base", ["train.threads=idle_cores"]).train.threads == "idle_cores"


def test_usable_cores_are_capped_by_a_cgroup_quota(tmp_path):
    from imgcls.core.host import cgroup_cpu_quota

    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path) == 2.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(tmp_path) is None


def test_validation_due_every_interval_and_after_the_last_epoch():
    assert [e for e in range(1, 8) if validation_due(e, 7, 3)] == [3, 6, 7]
    assert [e for e in range(1, 4) if validation_due(e, 3, 1)] == [1, 2, 3]


@pytest.mark.slow
def test_val_interval_validates_every_nth_epoch_and_early_stopping_counts_validations(tmp_path):
    data = make_tree(tmp_path / "data", {"a": (8, 3), "b": (8, 3)})
    out = tmp_path / "run"
    # lr 0 never improves after the first validation: patience 1 stops at the second validation (epoch 4)
    cfg = load_config("base", tiny_overrides(data, out, **{"train.epochs": 6, "train.val_interval": 2,
                                                          "optim.lr": 1e-12, "schedule.warmup_epochs": 0,
                                                          "early_stop.patience": 1, "early_stop.min_delta": 100}))
    assert run(cfg) == 0
    with (out / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows] == ["1", "2", "3", "4"]
    assert [bool(r["val_top1"]) for r in rows] == [False, True, False, True]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["best_epoch"] == 2 and summary["stopped_early"] and summary["epochs_completed"] == 4
    assert torch.load(out / "best.pt", weights_only=True)["epoch"] == 2


def test_openmp_threads_sleep_soon_only_beside_busy_processes():
    short = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": SHORT_OMP_SPIN}
    assert omp_wait_for(0.1).env == {}                      # idle cores: OpenMP's own spin
    busy = omp_wait_for(1.0)
    assert busy.env == short and "1.0 core(s) busy" in busy.reason
    assert omp_wait_for(None).env == short                  # unknown load: the choice that never collapses
    env = {}
    assert choose_omp_wait(env, probe=lambda: 2.0).env == short and env == short
    env = {}
    choose_omp_wait(env, probe=lambda: 0.0)
    assert env == {}


def test_a_users_openmp_wait_stays_and_one_thread_needs_no_probe():
    def probe():
        raise AssertionError("the load was probed")

    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}):
        env = dict(chosen)
        choice = choose_omp_wait(env, probe=lambda: 1.0)    # still probed: `auto` threads follow the load
        assert env == chosen and choice.env == {} and "=" in choice.reason and choice.busy_cores == 1.0
    env = {"OMP_NUM_THREADS": "1"}
    choice = choose_omp_wait(env, probe=probe)
    assert choice.env == {} and choice.busy_cores is None and env == {"OMP_NUM_THREADS": "1"}


def test_cpu_ticks_are_summed_over_the_usable_cores_only():
    stat = ("cpu  30 0 30 300 10 0 0 0 0 0\n"
            "cpu0 10 0 10 100 5 0 0 0 0 0\n"
            "cpu1 20 0 20 200 5 0 0 3 0 0\n"
            "\n"
            "cpu2 1 2\n"
            "intr 12345\n")
    assert cpu_jiffies(stat, {1}) == (43, 248)              # user + system + steal; idle and iowait are not busy
    assert cpu_jiffies(stat, {0, 1}) == (63, 373)
    assert cpu_jiffies(stat, {7}) is None
    assert cpu_jiffies(stat, {2}) is None                   # a short line is not read


@pytest.mark.env_sensitive
@pytest.mark.slow
def test_a_busy_process_beside_us_is_seen():
    import subprocess
    import sys
    import time

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert busy_cores_of_others(0.3) >= 0.5
    finally:
        spinner.kill()
        spinner.wait()


@pytest.mark.slow
def test_entry_scripts_choose_the_wait_before_torch_loads(tmp_path):
    import subprocess
    import sys

    from conftest import REPO

    probe = ("import os, sys; sys.argv = ['train.py', '--help']; from imgcls.cli import run_main; "
             "from imgcls.compute import cpu_tuning; import train; real = train.main; seen = []; "
             "train.main = lambda: seen.append(cpu_tuning.process_start()) or real(); "
             "import atexit; atexit.register(lambda: print('chosen', seen[0] is not None, "
             "os.environ.get('GOMP_SPINCOUNT') in (None, cpu_tuning.SHORT_OMP_SPIN), 'torch' in sys.modules)); "
             "run_main(train.main)")
    env = {k: v for k, v in __import__('os').environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, env=env).stdout
    assert "chosen True True False" in out


@pytest.mark.slow
def test_idle_cores_follow_the_start_load_auto_does_not_and_a_resume_keeps_its_count(tmp_path, tiny_tree, trainer_of,
                                                                                     monkeypatch):
    """`idle_cores`: a fresh run beside one busy process (of 2 cores) takes one thread; `auto` takes both
    whatever the load. A run that started with two keeps both on resume though the load changed (sums over
    another thread count round differently: no bitwise resume otherwise); eval.py and infer.py take the
    checkpoint's count too."""
    from imgcls.compute.cpu_tuning import OmpWaitChoice, apply_cpu_policy

    def start_load(busy):
        """What the process start measured (`cpu_tuning.tune_process_start`)."""
        monkeypatch.setattr(cpu_tuning, "_process_start", OmpWaitChoice({}, "test", busy))

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_tuning, "usable_cpus", lambda: 2)
    before = torch.get_num_threads()
    try:
        busy_run = tmp_path / "busy"
        start_load(1.0)
        trainer_of(load_config("base", tiny_overrides(tiny_tree, busy_run, **{"train.threads": "idle_cores"})))
        assert torch.get_num_threads() == 1
        assert "1 CPU thread(s) (idle_cores: 2 usable core(s), 1.0 kept busy" in (busy_run / "train.log").read_text()
        auto_run = tmp_path / "auto"
        trainer_of(load_config("base", tiny_overrides(tiny_tree, auto_run)))
        assert torch.get_num_threads() == 2
        assert "2 CPU thread(s) (auto: 2 usable core(s); test;" in (auto_run / "train.log").read_text()

        out = tmp_path / "run"
        start_load(0.0)
        assert run(load_config("base", tiny_overrides(tiny_tree, out, **{"train.epochs": 1}))) == 0
        assert torch.load(out / "last.pt", weights_only=True)["threads"] == 2

        resumed = load_config("base", tiny_overrides(tiny_tree, out, **{"train.epochs": 1, "train.threads": "idle_cores"}))
        start_load(1.0)
        with open_trainer(resumed, resume=str(out / "last.pt")):
            pass
        assert torch.get_num_threads() == 2
        assert "2 CPU thread(s) (idle_cores: the checkpoint's run used 2" in (out / "train.log").read_text()
        assert apply_cpu_policy("idle_cores", saved_threads=2)[0] == 2 == torch.get_num_threads()
        assert apply_cpu_policy("idle_cores", saved_threads=None)[0] == 1
        assert "not bitwise" not in (out / "train.log").read_text()
        monkeypatch.setenv("OMP_NUM_THREADS", "1")   # the environment wins: the resume says what it costs
        with open_trainer(load_config("base", tiny_overrides(tiny_tree, out, **{"train.epochs": 1})),
                          resume=str(out / "last.pt")):
            pass
        assert torch.get_num_threads() == 1
        assert ("resuming with 1 CPU thread(s) where the checkpoint's run used 2 (OMP_NUM_THREADS): the run goes "
                "on, but not bitwise equal") in (out / "train.log").read_text()
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_two_fresh_runs_one_beside_a_busy_process_give_bitwise_equal_weights(tmp_path):
    """Reproducible by default: `train.threads=auto` is the usable cores whatever else runs, so the same seed
    and config give the same model on an idle machine and beside a busy process."""
    import subprocess
    import sys
    import time

    from conftest import run_script

    data = make_tree(tmp_path / "data", {"a": (8, 3), "b": (8, 3)})
    env = {"OMP_NUM_THREADS": ""}  # run_script pins one thread; the default policy decides here
    weights = {}
    for name in ("idle", "busy"):
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if name == "busy" else None
        try:
            if spinner is not None:
                time.sleep(0.3)
            out = tmp_path / name
            result = run_script("train.py", "--config", "base",
                                *tiny_overrides(data, out, **{"train.epochs": 1, "output.log_interval": 100}), env=env)
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
        assert result.returncode == 0, result.stderr[-2000:]
        log = (out / "train.log").read_text()
        assert "CPU thread(s) (auto: " in log
        weights[name] = torch.load(out / "last.pt", weights_only=True)["model"]
    assert weights["idle"].keys() == weights["busy"].keys()
    assert all(torch.equal(weights["idle"][k], weights["busy"][k]) for k in weights["idle"])


@pytest.mark.env_sensitive
@pytest.mark.slow
def test_freed_host_memory_is_reused_without_page_faults():
    import subprocess
    import sys

    from conftest import REPO

    # page faults over 10 training steps of a small conv net (after 3 warm-up steps), with and without
    probe = ("import resource, sys, torch; from imgcls.compute.cpu_tuning import keep_freed_memory; "
             "kept = keep_freed_memory() if sys.argv[1] == 'keep' else None; torch.manual_seed(0); "
             "net = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), "
             "torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.BatchNorm2d(64), torch.nn.ReLU()); "
             "x = torch.randn(16, 3, 64, 64); step = lambda: net(x).square().mean().backward(); [step() for _ in range(3)]; "
             "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; [step() for _ in range(10)]; "
             "print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)")
    # the fewest of three processes per mode: a kept heap still faults in a 16-48 MB chunk now and then (AMD
    # EPYC: 1 to 12287 faults a process, against 61000-90000 without), and one such outlier is not the policy
    results = {}
    for mode in ("keep", "default"):
        runs = []
        for _ in range(3):
            out = subprocess.run([sys.executable, "-c", probe, mode], cwd=REPO, capture_output=True, text=True,
                                 env={**__import__("os").environ, "OMP_NUM_THREADS": "1"}).stdout
            kept, faults = out.split()
            runs.append(int(faults))
        results[mode] = (kept, min(runs))
    assert results["keep"][0] == "True"
    # malloc's default maps each large activation afresh and the kernel zeroes its pages on first touch
    assert results["keep"][1] * 5 < results["default"][1], results


def test_the_start_up_line_says_how_threads_wait_and_memory_is_kept():
    from imgcls.compute.cpu_tuning import apply_cpu_policy

    threads, description = apply_cpu_policy(1, reuse_host_memory=False)
    assert threads == 1 and description.startswith("train.threads; ") and description.endswith("malloc's defaults")


# ---------------------------------------------------------------- per-epoch and per-sample overheads

@pytest.mark.slow
def test_the_next_epochs_batches_load_during_validation_and_train_the_same_weights(tmp_path):
    """The workers start on epoch e+1 before epoch e validates and saves: the sampler is already at e+1 in
    every validation but the last. Persistent validation workers are forked once, before the first
    training step (while the heap is small: no copy-on-write of the training's memory), and load each
    validation's batches ahead; other loaders start at the validation. The weights equal those of
    loading in the main process on demand."""
    def worker_pids(batches):
        return None if batches is None else tuple(w.pid for w in getattr(batches, "_workers", []))

    data = make_tree(tmp_path / "data", {"a": (12, 3), "b": (12, 3)})
    weights, seen = {}, {}
    for workers, persistent in ((2, True), (0, True), (2, False)):
        out = tmp_path / f"run{workers}{persistent}"
        with open_trainer(load_config("base", tiny_overrides(data, out, **{
                "train.epochs": 3, "data.num_workers": workers, "data.persistent_workers": persistent}))) as trainer:
            real_validate, real_train_epoch = trainer.validate, trainer.train_epoch
            calls = seen[workers, persistent] = []

            def train_epoch(*args, trainer=trainer, calls=calls, real=real_train_epoch, **kwargs):
                if not calls:
                    calls.append(("start", worker_pids(trainer.val_batches)))
                return real(*args, **kwargs)

            def validate(trainer=trainer, calls=calls, real=real_validate):
                calls.append((trainer.run.data.sampler.epoch, worker_pids(trainer.val_batches)))
                return real()

            trainer.validate, trainer.train_epoch = validate, train_epoch
            assert trainer.fit() == 0
        weights[workers, persistent] = torch.load(out / "last.pt", weights_only=True)["model"]
    # validating epoch k (1-based) with the sampler at k (0-based: the next epoch); the last has no next one
    pids = seen[2, True][0][1]
    assert len(pids) == 2 and seen[2, True] == [("start", pids), (1, pids), (2, pids), (2, pids)]
    assert seen[0, True] == seen[2, False] == [("start", None), (1, None), (2, None), (2, None)]
    reference = weights[0, True]
    for other in (weights[2, True], weights[2, False]):
        assert other.keys() == reference.keys() and all(torch.equal(other[k], reference[k]) for k in reference)


def test_all_finite_is_exact_also_where_a_sum_overflows():
    from imgcls.training.checkpoints import all_finite

    ok = [torch.ones(3), torch.zeros(2, 2)]
    assert all_finite(ok)
    assert not all_finite(ok + [torch.tensor([1.0, float("nan")])])
    assert not all_finite(ok + [torch.tensor([float("inf"), -float("inf")])])  # a sum of NaN, not inf
    assert not all_finite([torch.tensor([float("-inf")])])
    assert all_finite(ok + [torch.full((4,), 3e38)])  # the sum overflows; every element is finite
    assert all_finite([torch.full((4,), 60000.0, dtype=torch.float16)])


@pytest.mark.parametrize("ext", [".png", ".jpg"])
def test_each_image_file_is_opened_once(tmp_path, monkeypatch, ext):
    import builtins

    import imgcls.data.transforms as transforms
    from imgcls.data.images import load_rgb
    from imgcls.data.transforms import EvalTransform, TrainTransform

    root = make_tree(tmp_path / "data", {"a": (2, 0)}, splits=("train",), size=(40, 30), ext=ext)
    path = str(sorted((root / "train" / "a").iterdir())[0])
    opened = []

    def counting_open(file, *args, **kwargs):
        opened.append(file)
        return builtins.open(file, *args, **kwargs)

    monkeypatch.setattr(transforms, "open", counting_open, raising=False)
    train = TrainTransform(16, (0.5, 1.0), (0.75, 1.33), 0.5, 0.0, "bilinear")
    evaluate = EvalTransform(16, 0.875, "bilinear")
    image = evaluate(path)
    train(path, seed=3)
    assert opened == [path, path]
    monkeypatch.undo()
    if ext == ".png":  # the same pixels as PIL's own open of the path
        assert torch.equal(image, evaluate.from_image(load_rgb(path)))


def test_starting_a_loaders_batches_leaves_the_global_rng_alone():
    """The batches start before a save (the next epoch's) or after one: either way the RNG state a resumed run
    restores must not depend on it, so no loader draws its workers' base seed from the global generator."""
    from torch.utils.data import IterableDataset

    from imgcls.data.loaders import (TrainSampler, build_eval_loader, build_stream_eval_loader,
                                     build_stream_train_loader, build_train_loader)

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    items = list(range(8))
    loaders = [build_stream_train_loader(Stream(), 2, 0, False, 2), build_stream_eval_loader(Stream(), 2, 0, False),
               build_eval_loader(items, 2, 0, False),
               build_train_loader(items, TrainSampler([0, 1] * 4, "random", 0, 2), 2, 0, False, False, 2, seed=0)]
    for loader in loaders:
        before = torch.get_rng_state()
        iter(loader)
        assert torch.equal(torch.get_rng_state(), before), type(loader.dataset).__name__


@pytest.mark.parametrize("optimizer, nonfinite, checked", [
    ("sgd", "stop", False), ("adamw", "stop", False), ("sgd", "skip", True), ("lion", "stop", True)])
def test_which_steps_check_their_gradients(optimizer, nonfinite, checked):
    """Under stop the next loss shows a non-finite update, except with lion: it steps by the sign of its
    update (sign(nan) = 0), so a non-finite gradient leaves the weights finite and poisons only its state."""
    from timm.optim import create_optimizer_v2

    from imgcls.compute.device import DeviceInput
    from imgcls.models.factory import build_model
    from imgcls.training.step import build_train_step

    cfg = load_config("base", [f"optim.name={optimizer}", f"train.nonfinite={nonfinite}", "train.amp=none",
                               "model.name=test_resnet"])
    model = build_model(cfg.model, 2)
    step = build_train_step(cfg, model, DeviceInput.from_config(cfg, torch.device("cpu"), None), 0.1)
    assert step.checks_gradients == checked
    if optimizer == "lion":
        weights = torch.nn.Parameter(torch.ones(4))
        lion = create_optimizer_v2([weights], "lion", lr=0.1)
        weights.grad = torch.tensor([1.0, float("nan"), float("inf"), 1.0])
        lion.step()
        assert torch.isfinite(weights).all() and not torch.isfinite(lion.state[weights]["exp_avg"]).all()


@pytest.mark.slow
def test_train_py_warns_of_emulated_bf16_in_train_log(tmp_path):
    """The precision is chosen before train.log exists: the WARNING still reaches it (and the console), once."""
    from conftest import run_script

    data = make_tree(tmp_path / "data", {"a": 6, "b": 6})
    result = run_script("train.py", "--config", "base",
                        *tiny_overrides(data, tmp_path / "run", **{"train.epochs": 1, "train.amp": "bf16"}),
                        env={"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert result.returncode == 0, result.stderr[-2000:]
    said = [line for line in (tmp_path / "run" / "train.log").read_text().splitlines() if "emulates it" in line]
    assert len(said) == 1 and " WARNING " in said[0] and "ONEDNN_MAX_CPU_ISA=AVX2" in said[0], said
    assert result.stderr.count("emulates it") == 1
