"""What a search leaves for the user: DIR/trials.csv (one row per trial), DIR/best.yaml (the config that
train.py retrains the best trial with), Optuna's plots as PNGs, the closing line that says how sure the result
is, and (`--keep best`) the checkpoints of every trial but the best one deleted."""
from __future__ import annotations

import csv
import io
import logging
import math
import os
import warnings
from pathlib import Path

import yaml

from imgcls.core.config import CONFIG_DIR, nest, parse_override, read_yaml, resolve_config_path
from imgcls.tasks import metric_named
from imgcls.tuning.search_space import override_text, trial_values

log = logging.getLogger(__name__)

CHECKPOINTS = ("last.pt", "last.prev.pt", "best.pt")
# the margin (in standard errors of the runner-up's accuracy) above which the best trial's lead is called clear
CLEAR_LEAD_SE = 2.0


def write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def finish_study(study, plan, done: bool) -> list[Path]:
    """Write the results of the study as it stands; `done`: every asked trial finished (then --keep applies).
    Returns the files written."""
    from optuna.trial import TrialState

    write_trials_csv(study, plan)
    complete = sorted(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)),
                      key=lambda t: t.value, reverse=plan.higher_is_better)
    if not complete:
        log.warning("search: no complete trial yet: no best.yaml")
        return [plan.study_dir / "trials.csv"]
    write_best_yaml(complete[0], plan)
    plots = write_plots(study, plan, len(complete))
    if done and plan.keep == "best":
        drop_checkpoints(study, plan, keep=complete[0].number)
    log.info("%s", closing_line(study, plan, complete))
    return [plan.study_dir / "trials.csv", plan.study_dir / "best.yaml", *plots]


def write_trials_csv(study, plan) -> None:
    keys = [d.key for d in plan.dims]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["number", "state", *keys, "value", "wall_time_s"])
    for trial in study.get_trials(deepcopy=False):
        value = trial.value if trial.value is not None else _last_reported(trial)
        wall = trial.user_attrs.get("wall_s")
        writer.writerow([trial.number, trial.state.name, *(trial.params.get(k, "") for k in keys),
                         "" if value is None else f"{value:.6g}", "" if wall is None else f"{wall:.1f}"])
    write_text(plan.study_dir / "trials.csv", out.getvalue())


def _last_reported(trial):
    """A pruned trial's value: the last epoch it was validated at."""
    steps = trial.intermediate_values
    return steps[max(steps)] if steps else None


def best_config(trial, plan) -> dict:
    """The study's config file with its overrides, the trial's values, the seed and a fresh output.dir, as one
    nested mapping: what `train.py --config` of the study trained the trial with. Only what the study's
    command set is written (base.yaml's restated defaults are not), so keys whose defaults follow other keys
    (a pretrained model's preprocessing) stay unset, as they were in the trial."""
    path = resolve_config_path(plan.config)
    values = {} if path.resolve() == (CONFIG_DIR / "base.yaml").resolve() else read_yaml(path)
    settings = [*plan.overrides, *(override_text(k, v) for k, v in trial_values(trial.params, plan.dims).items()),
                override_text("train.seed", plan.seed), override_text("output.dir", str(plan.study_dir / "best"))]
    for text in settings:
        _merge(values, nest(*parse_override(text)))
    return values


def _merge(into: dict, values: dict) -> None:
    for key, value in values.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def write_best_yaml(trial, plan) -> None:
    header = (f"# the best trial of the search in {plan.study_dir}: trial {trial.number}, {plan.metric} "
              f"{trial.value:.6g}\n# python train.py --config {plan.study_dir / 'best.yaml'} retrains it "
              f"(the same values and train.seed) into output.dir below\n")
    write_text(plan.study_dir / "best.yaml", header + yaml.safe_dump(best_config(trial, plan), sort_keys=False))


def write_plots(study, plan, complete: int) -> list[Path]:
    """Optuna's matplotlib plots: history, slice, and the parameter importances (at least 2 complete trials
    and 2 keys: with one key there is nothing to compare)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as plots

    drawings = {"history.png": plots.plot_optimization_history, "slice.png": plots.plot_slice}
    if complete >= 2 and len(plan.dims) > 1:
        drawings["importances.png"] = plots.plot_param_importances
    # matplotlib says at INFO that a slice of numeric choices is drawn as categories, which is meant
    logging.getLogger("matplotlib.category").setLevel(logging.WARNING)
    for name, draw in drawings.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
            axes = draw(study, target_name=plan.metric) if name != "importances.png" else draw(study)
        figure = (axes.flat[0] if hasattr(axes, "flat") else axes).figure
        tmp = plan.study_dir / f".{name}.{os.getpid()}.tmp.png"
        figure.savefig(tmp, dpi=100, bbox_inches="tight")
        plt.close(figure)
        os.replace(tmp, plan.study_dir / name)
    return [plan.study_dir / name for name in drawings]


def drop_checkpoints(study, plan, keep: int) -> None:
    freed = 0
    for trial in study.get_trials(deepcopy=False):
        if trial.number == keep:
            continue
        for name in CHECKPOINTS:
            path = plan.study_dir / "trials" / str(trial.number) / name
            if path.exists():
                freed += path.stat().st_size
                path.unlink()
    if freed:
        log.info("search: --keep best: deleted the checkpoints of the other trials (%.1f MiB); their logs and "
                 "metrics stay", freed / 2**20)


def closing_line(study, plan, complete: list) -> str:
    """The best trial, its values, and how sure: the complete trials behind it and the runner-up's gap, for a
    percentage metric also in standard errors of an accuracy on the validation images."""
    from optuna.trial import TrialState

    states = [t.state for t in study.get_trials(deepcopy=False)]
    best = complete[0]
    counts = ", ".join(f"{states.count(s)} {s.name.lower()}" for s in (TrialState.COMPLETE, TrialState.PRUNED,
                                                                       TrialState.FAIL) if states.count(s))
    values = " ".join(override_text(k, v) for k, v in trial_values(best.params, plan.dims).items())
    line = f"search: {len(states)} trial(s) ({counts}); best trial {best.number}: {plan.metric} {best.value:.4g} ({values})"
    if len(complete) < 2:
        return line + "; only one complete trial: nothing to compare it with, the result is not settled"
    gap = abs(best.value - complete[1].value)
    line += f"; runner-up trial {complete[1].number} {complete[1].value:.4g}, {gap:.3g} behind"
    samples = _validation_samples(plan.study_dir / "trials" / str(best.number))
    if not metric_named(plan.metric).percent or not samples:
        return line + f" (from {len(complete)} complete trials)"
    p = min(max(complete[1].value / 100.0, 1.0 / samples), 1 - 1.0 / samples)
    se = 100.0 * math.sqrt(p * (1 - p) / samples)
    verdict = "a clear lead" if gap >= CLEAR_LEAD_SE * se else "within the noise: not settled (retrain both with another train.seed)"
    return line + (f" = {gap / se:.1f} standard errors of a {plan.metric} on {samples} validation images: {verdict}; "
                   f"{len(complete)} complete trials")


def _validation_samples(run_dir: Path):
    import json

    try:
        return int(json.loads((run_dir / "summary.json").read_text())["best"]["num_samples"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
