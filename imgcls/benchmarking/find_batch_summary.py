"""`benchmark.py --mode find-batch`'s reading for a person (stderr; stdout keeps the one JSON object): what to
set, why, and how far the timings can be trusted."""
from __future__ import annotations

# the recommendation leaves at least this many optimizer steps per epoch (an effective batch close to the
# training split gives one or two updates per epoch: nothing to schedule, warm up or early-stop on)
MIN_STEPS_PER_EPOCH = 8


def find_batch_summary(report: dict) -> str:
    """Lines: the setting to use, the speed table (median img/s over the timing rounds and their spread), the
    steps per epoch it leaves, and a warning when the timings did not settle."""
    lines = [f"find-batch: use train.batch_size={report['batch_size']} train.accum_steps={report['accum_steps']} "
             f"(effective batch {report['effective_batch']} on {report['world_size']} process(es); the largest "
             f"batch that fits is {report['max_batch']}, the smallest as fast as the best is "
             f"{report['fastest_small_batch']})"]
    if report.get("steps_per_epoch") is not None:
        lines.append(f"  {report['steps_per_epoch']} optimizer steps per epoch over {report['train_images']} "
                     f"training images (the target effective batch is kept to at least {MIN_STEPS_PER_EPOCH})")
    lines.append(f"  {'batch':>6} {'img/s':>9} {'spread':>7} {'peak MiB':>9}")
    for row in report["table"]:
        lines.append(f"  {row['batch']:>6} {row['img_per_s']:>9.1f} {100 * row.get('img_per_s_spread', 0):>6.1f}% "
                     f"{row['peak_memory_mb']:>9.0f}")
    rounds = report.get("timing_rounds", 1)
    if report.get("timing_stable", True):
        lines.append(f"  timings stable: {rounds} round(s), every batch within 10% of itself")
    else:
        worst = max(row.get("img_per_s_spread", 0) for row in report["table"])
        lines.append(f"  WARNING: timings not stable after {rounds} rounds (a batch's img/s varied by "
                     f"{100 * worst:.0f}%): the machine is busy, and a run now may pick another batch; rerun "
                     f"when it is idle, or take the largest that fits")
    return "\n".join(lines)
