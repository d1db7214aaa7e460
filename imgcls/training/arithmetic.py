"""Pure arithmetic of tuning before a long run (`tune.py`): loss smoothing, the loss after a given number of
samples, steps and wall time to a target loss, the verdict of a batch-size sweep, and the LR range test's
suggestions (steepest descent, divergence). No torch: unit-tested on synthetic curves."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

SMOOTHING = 0.9            # EMA weight of the past; debiased like fastai's / Lightning's lr_find


KNEE_TOLERANCE = 0.05      # the throughput knee: the smallest batch within 5% of the best img/s


DIVERGENCE_FACTOR = 4.0    # the LR range test stops once the smoothed loss exceeds 4x its minimum


# the suggestion is at most the LR of the loss minimum over this: fastai's `minimum` rule takes 10, which trained
# the photos-like shapes 20 points below the recipe in 3 epochs; 4 trained both data sets measured within 2.1
# points of it (docs/advice.md)
MINIMUM_DIVISOR = 4.0


LR_MIN_DROP = 0.10         # a suggestion is low-confidence when the loss fell less than this share before its minimum


LR_MIN_POINTS = 5          # ... or fewer points than this lead down to the minimum


RISE_SHARE = 0.5           # after its minimum the loss "rose back" once it undid this share of its fall


def smooth(values: list[float], beta: float = SMOOTHING) -> list[float]:
    """Exponential moving average with bias correction (the first values are not pulled towards 0)."""
    out, avg = [], 0.0
    for i, value in enumerate(values, start=1):
        avg = beta * avg + (1 - beta) * value
        out.append(avg / (1 - beta ** i))
    return out


@dataclass
class Curve:
    """One batch size's run: after optimizer step `steps[i]`, `samples[i]` samples seen, `seconds[i]` of
    wall time, the smoothed training loss `losses[i]`."""

    batch: int                      # per-process micro-batch
    accum_steps: int
    effective_batch: int
    steps: list[int] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


def interpolated(xs: list[float], ys: list[float], at: float) -> Optional[float]:
    """ys at `at`, linearly between the points (xs ascending); the first y before the first x, None past the
    last x (the curve did not get that far)."""
    points = list(zip(xs, ys))
    if not points or at > points[-1][0]:
        return None
    if at <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= at <= x1:
            return y0 + (y1 - y0) * (at - x0) / (x1 - x0) if x1 > x0 else y1
    return points[-1][1]


def loss_after_samples(curve: Curve, samples: int) -> Optional[float]:
    """The smoothed loss after `samples` samples, interpolated linearly between logged points; None when the
    curve did not get that far."""
    return interpolated(curve.samples, curve.losses, samples)


def loss_at_seconds(curve: Curve, seconds: float) -> Optional[float]:
    """The smoothed loss at `seconds` of wall time since the run's start (what the sweep's plot shows),
    interpolated linearly between logged points; None when the run ended before."""
    return interpolated(curve.seconds, curve.losses, seconds)


def common_seconds(curves: list[Curve]) -> float:
    """The wall time every run lasted (the shortest run's): where the losses are compared at equal time."""
    timed = [c.seconds[-1] for c in curves if c.seconds]
    return min(timed) if timed else 0.0


def default_target(curves: list[Curve]) -> Optional[float]:
    """The loss at least half of the sizes reached: the median of their lowest smoothed losses (the lower one
    of the middle two for an even count). The lowest loss *every* size reached is the worst size's level,
    which the smallest batch reaches first by a hair; a level that some sizes do not reach separates them."""
    minima = sorted(min(c.losses) for c in curves if c.losses)
    return minima[(len(minima) - 1) // 2] if minima else None


def step_time_error(curve: Curve) -> float:
    """The relative standard error of the mean seconds per optimizer step: the standard deviation of the
    logged intervals' per-step times (the first, which holds the start-up, left out) over their mean, divided
    by the square root of their count."""
    per_step = [(t1 - t0) / (s1 - s0) for s0, s1, t0, t1 in
                zip(curve.steps[1:], curve.steps[2:], curve.seconds[1:], curve.seconds[2:]) if s1 > s0]
    if len(per_step) < 2:
        return 0.0
    mean = sum(per_step) / len(per_step)
    variance = sum((x - mean) ** 2 for x in per_step) / (len(per_step) - 1)
    return math.sqrt(variance / len(per_step)) / mean if mean > 0 else 0.0


def time_to_target_noise(curve: Curve, seconds: float, seconds_per_step: float) -> float:
    """How far a time to target may be off: two standard errors of the mean step time (`step_time_error`,
    about a 95% band) over the time, plus one logging interval of steps (the target is seen only at logged
    steps, so it was crossed up to an interval earlier)."""
    interval = curve.steps[1] - curve.steps[0] if len(curve.steps) > 1 else 1
    return seconds * 2 * step_time_error(curve) + interval * seconds_per_step


def steps_to_target(curve: Curve, target: float) -> Optional[int]:
    """The first logged optimizer step whose smoothed loss is at or below `target`; None if never."""
    for step, loss in zip(curve.steps, curve.losses):
        if loss <= target:
            return step
    return None


def time_to_target(steps: Optional[int], seconds_per_step: float) -> Optional[float]:
    """Estimated wall time to the target: the steps it took, at the measured seconds per optimizer step."""
    return None if steps is None else steps * seconds_per_step


def throughput_knee(rates: dict[int, float], tolerance: float = KNEE_TOLERANCE) -> Optional[int]:
    """The smallest batch whose img/s is within `tolerance` of the best (larger ones only cost memory)."""
    if not rates:
        return None
    best = max(rates.values())
    return min(b for b, rate in rates.items() if rate >= (1.0 - tolerance) * best)


def learning_failure(losses: list[float], chance: Optional[float], diverged: bool = False) -> Optional[str]:
    """Why a sweep's curve shows no learning, or None when it learned: a non-finite loss ended it, its smoothed
    loss ended above where it began, or (`chance`: what a model predicting every class alike scores, ln C for
    single-label cross entropy) it never fell below chance. Such a curve ranks nothing: the least time to a
    loss it reached by climbing, or the lowest loss among climbing ones, says which size broke more slowly."""
    if diverged:
        return "the loss became non-finite"
    if not losses:
        return None
    if not all(math.isfinite(v) for v in losses):
        return "the loss became non-finite"
    if losses[-1] > losses[0]:
        return f"the smoothed loss rose from {losses[0]:.4g} to {losses[-1]:.4g}"
    if chance is not None and min(losses) >= chance:
        return f"the smoothed loss stayed above chance ({min(losses):.4g}, chance {chance:.4g})"
    return None


def sweep_verdict(rows: list[dict]) -> dict:
    """From the sweep's rows (`effective_batch`, `img_per_s`, `time_to_target_s`, `time_to_target_noise_s`,
    `loss_at_common_seconds`, `fits`): the batch with the lowest smoothed loss at equal wall time (what the
    plot of loss against wall time shows at the shortest run's end), the batch with the least time to target, the batches whose time is within the measurement noise of
    it (`within_noise`, the fastest included: more than one means no clear winner), the throughput knee, and the
    largest that fits as it is (no accumulation). Rows whose curve did not learn (`not_learning`, see
    `learning_failure`) are named and take part in no comparison of losses."""
    failed = [r["effective_batch"] for r in rows if r.get("not_learning")]
    rows_learning = [r for r in rows if not r.get("not_learning")]
    reached = [r for r in rows_learning if r.get("time_to_target_s") is not None]
    best = min(reached, key=lambda r: (r["time_to_target_s"], r["effective_batch"])) if reached else None
    close = [r["effective_batch"] for r in reached if best is not None and
             r["time_to_target_s"] - best["time_to_target_s"] <=
             r.get("time_to_target_noise_s", 0.0) + best.get("time_to_target_noise_s", 0.0)]
    knee = throughput_knee({r["effective_batch"]: r["img_per_s"] for r in rows if r.get("img_per_s")})
    fitting = [r["effective_batch"] for r in rows if r.get("fits")]
    timed = [r for r in rows_learning if r.get("loss_at_common_seconds") is not None]
    at_time = min(timed, key=lambda r: (r["loss_at_common_seconds"], r["effective_batch"])) if timed else None
    return {"lowest_loss_at_equal_time": at_time["effective_batch"] if at_time else None,
            "not_reaching_target": [r["effective_batch"] for r in rows_learning
                                    if r.get("final_loss") is not None and r.get("time_to_target_s") is None],
            "not_learning": failed,
            "least_time_to_target": best["effective_batch"] if best else None, "within_noise": sorted(close),
            "throughput_knee": knee, "largest_that_fits": max(fitting) if fitting else None}


def exponential_lrs(low: float, high: float, steps: int) -> list[float]:
    """`steps` LRs from `low` to `high`, equally spaced in log scale."""
    if steps == 1:
        return [low]
    ratio = high / low
    return [low * ratio ** (i / (steps - 1)) for i in range(steps)]


def divergence_index(losses: list[float], factor: float = DIVERGENCE_FACTOR) -> Optional[int]:
    """The first point whose smoothed loss exceeds `factor` x the lowest one before it (or is not finite)."""
    best = math.inf
    for i, loss in enumerate(losses):
        if not math.isfinite(loss) or (i > 0 and loss > factor * best):
            return i
        best = min(best, loss)
    return None


def minimum_index(losses: list[float]) -> Optional[int]:
    """The lowest smoothed loss before any divergence (None for an empty curve)."""
    end = divergence_index(losses)
    usable = losses[:len(losses) if end is None else end]
    return min(range(len(usable)), key=usable.__getitem__) if usable else None


def rise_index(losses: list[float], minimum: Optional[int], skip_start: int = 0,
               share: float = RISE_SHARE) -> Optional[int]:
    """The first point after the minimum whose smoothed loss undid more than `share` of the fall from the start
    (`skip_start`) to the minimum: training that the rising LR broke without the 4x jump `divergence_index`
    needs (on a 10-class problem a broken model's loss sits near log 10, under 4x a minimum of 0.8)."""
    if minimum is None or minimum <= skip_start:
        return None
    start, low = losses[skip_start], losses[minimum]
    fall = start - low
    if not fall > 0:
        return None
    for i in range(minimum + 1, len(losses)):
        if not math.isfinite(losses[i]) or losses[i] > low + share * fall:
            return i
    return None


def largest_fall(losses: list[float], skip_start: int = 0) -> Optional[tuple[int, int]]:
    """(top, bottom) of the largest fall of the smoothed loss before any divergence, from a point to a later,
    lower one (the maximum drawdown; fastai's `valley` takes the longest falling run); None when it never falls.
    Noise in a flat stretch makes small falls; a network that rose first and then learned makes a large one."""
    end = divergence_index(losses)
    best, drop, top = None, 0.0, skip_start
    for i in range(skip_start, len(losses) if end is None else end):
        if losses[i] > losses[top]:
            top = i
        if losses[top] - losses[i] > drop:
            best, drop = (top, i), losses[top] - losses[i]
    return best


def fell_enough(losses: list[float], top: int, bottom: int) -> bool:
    """Whether the smoothed loss fell at least LR_MIN_DROP of its height at `top` by `bottom`."""
    return bool(losses[top]) and (losses[top] - losses[bottom]) / abs(losses[top]) >= LR_MIN_DROP


def steepest_descent_index(lrs: list[float], losses: list[float], skip_start: int = 0,
                           end: Optional[int] = None) -> Optional[int]:
    """Where the smoothed loss falls fastest against log(LR) on the way down to its minimum (fastai's `steep`
    suggestion): only points before the minimum (or `end`) count, so a brief dip after the loss has blown up
    (a spike falling back) is never taken; None with fewer than 3 points before the minimum."""
    end = minimum_index(losses) if end is None else end
    if end is None or end - skip_start < 2:
        return None
    slopes = [(losses[i + 1] - losses[i - 1]) / (math.log(lrs[i + 1]) - math.log(lrs[i - 1]))
              for i in range(skip_start + 1, end)]
    return skip_start + 1 + min(range(len(slopes)), key=slopes.__getitem__)


def lr_confidence(losses: list[float], steep: Optional[int], minimum: Optional[int], diverged: Optional[int],
                  skip_start: int, rose: Optional[int] = None) -> tuple[str, list[str]]:
    """How sure the suggestion is: `high`, `medium` or `low`, and the reasons for anything less than high.
    Low: the loss hardly fell before its minimum (under LR_MIN_DROP of its start), the minimum sits at the end of
    a range that never diverged (a better LR may lie beyond it), or too few points lead down to it. Medium:
    the loss never diverged nor rose back (`rise_index`): how far above the suggestion a run still survives is
    unknown."""
    if minimum is not None and minimum <= skip_start:
        return "low", ["the smoothed loss never fell below its start (nor back to it after a rise) within these "
                       "steps: give more --steps (each LR is then held longer)"]
    if steep is None or minimum is None:
        return "low", ["too few points before the loss reached its minimum"]
    start = losses[skip_start]
    drop = (start - losses[minimum]) / abs(start) if start else 0.0
    reasons = []
    if drop < LR_MIN_DROP:
        reasons.append(f"the smoothed loss fell only {100 * drop:.0f}% before its minimum (under "
                       f"{100 * LR_MIN_DROP:.0f}%)")
    if diverged is None and rose is None and minimum >= len(losses) - 2:
        reasons.append("the loss was still falling at the top of the range: raise the high end of --lr-range")
    if minimum - skip_start < LR_MIN_POINTS:
        reasons.append(f"only {minimum - skip_start} points lead down to the minimum: give more --steps or lower "
                       f"the low end of --lr-range")
    if reasons:
        return "low", reasons
    if diverged is None and rose is None:
        reasons.append("the loss never diverged within the range, so how far above the suggestion training "
                       "still survives is not known")
    return ("medium", reasons) if reasons else ("high", [])


def above_floor(losses: list[float], floor: float) -> list[float]:
    """Each loss's height above `floor` (at least 0; a non-finite loss stays as it is): the scale on which
    "4x the lowest" and "fell by 10%" mean what they say for an objective that cannot reach 0."""
    return [max(loss - floor, 0.0) if math.isfinite(loss) else loss for loss in losses]


def lr_suggestion(lrs: list[float], losses: list[float], requested: Optional[tuple[float, float, int]] = None,
                  floor: float = 0.0) -> dict:
    """The LR range test's result. `suggested_lr`, the one to use: the smaller of the steepest descent before
    the minimum and the minimum's LR over MINIMUM_DIVISOR (4; fastai's `minimum` rule takes a tenth). The minimum sits where the loss
    stops falling within a run that only lasts as long as the test and whose LR keeps rising; a whole run at
    one peak LR survives only well below it, and the steepest point on a short, flat-then-falling curve can
    sit close to it. Also the steepest descent, the minimum, the divergence, where the loss rose back without
    diverging (`rise_lr`, the highest loss after it `rise_loss`), `confidence` (with `confidence_reasons`, see
    `lr_confidence`) and `rerun`: for a low confidence, the --lr-range and --steps to try instead of
    `requested` (low, high, steps asked; default: the LRs tested, which end early at a divergence).
    `floor`: the lowest loss the objective can reach (tuning.sweep: label smoothing, mixing); the
    divergence's 4x and the confidence's 10% fall are measured above it (`loss_floor` in the result)."""
    skip = min(len(lrs) // 10, 10)
    losses_above = above_floor(losses, floor)
    start, minimum = skip, minimum_index(losses_above)
    fall = rose_first = None
    if minimum is not None and (minimum <= skip or not fell_enough(losses_above, skip, minimum)):
        fall = largest_fall(losses_above, skip)
    # the loss rose first, then fell back to its start's level: the fall is the curve to read (a fall that ends
    # well above the start is a network still recovering, not learning)
    if fall is not None and fall[0] > skip and fell_enough(losses_above, *fall) and \
            losses_above[fall[1]] <= (1 + LR_MIN_DROP) * losses_above[skip]:
        start, minimum = rose_first = fall
    steep = steepest_descent_index(lrs, losses_above, skip_start=start, end=minimum)
    diverged = divergence_index(losses_above)
    rose = rise_index(losses_above, minimum, start) if diverged is None else None
    suggested = None
    if steep is not None:
        suggested = min(lrs[steep], lrs[minimum] / MINIMUM_DIVISOR)
    confidence, reasons = lr_confidence(losses_above, steep, minimum, diverged, start, rose)
    if rose_first is not None and confidence == "high":
        confidence = "medium"
    if rose_first is not None and confidence != "low":
        reasons.append(f"the loss first rose, from {losses[skip]:.3g} to {losses[start]:.3g} at LR {lrs[start]:.3g}, "
                       f"and the suggestion reads the fall after it, to {losses[minimum]:.3g} at LR "
                       f"{lrs[minimum]:.3g}: the lower LRs moved the loss less than the noise within these steps")
    return {"suggested_lr": suggested, "loss_floor": floor, "steepest_lr": lrs[steep] if steep is not None else None,
            "fall_start_lr": lrs[start] if rose_first is not None else None,
            "minimum_lr": lrs[minimum] if minimum is not None else None,
            "divergence_lr": lrs[diverged] if diverged is not None else None,
            "rise_lr": lrs[rose] if rose is not None else None,
            "rise_loss": max(losses[rose:]) if rose is not None else None,
            "steepest_index": steep, "minimum_index": minimum, "divergence_index": diverged, "rise_index": rose,
            "confidence": confidence, "confidence_reasons": reasons,
            "rerun": rerun_settings(requested or (lrs[0], lrs[-1], len(lrs)), reasons) if confidence == "low" else None}


def rerun_settings(requested: tuple[float, float, int], reasons: list[str]) -> dict:
    """What a low-confidence test's reasons ask for: `low`, `high`, `steps` of the next test (the high end
    100x higher when the loss still fell at the top; twice the steps when the loss hardly fell (each LR is
    then held twice as long); a 10x lower start too when too few points led down to its minimum)."""
    low, high, steps = requested
    if any("raise the high end" in r for r in reasons):
        high *= 100
    if any("points lead down" in r or "too few points" in r for r in reasons):
        low = low / 10
    if any("fell only" in r or "points lead down" in r or "too few points" in r or "never fell" in r
           for r in reasons):
        steps = steps * 2
    return {"low": low, "high": high, "steps": steps}


def sweep_rows(results: list[dict], target: Optional[float],
               chance: Optional[float] = None) -> tuple[list[dict], Optional[float], int]:
    """The sweep's table. `results`: per size `size`, `how`, `fits`, `curve` (a Curve, or None when nothing
    fitted), `img_per_s`, `seconds_per_step`, `peak_memory_mb`, `diverged` (optional). Returns (rows, the target
    used: the given one, else `default_target` of the curves that learned (`learning_failure` against
    `chance`), the samples at which all losses are compared: what the shortest run saw)."""
    curves = [r["curve"] for r in results if r["curve"] is not None and r["curve"].losses]
    failures = [learning_failure(r["curve"].losses, chance, r.get("diverged", False)) if r["curve"] is not None
                else None for r in results]
    learned = [r["curve"] for r, failure in zip(results, failures)
               if failure is None and r["curve"] is not None and r["curve"].losses]
    target = target if target is not None else default_target(learned)
    common = min(c.samples[-1] for c in curves) if curves else 0
    at_seconds = common_seconds(curves)
    rows = []
    for r, failure in zip(results, failures):
        curve = r["curve"]
        ran = curve is not None and bool(curve.losses)
        steps = steps_to_target(curve, target) if ran and target is not None and failure is None else None
        seconds = None if steps is None else time_to_target(steps, r["seconds_per_step"])
        rows.append({
            "effective_batch": r["size"], "batch": curve.batch if curve else None,
            "accum_steps": curve.accum_steps if curve else None, "how": r["how"], "fits": r["fits"],
            "img_per_s": round(r["img_per_s"], 2) if ran else None,
            "peak_memory_mb": r["peak_memory_mb"] if ran else None,
            "loss_at_common_samples": round(loss_after_samples(curve, common), 5) if ran else None,
            "loss_at_common_seconds": round(loss_at_seconds(curve, at_seconds), 5) if ran else None,
            "common_seconds": round(at_seconds, 3),
            "final_loss": round(curve.losses[-1], 5) if ran else None,
            "steps_to_target": steps,
            "time_to_target_s": None if seconds is None else round(seconds, 3),
            "time_to_target_noise_s": None if seconds is None else
            round(time_to_target_noise(curve, seconds, r["seconds_per_step"]), 3),
            "not_learning": failure})
    return rows, target, common


def format_sweep_table(rows: list[dict], common: int, target: Optional[float]) -> str:
    def cell(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    at = next((r["common_seconds"] for r in rows if r.get("common_seconds") is not None), 0.0)
    lines = [f"{'batch':>6} {'micro x accum':>13} {'img/s':>9} {'peak MiB':>9} {f'loss@{common}':>12} "
             f"{f'loss@{at:.1f}s':>11} "
             f"{'steps->' + (format(target, '.3g') if target is not None else '?'):>13} {'time->tgt s':>14}  how"]
    for r in rows:
        micro = f"{r['batch']} x {r['accum_steps']}" if r["batch"] else "-"
        time = "-" if r["time_to_target_s"] is None else \
            f"{r['time_to_target_s']:.1f} ± {r.get('time_to_target_noise_s') or 0:.1f}"
        lines.append(f"{r['effective_batch']:>6} {micro:>13} {cell(r['img_per_s'], '.1f'):>9} "
                     f"{cell(r['peak_memory_mb'], '.0f'):>9} {cell(r['loss_at_common_samples'], '.4f'):>12} "
                     f"{cell(r.get('loss_at_common_seconds'), '.4f'):>11} "
                     f"{cell(r['steps_to_target'], 'd'):>13} {time:>14}  {r['how']}")
    return "\n".join(lines)
