"""Our distillation against timm's own (`train.py --kd-model-name local-dir:...`): the same class-folder data,
the same teacher (our best.pt, exported with `export.py --format timm` for timm), the same student and the
same recipe, mapped from our resolved config onto timm's flags (settings timm's train.py cannot express are
refused, naming the key). Runs alternate (ours, timm, ours, timm, ...), one at a time; each row has the best
and last-epoch validation top-1, the whole-process wall time and the 1-minute load average before and after.
timm's train.py is not part of this repository and not copied into it: pass the path of a copy.

python -m imgcls.benchmarking.kd_compare --timm-train /tmp/timm_kd/train.py --teacher runs/teacher/best.pt \
    --data datasets/digits --out /tmp/kdcmp [--config quickstart] [--seeds 0,1,2] \
    [--timm-env 'OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=1000'] [KEY=VALUE ...]

The KEY=VALUE overrides (e.g. model.name=resnet10t train.epochs=6) apply to our run and, through the
mapping, to timm's. --timm-env adds a third run each seed: timm's train.py with those environment variables
(e.g. the OpenMP wait our train.py sets for itself on a busy machine, docs/performance.md). Writes
OUT/results.json and prints a Markdown table.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]

# Our keys whose non-default values have no counterpart in the mapping below (value: the default it must keep).
UNMAPPED_DEFAULTS = {
    "data.auto_augment": None, "data.random_erasing": 0.0, "data.repeated_augment": 1, "data.eval_img_size": None,
    "data.sampler": "random", "data.task": "multiclass", "train.accum_steps": 1, "train.mixup_alpha": 0.0,
    "train.cutmix_alpha": 0.0, "train.clip_grad_norm": None, "train.loss": "ce", "model.ema_decay": None,
    "model.freeze": None, "model.norm": "batch", "optim.layer_decay": None, "optim.head_lr_scale": 1.0,
    "schedule.name": "cosine", "schedule.warmup_start_factor": 0.0, "distill.type": "soft",
}


class UnmappedSetting(ValueError):
    """A setting of ours that timm's train.py flags cannot reproduce; the message names the key."""


def setting(cfg, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def timm_flags(cfg, num_classes: int, teacher_dir: Path, amp_bf16: bool, device: str) -> list[str]:
    """timm train.py flags for the recipe `cfg` describes: our `train.epochs` include the warmup and the
    cosine decays per optimizer step over the rest, which is timm's `--warmup-prefix --sched-on-updates` with
    `--epochs` = ours minus the warmup; our peak LR (after batch scaling) is timm's `--lr`."""
    for key, default in UNMAPPED_DEFAULTS.items():
        if setting(cfg, key) != default:
            raise UnmappedSetting(f"'{key}' = {setting(cfg, key)!r}: timm's train.py flags here cannot express it "
                                  f"(only {default!r})")
    s, d, t, o = cfg.schedule, cfg.data, cfg.train, cfg.optim
    if s.warmup_epochs != int(s.warmup_epochs) or t.epochs <= s.warmup_epochs:
        raise UnmappedSetting(f"'schedule.warmup_epochs' = {s.warmup_epochs}: timm needs whole warmup epochs, "
                              f"fewer than 'train.epochs' ({t.epochs})")
    if o.name not in ("sgd", "adamw"):
        raise UnmappedSetting(f"'optim.name' = {o.name!r}: mapped are sgd and adamw")
    if o.name == "sgd" and not o.nesterov:
        raise UnmappedSetting("'optim.nesterov' = false: timm's 'sgd' is Nesterov SGD")
    from imgcls.training.schedule import scaled_lr
    peak = scaled_lr(o.lr, t.batch_size, o.base_batch_size, o.lr_scaling)
    warmup = int(s.warmup_epochs)
    flags = ["--device", device, "--model", cfg.model.name, "--num-classes", str(num_classes),
             "--img-size", str(d.img_size), "--crop-pct", f"{d.crop_pct:g}",
             "--interpolation", d.interpolation, "--train-interpolation", d.interpolation,
             "--scale", *(f"{v:g}" for v in d.scale), "--ratio", *(f"{v:g}" for v in d.ratio),
             "--hflip", f"{d.hflip:g}", "--color-jitter", f"{d.color_jitter:g}",
             "--mean", *(f"{v:g}" for v in d.mean), "--std", *(f"{v:g}" for v in d.std),
             "-b", str(t.batch_size), "-j", str(d.num_workers),
             "--opt", o.name, "--lr", f"{peak:g}", "--weight-decay", f"{o.weight_decay:g}",
             "--sched", "cosine", "--sched-on-updates", "--epochs", str(t.epochs - warmup),
             "--warmup-epochs", str(warmup), "--warmup-prefix", "--warmup-lr", "0", "--min-lr", f"{s.min_lr:g}",
             "--smoothing", f"{t.label_smoothing:g}", "--drop", f"{cfg.model.drop_rate:g}",
             "--drop-path", f"{cfg.model.drop_path_rate:g}", "--seed", str(t.seed),
             "--kd-model-name", f"local-dir:{teacher_dir}", "--kd-distill-type", "logit",
             "--kd-temperature", f"{cfg.distill.temperature:g}",
             "--task-loss-weight", f"{1 - cfg.distill.alpha:g}"]
    if o.name == "sgd":
        flags += ["--momentum", f"{o.momentum:g}"]
    else:
        flags += ["--opt-eps", f"{o.eps:g}", "--opt-betas", *(f"{v:g}" for v in o.betas)]
    if t.channels_last:
        flags.append("--channels-last")
    if amp_bf16:
        flags += ["--amp", "--amp-dtype", "bfloat16"]
    return flags


def summarise_timm(summary_csv: str) -> dict:
    """Best and last validation top-1 from timm's summary.csv (its epochs count from 0; ours from 1, as here)."""
    rows = list(csv.DictReader(io.StringIO(summary_csv)))
    top1 = [float(r["eval_top1"]) for r in rows]
    best = max(top1)
    return {"best_top1": best, "best_epoch": top1.index(best) + 1, "last_top1": top1[-1], "epochs": len(top1)}


def summarise_ours(summary: dict, metrics_csv: str) -> dict:
    rows = [r for r in csv.DictReader(io.StringIO(metrics_csv)) if r["val_top1"]]
    return {"best_top1": summary["best"]["top1"], "best_epoch": summary["best_epoch"],
            "last_top1": float(rows[-1]["val_top1"]), "epochs": summary["epochs_completed"]}


def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: list[str], log: Path, env: Optional[dict] = None) -> dict:
    """Run `cmd` to the end, its output in `log`; whole-process wall time, the CPU seconds of the process
    and its loader workers (less sensitive to the other jobs on the machine than the wall time) and the
    load around it."""
    before, cpu = load1(), children_cpu_s()
    start = time.monotonic()
    with log.open("w") as out:
        rc = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                            env=None if env is None else {**os.environ, **env}).returncode
    wall = time.monotonic() - start
    if rc != 0:
        raise SystemExit(f"{cmd[1]} exited {rc}; see {log}")
    return {"wall_s": round(wall, 1), "cpu_s": round(children_cpu_s() - cpu, 1), "load_before": before,
            "load_after": load1()}


def parse_env(text: str) -> dict:
    """'A=1 B=2' as a dict; an item without '=' is a usage error."""
    pairs = [item.partition("=") for item in text.split()]
    if any(not sep or not key for key, sep, _ in pairs):
        raise ValueError(f"--timm-env {text!r}: expected NAME=VALUE items")
    return {key: value for key, _, value in pairs}


def markdown_table(rows: list[dict]) -> str:
    lines = ["| run | seed | best top-1 (%) | best epoch | last-epoch top-1 (%) | wall | CPU s | load (1 min) before / after |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        wall = f"{int(r['wall_s'] // 60)}m{int(r['wall_s'] % 60):02d}s"
        lines.append(f"| {r['run']} | {r['seed']} | {r['best_top1']:.2f} | {r['best_epoch']} | {r['last_top1']:.2f} "
                     f"| {wall} | {r.get('cpu_s', '')} | {r['load_before']:.2f} / {r['load_after']:.2f} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timm-train", required=True, type=Path, help="a copy of timm's train.py")
    parser.add_argument("--teacher", required=True, type=Path, help="our teacher checkpoint (best.pt)")
    parser.add_argument("--data", required=True, type=Path, help="class-folder tree with the config's splits")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--config", default="quickstart")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--timm-env", default=None, metavar="'NAME=VALUE ...'",
                        help="also run timm with these environment variables, after its plain run each seed")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE for both runs")
    args = parser.parse_args(argv)
    try:
        timm_envs = [("timm", None)] + ([("timm+env", parse_env(args.timm_env))] if args.timm_env else [])
    except ValueError as err:
        print(f"kd_compare: {err}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO))
    from imgcls.compute.device import resolve_amp, select_device
    from imgcls.config import load_config
    from imgcls.core.errors import ConfigError

    args.out.mkdir(parents=True, exist_ok=True)
    teacher_dir = args.out / "teacher_timm"
    plans = []
    for seed in (int(s) for s in args.seeds.split(",")):
        ours = [f"data.root={args.data}", f"train.seed={seed}", f"distill.teacher={args.teacher}", *args.overrides]
        try:
            cfg = load_config(args.config, ours)
            device = select_device(cfg.train.device)
            classes = sum(1 for p in (args.data / cfg.data.train_split).iterdir() if p.is_dir())
            flags = timm_flags(cfg, classes, teacher_dir.resolve(), resolve_amp(cfg.train.amp, device) is not None,
                               device.type)
        except (ConfigError, UnmappedSetting, OSError) as err:
            print(f"kd_compare: {err}", file=sys.stderr)
            return 2
        plans.append((seed, cfg, ours, flags))
    if not teacher_dir.exists():
        subprocess.run([sys.executable, str(REPO / "export.py"), "--checkpoint", str(args.teacher), "--format",
                        "timm", "--output", str(teacher_dir)], cwd=REPO, check=True)
    rows = []
    for seed, cfg, ours, flags in plans:
        ours_dir, timm_out = args.out / f"ours-{seed}", args.out / "timm"
        run = timed([sys.executable, str(REPO / "train.py"), "--config", args.config, f"output.dir={ours_dir}",
                     *ours], args.out / f"ours-{seed}.log")
        run.update(summarise_ours(json.loads((ours_dir / "summary.json").read_text()),
                                  (ours_dir / "metrics.csv").read_text()), run="ours", seed=seed)
        rows.append(run)
        print(json.dumps(run), file=sys.stderr, flush=True)
        for name, env in timm_envs:
            experiment = f"{name.replace('+', '-')}-{seed}"
            run = timed([sys.executable, str(args.timm_train.resolve()), str(args.data.resolve()),
                         "--train-split", cfg.data.train_split, "--val-split", cfg.data.val_split,
                         "--output", str(timm_out.resolve()), "--experiment", experiment, *flags],
                        args.out / f"{experiment}.log", env)
            run.update(summarise_timm((timm_out / experiment / "summary.csv").read_text()), run=name, seed=seed,
                       env=env)
            rows.append(run)
            print(json.dumps(run), file=sys.stderr, flush=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
