"""tune.py's work: the batch sweep, the LR range test, their plots, and the Optuna search's glue.

tune.py's pictures (matplotlib, no display): loss vs wall time per batch size, and the LR range test.

Running what `tune.py` asked for, after its arguments were checked: set-up (device, process group, data),
the sweep or the LR range test from tuning/sweep.py, and the report.

`tune.py --search SPACE.yaml`'s glue: check the arguments, the config and the space (every mistake exits 2
before any trial), then run the study (tuning/search.py), each trial a train.py run.

`tune.py`'s glue: check the arguments, run the batch-size sweep or the LR range test (tuning/sweep.py),
and report: the table on stdout, the verdict, the memory breakdown, JSON and a PNG plot."""
from __future__ import annotations

import logging
import math
import sys
from typing import Optional

import imgcls.compute.distributed as dist_utils
from imgcls.compute.device import Runtime, build_runtime, precision_name
from imgcls.compute.memory import mib
from imgcls.core.errors import ConfigError, sigterm_unwinds
from imgcls.core.files import write_json
from imgcls.data.build import prepare_root, scan_splits
from imgcls.data.settings import check_data_root
from imgcls.models.factory import check_grad_checkpointing, check_model_name
from imgcls.objectives.teacher import check_teacher
from imgcls.tracking.runs import log_tune_run
from imgcls.training.arithmetic import format_sweep_table, lr_suggestion, sweep_rows, sweep_verdict
from imgcls.training.batch_finder import format_breakdown, memory_budget_bytes
from imgcls.training.optim import check_optimizer
from imgcls.training.schedule import scaled_lr
from imgcls.tuning.sweep import MemoryCheck, chance_loss, run_lr_range, sweep_batch_sizes


def _pyplot():
    # its first use builds a font cache and says so at INFO ("generated new fontManager"), which tune.py's
    # INFO-level output would show
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(results: list[dict], target: Optional[float], path: str, equal_time: Optional[float] = None) -> None:
    """One line per batch size: smoothed training loss against wall time; the target as a dashed line, the
    wall time at which the verdict compares the losses as a dotted one."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for r in results:
        curve = r["curve"]
        if curve is None or not curve.losses:
            continue
        label = f"batch {r['size']}" + (f" ({r['how']})" if r["how"] != "as is" else "")
        ax.plot(curve.seconds, curve.losses, marker=".", label=label)
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.3g}")
    if equal_time:
        ax.axvline(equal_time, color="black", linestyle=":", linewidth=1,
                   label=f"losses compared at {equal_time:.1f} s")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("smoothed training loss")
    ax.set_title("batch-size sweep: loss vs wall time")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_lr_range(doc: dict, path: str) -> None:
    """Smoothed loss against LR (log scale), the steepest descent, the minimum, the divergence point and the
    suggestion marked."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    ax.plot(doc["lrs"], doc["smoothed_loss"], label="smoothed loss")
    ax.set_xscale("log")
    for key, colour, name in (("steepest_index", "tab:green", "steepest descent"),
                              ("minimum_index", "tab:orange", "lowest loss"),
                              ("divergence_index", "tab:red", "divergence"),
                              ("rise_index", "tab:purple", "rose back (half the fall undone)")):
        i = doc.get(key)
        if i is not None:
            ax.plot([doc["lrs"][i]], [doc["smoothed_loss"][i]], "o", color=colour,
                    label=f"{name}: LR {doc['lrs'][i]:.3g}")
    if doc.get("suggested_lr") is not None:
        ax.axvline(doc["suggested_lr"], color="tab:blue", linestyle="--", linewidth=1,
                   label=f"suggested: LR {doc['suggested_lr']:.3g} ({doc['confidence']} confidence)")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("smoothed training loss")
    ax.set_title(f"LR range test at effective batch {doc['effective_batch']}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

log = logging.getLogger(__name__)


def prepare(cfg) -> tuple[Runtime, int, int]:
    """(runtime, training images, classes); config errors before any work. The runtime is set up as
    train.py's would be here (the same device, precision and thread count)."""
    check_data_root(cfg)
    check_model_name(cfg.model.name)
    check_optimizer(cfg.optim)
    check_grad_checkpointing(cfg.model)
    runtime = build_runtime(cfg, distributed=True)
    if runtime.dist.is_main:
        prepare_root(cfg)
    dist_utils.barrier()
    train_index, _ = scan_splits(cfg)
    if cfg.distill.teacher:  # a teacher that cannot teach is refused before any measurement (exit 2)
        check_teacher(cfg, train_index.classes)
    return runtime, len(train_index), len(train_index.classes)


def default_sizes(cfg, images: int, world: int) -> list[int]:
    base = cfg.train.batch_size if isinstance(cfg.train.batch_size, int) else 128
    sizes = [b for b in (base // 2, base, base * 2, base * 4) if b >= world and b // world <= images // world]
    return sizes or [max(world, min(base, images))]


def check_sizes(sizes: list[int], images: int, world: int, norm: str = "batch") -> None:
    for size in sizes:
        if size % world:
            raise ConfigError(f"--batch-sizes: {size} is not a multiple of the {world} processes")
        if size // world < 2 and norm == "batch":
            raise ConfigError(f"--batch-sizes: {size} is one image per process, and BatchNorm cannot train on one "
                              f"(it needs two values per channel); sweep from 2 per process, or set "
                              f"model.norm=group")
        if size // world > images // world:
            raise ConfigError(f"--batch-sizes: {size} is larger than the training split ({images} images"
                              f"{f' over {world} processes' if world > 1 else ''})")


def run_sweep(cfg, args, sizes: Optional[list[int]]) -> int:
    ctx, images, classes = prepare(cfg)
    world = ctx.dist.world_size
    sizes = sizes or default_sizes(cfg, images, world)
    check_sizes(sizes, images, world, cfg.model.norm)
    steps = args.steps  # commands/tune.py resolved the default
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, steps // 10)
    # the memory probe's two batches: BatchNorm refuses a batch of one where a feature map is 1x1
    memory = MemoryCheck(cfg, ctx, classes, memory_budget_bytes(cfg, ctx.device),
                         small=max(2, min(8, sizes[0] // world // 2)))
    breakdown = memory.breakdown(cfg.model.grad_checkpointing)
    say(ctx, f"tune: batch sizes {', '.join(map(str, sizes))}, {steps} optimizer steps each (warmup {warmup}), "
             f"model {cfg.model.name}, {cfg.data.img_size} px, {precision_name(ctx.amp_dtype)}, {ctx.device}")
    say(ctx, format_breakdown(breakdown.as_dict(max(sizes) // world)))
    announce = EstimateOnce(ctx, sizes, steps)
    results: list[dict] = []
    interrupted, signalled = False, []
    try:
        with sigterm_unwinds() as signalled:  # SIGTERM stops the sweep as Ctrl-C does: the sizes so far are written
            sweep_batch_sizes(cfg, ctx, sizes, steps, warmup, max(1, steps // 50), memory, args.checkpointing,
                              on_point=announce, on_entry=lambda e: results.append(entry_result(e)))
    except KeyboardInterrupt:
        interrupted = True
    interrupted = interrupted or any(r["interrupted"] for r in results)
    rows, target, common = sweep_rows(results, args.target_loss, chance_loss(cfg, classes))
    verdict = sweep_verdict(rows)
    if ctx.dist.is_main:
        print(format_sweep_table(rows, common, target))
        print(format_verdict(verdict, target, rows) + (" (interrupted: the sizes so far)" if interrupted else ""))
        doc = {"config": cfg.model.name, "steps": steps, "warmup_steps": warmup, "target_loss": target,
               "common_samples": common, "rows": rows, "verdict": verdict, "interrupted": interrupted,
               "memory_breakdown": breakdown.as_dict(max(sizes) // world),
               "curves": [curve_document(r) for r in results if r["curve"] is not None]}
        write_json(doc, args.json)
        if args.plot:

            plot_sweep(results, target, args.plot, rows[0]["common_seconds"] if rows else None)
        log_tune_run(cfg, "sweep", doc, [args.json, args.plot], world, str(ctx.device))
    dist_utils.shutdown()
    if interrupted:
        return 143 if signalled else 130
    if args.target_loss is not None and verdict["least_time_to_target"] is None:
        raise ConfigError(f"--target-loss {args.target_loss}: no batch size reached it within {steps} steps "
                          f"(lowest smoothed losses: {', '.join(str(r['final_loss']) for r in rows)})")
    return 0


def entry_result(entry) -> dict:
    run = entry.run
    return {"size": entry.size, "how": entry.how + (" (diverged)" if run and run.diverged else ""),
            "fits": entry.fits, "curve": run.curve if run else None, "img_per_s": run.img_per_s if run else 0.0,
            "seconds_per_step": run.seconds_per_step if run else 0.0,
            "peak_memory_mb": mib(run.peak_memory_bytes) if run else None, "peak_lr": run.peak_lr if run else None,
            "interrupted": bool(run and run.interrupted), "diverged": bool(run and run.diverged)}


def curve_document(result: dict) -> dict:
    c = result["curve"]
    return {"effective_batch": result["size"], "peak_lr": result["peak_lr"], "steps": c.steps, "samples": c.samples,
            "seconds": [round(s, 4) for s in c.seconds], "smoothed_loss": [round(v, 6) for v in c.losses]}


def format_verdict(verdict: dict, target: Optional[float], rows: Optional[list] = None) -> str:
    """The sweep's verdict, each part saying what it compared: the loss at equal wall time (what --plot
    draws: loss against wall time), the time to the target loss (equal step counts: a smaller batch saw fewer
    samples, and one that did not reach the target within the steps is named), the throughput knee."""
    def name(value):
        return "-" if value is None else str(value)

    rows = rows or []
    failed = [r for r in rows if r.get("not_learning")]
    why = "; ".join(f"batch {r['effective_batch']}: {r['not_learning']}" for r in failed)
    if failed and all(r.get("not_learning") or r.get("final_loss") is None for r in rows):
        return (f"verdict: no batch size learned within the sweep's steps ({why}); nothing is ranked (img/s and "
                f"peak memory in the table still hold). Lower optim.lr (tune.py --lr-range shows where the loss "
                f"falls) or check the data, then sweep again")
    close = verdict.get("within_noise") or []
    fastest = (f"batch {' and '.join(map(str, close))} are within the measurement noise of each other: no clear "
               f"winner (time->tgt ± in the table)" if len(close) > 1 else
               f"batch {name(verdict['least_time_to_target'])}")
    short = verdict.get("not_reaching_target") or []
    if short:
        fastest += (f" (every size ran the same optimizer steps, so smaller batches saw fewer samples; batch "
                    f"{' and '.join(map(str, short))} did not reach it within them)")
    parts = []
    timed = [r for r in rows if r.get("loss_at_common_seconds") is not None]
    if verdict.get("lowest_loss_at_equal_time") is not None and timed:
        losses = ", ".join(f"{r['effective_batch']}: {r['loss_at_common_seconds']:.4g}" for r in timed)
        parts.append(f"lowest smoothed loss at equal wall time ({timed[0]['common_seconds']:.1f} s, the shortest "
                     f"run's length; the plot's dotted line): batch {verdict['lowest_loss_at_equal_time']} "
                     f"({losses})")
    parts += [f"least time to loss {target if target is None else format(target, '.4g')}: {fastest}",
              f"throughput knee: batch {name(verdict['throughput_knee'])}",
              f"largest that fits as it is: batch {name(verdict['largest_that_fits'])}"]
    if failed:
        parts.insert(0, f"left out of every comparison of losses, as they did not learn: {why}")
    return "verdict: " + "; ".join(parts)


class EstimateOnce:
    """After the first size's first two logged points: how long the whole sweep will take (per-sample time
    of the first size, for all sizes' samples: an upper bound, larger batches run faster per sample)."""

    def __init__(self, ctx: Runtime, sizes: list[int], steps: int):
        self.ctx, self.total_samples, self.done = ctx, sum(sizes) * steps, False

    def __call__(self, size: int, curve) -> None:
        if self.done or len(curve.steps) < 2:
            return
        self.done = True
        per_sample = (curve.seconds[-1] - curve.seconds[0]) / max(curve.samples[-1] - curve.samples[0], 1)
        say(self.ctx, f"tune: about {per_sample * self.total_samples:.0f} s in all (at most; from the first steps "
                      f"at batch {size}); Ctrl-C prints the table so far")


class LrEstimateOnce:
    """After the LR range test's third step: how long all its steps take (the time per step after the first,
    which holds the start-up); at most, as the test stops once the loss diverges."""

    def __init__(self, ctx: Runtime, steps: int):
        self.ctx, self.steps, self.first, self.done = ctx, steps, None, False

    def __call__(self, step: int, seconds: float) -> None:
        if step == 1:
            self.first = seconds
        if self.done or self.first is None or step < 3 or step >= self.steps:
            return
        self.done = True
        total = self.first + (seconds - self.first) / (step - 1) * (self.steps - 1)
        say(self.ctx, f"LR range test: about {total:.0f} s in all (at most: it stops once the loss diverges; "
                      f"from the first {step} steps)")


def say(ctx: Runtime, text: str) -> None:
    if ctx.dist.is_main:
        print(text, file=sys.stderr, flush=True)


def run_lr_test(cfg, args, lr_range: tuple[float, float]) -> int:
    if cfg.train.batch_size == "auto":
        raise ConfigError("--lr-range runs at train.batch_size: give it a number (tune.py's sweep or "
                          "benchmark.py --mode find-batch pick one)")
    ctx, images, _ = prepare(cfg)
    check_sizes([cfg.train.batch_size * ctx.dist.world_size], images, ctx.dist.world_size, cfg.model.norm)
    steps = args.steps  # commands/tune.py resolved the default
    low, high = lr_range
    say(ctx, f"LR range test: LR {low:g} -> {high:g} over {steps} optimizer steps at batch {cfg.train.batch_size} "
             f"x accum {cfg.train.accum_steps} x {ctx.dist.world_size} process(es)")
    result = run_lr_range(cfg, ctx, low, high, steps, on_step=LrEstimateOnce(ctx, steps))
    found = lr_suggestion(result.lrs, result.smoothed, requested=(low, high, steps), floor=result.floor)
    o = cfg.optim
    at_base = (found["suggested_lr"] / scaled_lr(1.0, result.effective_batch, o.base_batch_size, o.lr_scaling)
               if found["suggested_lr"] is not None else None)
    doc = {"effective_batch": result.effective_batch, "lrs": result.lrs, "loss": result.losses,
           "smoothed_loss": result.smoothed, **found, "optim_lr": at_base, "base_batch_size": o.base_batch_size,
           "lr_scaling": o.lr_scaling, "recipe_lr": o.lr, "loss_floor_from": result.floor_reason}
    if ctx.dist.is_main:
        print(format_lr_result(doc))
        write_json(doc, args.json)
        if args.plot:

            plot_lr_range(doc, args.plot)
        log_tune_run(cfg, "lr_range", doc, [args.json, args.plot], ctx.dist.world_size, str(ctx.device))
    dist_utils.shutdown()
    return 0


RISE_NAMED = 1.25  # a smoothed loss this many times its minimum by the range's end is a rise the plot shows


def rise_after_minimum(doc: dict) -> str:
    """What the plot shows past the lowest loss when the test never called divergence (DIVERGENCE_FACTOR x the
    minimum): the rise to the highest loss after it, or that there was none."""
    from imgcls.training.arithmetic import DIVERGENCE_FACTOR

    losses, lrs, low = doc.get("smoothed_loss") or [], doc.get("lrs") or [], doc.get("minimum_index")
    if low is None or low >= len(losses) - 1:
        return "; no divergence within the range (the loss was lowest at its end)"
    top = max(range(low + 1, len(losses)), key=losses.__getitem__)
    floor = doc.get("loss_floor") or 0.0
    ratio = (losses[top] - floor) / (losses[low] - floor) if losses[low] > floor else math.inf
    if ratio < RISE_NAMED:
        return "; no divergence within the range"
    above = f" above the floor {floor:.3g}" if floor > 0 else ""
    return (f"; past the lowest loss the smoothed loss rises from {losses[low]:.3g} to {losses[top]:.3g} at LR "
            f"{lrs[top]:.3g} ({ratio:.1f}x{above}; the test calls it divergence at "
            f"{DIVERGENCE_FACTOR:g}x): stay below that LR")


def format_lr_result(doc: dict) -> str:
    """The printed result. Only a medium or high confidence ends in a `use: optim.lr=...` line; a low one says
    that the recipe's LR stands and which test to run for a confident suggestion."""
    if doc["optim_lr"] is None:
        rerun = doc.get("rerun")
        again = f"; run again with --lr-range {rerun['low']:.3g},{rerun['high']:.3g} --steps {rerun['steps']}" \
            if rerun else ""
        recipe = f"optim.lr={doc['recipe_lr']:g}" if doc.get("recipe_lr") is not None else "optim.lr"
        diverged = "no divergence" if doc["divergence_lr"] is None else f"divergence at LR {doc['divergence_lr']:.3g}"
        return (f"LR range test: no LR to suggest ({'; '.join(doc['confidence_reasons'])}; {diverged}): the "
                f"recipe's {recipe} stands{again}")
    if doc["divergence_lr"] is not None:
        diverged = f"; the loss diverges from LR {doc['divergence_lr']:.3g}"
    elif doc.get("rise_lr") is not None:
        diverged = (f"; no 4x divergence, but the loss rose back from {doc['smoothed_loss'][doc['minimum_index']]:.3g}"
                    f" to {doc['rise_loss']:.3g} from LR {doc['rise_lr']:.3g} (more than half its fall undone)"
                    if doc.get("smoothed_loss") else f"; the loss rose back from LR {doc['rise_lr']:.3g}")
    else:
        diverged = rise_after_minimum(doc)
    why = "".join(f"\n  - {reason}" for reason in doc["confidence_reasons"])
    floor = (f"the objective's loss cannot fall below {doc['loss_floor']:.3g} ({doc.get('loss_floor_from')}): "
             f"its falls and rises are measured above that\n" if doc.get("loss_floor") else "")
    head = (f"{floor}LR range test at effective batch {doc['effective_batch']}: steepest descent before the "
            f"minimum at "
            f"LR {doc['steepest_lr']:.3g}; lowest loss at LR {doc['minimum_lr']:.3g}{diverged}\n"
            f"suggested LR {doc['suggested_lr']:.3g} (the smaller of the steepest descent and a quarter of the "
            f"lowest loss's LR); confidence: {doc['confidence']}{why}\n")
    if doc["confidence"] == "low":
        recipe = f"optim.lr={doc['recipe_lr']:g}" if doc.get("recipe_lr") is not None else "optim.lr"
        rerun = doc.get("rerun")
        again = (f"; for a confident suggestion run again with --lr-range {rerun['low']:.3g},{rerun['high']:.3g} "
                 f"--steps {rerun['steps']}" if rerun else "")
        return head + f"no LR to use at low confidence: the recipe's {recipe} stands{again}"
    return head + (f"use: optim.lr={doc['optim_lr']:.4g} (at optim.base_batch_size={doc['base_batch_size']}, "
                   f"optim.lr_scaling={doc['lr_scaling']})")
