"""The search space of `tune.py --search SPACE.yaml`: one entry per dotted config key, either `{low, high}` (with
optional `log: true` and `step`) or a list of choices. Checked like config overrides before any trial: every
key must exist, every choice and both ends of a range must give a valid config (ConfigError, exit 2, naming the
key). Nothing here imports optuna; `suggest` takes an Optuna trial.

One trial of a search: train.py (or torchrun train.py) in a child process training into the trial's
directory, watched through the run's own metrics.csv. After each epoch's row the study decides whether to
prune; a pruning decision stops the child as a SIGTERM does (last.pt saved, exit 143), so the trial's run is
train.py's run, cut short. Every start is `--resume auto`: a trial interrupted earlier continues from its
last.pt (bitwise, as train.py resumes), a new one starts afresh.

What a search leaves for the user: DIR/trials.csv (one row per trial), DIR/best.yaml (the config that
train.py retrains the best trial with), Optuna's plots as PNGs, the closing line that says how sure the result
is, and (`--keep best`) the checkpoints of every trial but the best one deleted.

`tune.py --search`: an Optuna study (TPE sampler, median or Hyperband pruner) in `DIR/study.db` whose trials
are train.py runs in `DIR/trials/<number>/` (tuning/search.py). The study is resumable: the same command
continues it, taking up a trial that an earlier process left running (killed, or stopped by a signal) from its
last.pt, so no trial is lost or counted twice, until N trials are finished (complete or pruned)."""
from __future__ import annotations

import csv
import fcntl
import io
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from imgcls.config import (CONFIG_DIR, Config, _did_you_mean, all_keys, check_expanded_size, flatten, load_config, nest,
                           parse_override, read_yaml, resolve_config_path, resume_free_keys)
from imgcls.core.errors import ConfigError
from imgcls.tasks import metric_named

RANGE_FIELDS = ("low", "high", "log", "step")


# keys a study sets itself: each trial trains into DIR/trials/<number>/
STUDY_OWNED_KEYS = {"output.dir": "each trial trains into DIR/trials/<number>/ of --study DIR"}


# what Optuna stores as a categorical choice as it is; other choices (lists) are stored as their JSON text
PLAIN_CHOICE_TYPES = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class Dimension:
    """One key of the space: `choices`, or the range [low, high] (`integer` for an int key)."""
    key: str
    choices: Optional[tuple] = None
    low: Optional[float] = None
    high: Optional[float] = None
    log: bool = False
    step: Optional[float] = None
    integer: bool = False

    def describe(self) -> str:
        if self.choices is not None:
            return f"{self.key} in {list(self.choices)}"
        extra = ", log" if self.log else (f", step {self.step}" if self.step else "")
        return f"{self.key} in [{self.low}, {self.high}{extra}]"


def override_text(key: str, value: Any) -> str:
    """A KEY=VALUE override that config loading reads back as `value` (JSON is YAML; floats keep every digit)."""
    return f"{key}={json.dumps(value)}"


SPACE_MAX_BYTES = 64 * 1024  # a space names a few keys; a larger file is refused before YAML parses it


MAX_CHOICES = 100  # per key: Optuna's TPE keeps a weight per choice; a study runs tens of trials


class _SpaceLoader(yaml.SafeLoader):
    """YAML's safe loader refusing a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise ConfigError(f"the key '{key}' is given twice (line {key_node.start_mark.line + 1}); give each "
                                  f"key once")
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_space(path: Path, source: str) -> dict:
    """SPACE.yaml as a mapping: at most SPACE_MAX_BYTES, plain YAML, no key twice (ConfigError, exit 2)."""
    size = path.stat().st_size
    if size > SPACE_MAX_BYTES:
        raise ConfigError(f"{source}: {size} bytes; a space names a few keys (at most {SPACE_MAX_BYTES} bytes, "
                          f"{MAX_CHOICES} choices a key): search a range {{low, high}} instead of listing values")
    try:
        loader = _SpaceLoader(path.read_text(encoding="utf-8"))  # yaml.safe_load's loader, with the check above
        try:
            loaded = loader.get_single_data()
        finally:
            loader.dispose()
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ConfigError(f"{source}: not plain YAML: {err}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{source}: must hold a mapping of config keys at the top level")
    check_expanded_size(loaded, source)
    return loaded


def load_space(path: str, config: Optional[str], overrides: list[str]) -> list[Dimension]:
    """SPACE.yaml as dimensions, each checked against the config (`config` with `overrides`)."""
    source = f"--search {path}"
    if not Path(path).is_file():
        raise ConfigError(f"{source}: no such file (a YAML mapping of dotted config keys to {{low, high}} or a "
                          f"list of choices)")
    entries = read_space(Path(path), source)
    if not entries:
        raise ConfigError(f"{source}: the space is empty; give at least one key, e.g. "
                          f"optim.lr: {{low: 0.001, high: 1.0, log: true}}")
    known = all_keys()
    dims = []
    for key, entry in entries.items():
        key = str(key)
        if key not in known:
            raise ConfigError(f"{source}: unknown config key '{key}'{_did_you_mean(key, known)}")
        if key in STUDY_OWNED_KEYS:
            raise ConfigError(f"{source}: '{key}' cannot be searched: {STUDY_OWNED_KEYS[key]}")
        dim = _choices(key, entry, source) if isinstance(entry, list) else _range(key, entry, source)
        for value in (dim.choices if dim.choices is not None else (dim.low, dim.high)):
            _check_value(config, overrides, key, value, source)
        dims.append(dim)
    return dims


def _choices(key: str, entry: list, source: str) -> Dimension:
    if not entry:
        raise ConfigError(f"{source}: '{key}': the list of choices is empty")
    if len(entry) > MAX_CHOICES:
        raise ConfigError(f"{source}: '{key}': {len(entry)} choices, more than {MAX_CHOICES}; search a range "
                          f"{{low, high}} instead of listing values")
    texts = [json.dumps(choice, sort_keys=True) for choice in entry]
    if len(set(texts)) != len(texts):
        raise ConfigError(f"{source}: '{key}': a choice is repeated in {entry}")
    return Dimension(key, choices=tuple(entry))


def _range(key: str, entry: Any, source: str) -> Dimension:
    if not isinstance(entry, dict):
        raise ConfigError(f"{source}: '{key}' = {entry!r}: give {{low, high}} (optional log: true, step) or a list "
                          f"of choices; a fixed value belongs in the config or a KEY=VALUE override")
    unknown = sorted(set(map(str, entry)) - set(RANGE_FIELDS))
    missing = [name for name in ("low", "high") if name not in entry]
    if unknown or missing:
        raise ConfigError(f"{source}: '{key}': {'unknown field(s) ' + ', '.join(unknown) if unknown else 'no ' + missing[0]}"
                          f"; a range takes {', '.join(RANGE_FIELDS)} (low and high required)")
    low, high, step, log = entry["low"], entry["high"], entry.get("step"), entry.get("log", False)
    for name, value in (("low", low), ("high", high), ("step", step)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            raise ConfigError(f"{source}: '{key}': {name} = {value!r} must be a finite number")
    if not isinstance(log, bool):
        raise ConfigError(f"{source}: '{key}': log = {log!r} must be true or false")
    integer = _key_kind(key, source) == "int"
    if integer and not all(isinstance(v, int) for v in (low, high, step) if v is not None):
        raise ConfigError(f"{source}: '{key}' takes whole numbers: low, high and step must be integers")
    if not low < high:
        raise ConfigError(f"{source}: '{key}': low {low} must be below high {high}")
    if log and low <= 0:
        raise ConfigError(f"{source}: '{key}': log: true needs low > 0 (it is {low})")
    if step is not None and (step <= 0 or (log and not integer)):
        raise ConfigError(f"{source}: '{key}': step = {step} must be > 0" + ("" if step <= 0 else
                          "; and a float range takes log or step, not both (Optuna's rule)"))
    if step is not None and not _is_multiple(high - low, step):
        raise ConfigError(f"{source}: '{key}': high - low = {high - low} is not a multiple of step {step}")
    return Dimension(key, low=low if integer else float(low), high=high if integer else float(high), log=log,
                     step=step, integer=integer)


def _is_multiple(span: float, step: float) -> bool:
    ratio = span / step
    return abs(ratio - round(ratio)) < 1e-9 * max(1.0, abs(ratio))


def _key_kind(key: str, source: str) -> str:
    """'float' or 'int': what a range of `key` draws; ConfigError for a key that takes no number."""
    section, name = key.rsplit(".", 1)
    tp = typing.get_type_hints(type(getattr(Config(), section)))[name]
    accepted = {arg for arg in (typing.get_args(tp) if typing.get_origin(tp) is typing.Union else (tp,))}
    if float in accepted:
        return "float"
    if int in accepted:
        return "int"
    raise ConfigError(f"{source}: '{key}' takes no number (it takes {tp}); give a list of choices instead")


def _check_value(config: Optional[str], overrides: list[str], key: str, value: Any, source: str) -> None:
    try:
        load_config(config, [*overrides, override_text(key, value)])
    except ConfigError as err:
        raise ConfigError(f"{source}: '{key}' = {value!r} gives no valid config: {err}") from None


def suggest(trial, dims: list[Dimension]) -> dict:
    """The trial's value of every key (Optuna's suggest_*; a resumed trial gets the values it drew before)."""
    values = {}
    for dim in dims:
        if dim.choices is not None:
            if all(isinstance(c, PLAIN_CHOICE_TYPES) for c in dim.choices):
                values[dim.key] = trial.suggest_categorical(dim.key, list(dim.choices))
            else:
                text = trial.suggest_categorical(dim.key, [json.dumps(c) for c in dim.choices])
                values[dim.key] = json.loads(text)
        elif dim.integer:
            values[dim.key] = trial.suggest_int(dim.key, dim.low, dim.high, step=dim.step or 1, log=dim.log)
        else:
            values[dim.key] = trial.suggest_float(dim.key, dim.low, dim.high, step=dim.step, log=dim.log)
    return values


def trial_values(params: dict, dims: list[Dimension]) -> dict:
    """A finished trial's stored params as config values (list choices are stored as their JSON text)."""
    values = {}
    for dim in dims:
        if dim.key in params:
            plain = dim.choices is None or all(isinstance(c, PLAIN_CHOICE_TYPES) for c in dim.choices)
            values[dim.key] = params[dim.key] if plain else json.loads(params[dim.key])
    return values


def space_record(dims: list[Dimension]) -> list[dict]:
    """The space as plain data (kept in the study: a re-run with another space is refused)."""
    return [{k: v for k, v in vars(d).items() if v is not None and v is not False} for d in dims]

log = logging.getLogger(__name__)


POLL_S = 0.2  # how often metrics.csv is read while the trial trains


PR_SET_PDEATHSIG = 1


@dataclass
class TrialOutcome:
    exit_code: int
    pruned_epoch: Optional[int] = None  # the epoch after which the study pruned the trial
    signum: Optional[int] = None  # a stop signal the study received while the trial ran
    seconds: float = 0.0


@dataclass
class StopRequest:
    """A stop signal the study process received (SIGTERM, SIGINT, SIGUSR1), passed on to a running trial."""
    signum: Optional[int] = None
    child: Optional[subprocess.Popen] = field(default=None, repr=False)

    def handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            log.warning("received %s: the running trial saves its last.pt and stops; the same command continues "
                        "the study", signal.Signals(signum).name)
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)


def epoch_values(path: Path, column: str) -> list[tuple[int, float]]:
    """(epoch, value) of each complete metrics.csv row that has `column` (an epoch without validation has
    none); a row being written (no newline yet) is left for the next read."""
    try:
        text = path.read_text()
    except OSError:
        return []
    text = text[: text.rfind("\n") + 1]
    rows = []
    for row in csv.DictReader(io.StringIO(text)):
        value, epoch = row.get(column), row.get("epoch")
        if value not in (None, "") and epoch:
            rows.append((int(epoch), float(value)))
    return rows


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the study process dies (SIGKILL too), so an orphaned trial saves
    its last.pt and lets its directory go instead of training on unseen."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def forget_unsaved_rows(run_dir: Path) -> None:
    """A trial without last.pt starts afresh: metrics.csv rows of an earlier start are not its epochs."""
    if not any((run_dir / name).exists() for name in ("last.pt", "last.prev.pt")):
        (run_dir / "metrics.csv").unlink(missing_ok=True)


def run_trial(command: list[str], run_dir: Path, column: str, on_epoch: Callable[[int, float], bool],
              stop: StopRequest, env: Optional[dict] = None) -> TrialOutcome:
    """Run `command` (which trains into `run_dir`) to its end; `on_epoch(epoch, value)` is called once per new
    validated epoch, in order, until it answers True (prune): then the child is stopped with SIGTERM."""
    run_dir.mkdir(parents=True, exist_ok=True)
    forget_unsaved_rows(run_dir)
    started = time.perf_counter()
    outcome = TrialOutcome(exit_code=0)
    with (run_dir / "output.log").open("a") as output:
        child = subprocess.Popen(command, env={**os.environ, **(env or {})}, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        stop.child = child
        if stop.signum is not None:  # a signal came between the trials' start and here
            child.send_signal(signal.SIGTERM)
        try:
            seen: set[int] = set()
            while True:
                code = child.poll()
                if outcome.pruned_epoch is None and stop.signum is None:
                    outcome.pruned_epoch = _report_new(run_dir / "metrics.csv", column, seen, on_epoch)
                    if outcome.pruned_epoch is not None and code is None:
                        child.send_signal(signal.SIGTERM)
                if code is not None:
                    break
                time.sleep(POLL_S)
        finally:
            stop.child = None
            if child.poll() is None:  # an error in the study itself: the trial must not train on alone
                child.send_signal(signal.SIGTERM)
                child.wait()
    outcome.exit_code = child.returncode
    outcome.signum = stop.signum
    outcome.seconds = time.perf_counter() - started
    return outcome


def _report_new(path: Path, column: str, seen: set[int], on_epoch) -> Optional[int]:
    """Hand the epochs not seen yet to `on_epoch`; the epoch it pruned after, or None."""
    for epoch, value in epoch_values(path, column):
        if epoch in seen:
            continue
        seen.add(epoch)
        if on_epoch(epoch, value):
            return epoch
    return None


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

    names = ["history.png", "slice.png"] + (["importances.png"] if complete >= 2 and len(plan.dims) > 1 else [])
    for name in names:
        figure = draw_plot(name, study, plan.metric)
        tmp = plan.study_dir / f".{name}.{os.getpid()}.tmp.png"
        figure.savefig(tmp, dpi=100, bbox_inches="tight")
        plt.close(figure)
        os.replace(tmp, plan.study_dir / name)
    return [plan.study_dir / name for name in names]


def draw_plot(name: str, study, metric: str):
    """The matplotlib figure of one of Optuna's plots (`history.png`, `slice.png`, `importances.png`), its x tick
    labels readable (`readable_x_ticks`)."""
    from optuna.visualization import matplotlib as plots

    draw = {"history.png": plots.plot_optimization_history, "slice.png": plots.plot_slice,
            "importances.png": plots.plot_param_importances}[name]
    # matplotlib says at INFO that a slice of numeric choices is drawn as categories, which is meant
    logging.getLogger("matplotlib.category").setLevel(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
        axes = draw(study, target_name=metric) if name != "importances.png" else draw(study)
    figure = (axes.flat[0] if hasattr(axes, "flat") else axes).figure
    readable_x_ticks(figure)
    return figure


def readable_x_ticks(figure) -> None:
    """A log axis spanning a decade or two (an LR in [0.01, 0.3]) gets its minor ticks labelled too
    (2x10^-2, 3x10^-2, ...), which overlap in a slice plot's narrow panels: label log axes at 1-2-5 steps in
    plain numbers (decades alone over two or more), then keep, left to right, only the labels clear of the one
    kept before them."""
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, LogLocator, NullFormatter

    for ax in figure.axes:
        if ax.get_xscale() == "log":
            low, high = sorted(ax.get_xlim())
            # every tick asked for (matplotlib's own thinning of 1-2-5 steps can leave none); overlaps go below
            subs = (1.0, 2.0, 5.0) if math.log10(high / low) < 2 else (1.0,)
            ax.xaxis.set_major_locator(LogLocator(base=10, subs=subs, numticks=100))
            ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.xaxis.set_minor_formatter(NullFormatter())
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    for ax in figure.axes:
        low, high = sorted(ax.get_xlim())
        shown = sorted([(tick.get_loc(), tick.label1) for tick in ax.xaxis.get_major_ticks()
                        if tick.label1.get_visible() and tick.label1.get_text() and low <= tick.get_loc() <= high],
                       key=lambda pair: pair[0])
        kept, last = [], None
        for loc, label in shown:
            box = label.get_window_extent(renderer)
            if last is None or not box.overlaps(last):
                kept.append(loc)
                last = box
        if len(kept) < len(shown):
            ax.xaxis.set_major_locator(FixedLocator(kept))


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


STUDY_NAME = "search"


EXIT_SIGNAL = {signal.SIGTERM: 143, signal.SIGINT: 130, signal.SIGUSR1: 138}


# failed trials in a row (a crash, a diverged run) after which the study stops: something is wrong with all of them
MAX_FAILURES_IN_ROW = 5


PRUNED_MARKER = "PRUNED"


@dataclass
class SearchPlan:
    config: str
    overrides: list[str]
    dims: list[Dimension]
    trials: int
    study_dir: Path
    metric: str  # the deciding metric: val_<metric> in metrics.csv, best[<metric>] in summary.json
    higher_is_better: bool
    epochs: int
    seed: int  # train.seed: the sampler's seed too
    pruner: str = "median"  # median, hyperband or none
    startup_trials: int = 2  # median: trials finished before any is pruned
    keep: str = "best"
    launcher: tuple = ()  # the train.py command before its arguments (python train.py, or torchrun ... train.py)
    tracking: object = None  # the config's TrackingConfig: tracking.backend=mlflow opens a run for the study
    experiment: str = "imgcls"  # the tracking experiment when tracking.experiment is null (the config's name)
    resolved: dict = field(default_factory=dict)  # the config's content (resolved_record): matched, not its path

    def identity(self) -> dict:
        """What makes two commands the same study (the trial count and pruner settings may change): the
        config named the same way and holding the same values."""
        return json.loads(json.dumps({"config": self.config, "overrides": self.overrides, "metric": self.metric,
                                      "space": space_record(self.dims), "resolved": self.resolved}))


def resolved_record(cfg: Config, dims: list[Dimension]) -> dict:
    """The study's resolved config (file and overrides) as flat key -> value, without what each trial sets
    itself (the searched keys, output.dir) or may change on a resume: an edit of the config file between two
    runs of one study shows here, where the file's path does not."""
    skip = {*STUDY_OWNED_KEYS, *(d.key for d in dims), *resume_free_keys()}
    return json.loads(json.dumps({k: v for k, v in flatten(cfg.to_dict()).items() if k not in skip}, default=str))


def identity_differences(recorded: dict, wanted: dict) -> list[str]:
    """What differs between a study's recorded identity and this command's, as `name value` texts; a study
    recorded before the resolved config was kept is matched on the rest."""
    differ = [f"its {k} {recorded.get(k)!r}" for k in wanted if k != "resolved" and recorded.get(k) != wanted[k]]
    if "resolved" in recorded and recorded["resolved"] != wanted["resolved"]:
        old, new = recorded["resolved"], wanted["resolved"]
        changed = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
                   if old.get(k) != new.get(k)]
        differ.append(f"its config's content changed since the study began ({'; '.join(changed[:8])}"
                      f"{' ...' if len(changed) > 8 else ''})")
    return differ


def lock_study(study_dir: Path) -> int:
    """An exclusive lock on DIR/.lock for the study's process (a second tune.py on the same study is refused:
    a trial it finds running would be another process's); returns the descriptor, held until exit."""
    study_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(study_dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
        os.close(fd)
        raise ConfigError(f"--study {study_dir} is in use by another tune.py (pid {holder or '?'}); wait for it "
                          f"to end, stop it, or pass another --study") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def make_pruner(plan: SearchPlan):
    import optuna

    if plan.pruner == "hyperband":
        searched = any(d.key == "train.epochs" for d in plan.dims)
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource="auto" if searched else plan.epochs)
    if plan.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=plan.startup_trials, n_warmup_steps=0)
    return optuna.pruners.NopPruner()


def open_study(plan: SearchPlan):
    """DIR/study.db's study, created on the first run; a study of another config or space is refused (exit 2)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{(plan.study_dir / 'study.db').resolve()}"
    study = optuna.create_study(storage=storage, study_name=STUDY_NAME, load_if_exists=True,
                                direction="maximize" if plan.higher_is_better else "minimize",
                                sampler=optuna.samplers.TPESampler(seed=plan.seed), pruner=make_pruner(plan))
    drawn = len(study.get_trials(deepcopy=False))
    if drawn:  # a continued study: the sampler's random draws go on from where they were, not again from the seed
        study.sampler = optuna.samplers.TPESampler(seed=plan.seed + drawn)
    recorded, wanted = study.user_attrs.get("search"), plan.identity()
    differ = [] if recorded is None else identity_differences(recorded, wanted)
    if differ:
        raise ConfigError(f"--study {plan.study_dir} holds a study of another search ({'; '.join(differ)}): its "
                          f"trials and these would be ranked against each other. Re-run its own command with its own "
                          f"config to continue it, or pass a new --study DIR")
    if recorded != wanted:
        study.set_user_attr("search", wanted)
    return study


def finished_count(study) -> int:
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))


def run_search(plan: SearchPlan) -> int:
    """Run trials until `plan.trials` are finished; 0, 1 (trials keep failing) or the status of a stop signal
    (the running trial saved; the same command continues)."""
    lock_study(plan.study_dir)
    study = open_study(plan)
    tracking = open_tracking(study, plan)
    stop = StopRequest()
    previous = {sig: signal.signal(sig, stop.handle) for sig in EXIT_SIGNAL}
    try:
        code = _run_trials(study, plan, stop, tracking)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    files = finish_study(study, plan, done=code == 0)
    if tracking is not None:
        tracking.close(files, finished=code == 0)
    return code


def open_tracking(study, plan: SearchPlan):
    """tracking.backend=mlflow: the study's run (the one an earlier process opened, when continued)."""
    if plan.tracking is None or plan.tracking.backend == "none":
        return None
    from imgcls.tracking.runs import StudyTracking

    tracking = StudyTracking(plan.tracking, plan.study_dir, plan.experiment, study.user_attrs.get("tracking_run_id"))
    if tracking.run_id:
        study.set_user_attr("tracking_run_id", tracking.run_id)
    return tracking


def _run_trials(study, plan: SearchPlan, stop: StopRequest, tracking=None) -> int:
    from optuna.trial import TrialState

    failures = 0
    while finished_count(study) < plan.trials:
        if stop.signum is not None:
            return EXIT_SIGNAL[stop.signum]
        trial = _next_trial(study)
        outcome, state = _run_one(study, trial, plan, stop, tracking.trial_environment() if tracking else {})
        if outcome.signum is not None:
            return EXIT_SIGNAL[outcome.signum]
        if tracking is not None:
            finished = study.get_trials(deepcopy=False)[trial.number]
            tracking.log_trial(trial.number, finished.params, state.name, finished.value)
        failures = failures + 1 if state == TrialState.FAIL else 0
        if state == TrialState.FAIL and (outcome.exit_code == 2 or failures >= MAX_FAILURES_IN_ROW):
            log.error("search: stopping: %s", "the trial's config was refused (exit 2)" if outcome.exit_code == 2
                      else f"{failures} trials in a row failed")
            return 1
    return 0


def _next_trial(study):
    """A trial an earlier process left running (this process holds the study's lock, so none is running now),
    else a new (or enqueued) one."""
    import optuna
    from optuna.trial import TrialState

    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    if running:
        log.info("search: trial %d was interrupted; continuing it from its last.pt", running[0].number)
        return optuna.trial.Trial(study, running[0]._trial_id)
    return study.ask()


def _run_one(study, trial, plan: SearchPlan, stop: StopRequest, env: dict) -> tuple[TrialOutcome, Optional[object]]:
    """Train the trial and tell the study how it ended; (outcome, the trial's state, None while it runs on)."""
    from optuna.trial import TrialState

    values = suggest(trial, plan.dims)
    frozen = study.get_trials(deepcopy=False)[trial.number]
    run_dir = plan.study_dir / "trials" / str(trial.number)
    described = " ".join(override_text(k, v) for k, v in values.items())
    log.info("search: trial %d: %s", trial.number, described)
    epochs = values.get("train.epochs", plan.epochs)
    reported = set(frozen.intermediate_values)

    def on_epoch(epoch: int, value: float) -> bool:
        if epoch not in reported:
            trial.report(value, epoch)
            reported.add(epoch)
        return epoch < epochs and trial.should_prune()

    if reported and max(reported) < epochs and trial.should_prune():  # decided before an interruption
        outcome = TrialOutcome(exit_code=0, pruned_epoch=max(reported))
    else:
        command = [*plan.launcher, "--config", plan.config, *plan.overrides,
                   *(override_text(k, v) for k, v in values.items()), f"output.dir={run_dir}", "--resume", "auto"]
        outcome = run_trial(command, run_dir, f"val_{plan.metric}", on_epoch, stop, env)
    trial.set_user_attr("wall_s", frozen.user_attrs.get("wall_s", 0.0) + outcome.seconds)
    if outcome.pruned_epoch is None and outcome.signum is None:  # the trial alone was stopped: it saved, as after ours
        outcome.signum = next((sig for sig, code in EXIT_SIGNAL.items() if code == outcome.exit_code), None)
    if outcome.signum is not None:
        return outcome, None
    if outcome.pruned_epoch is not None:
        value = frozen_value(study, trial.number, outcome.pruned_epoch)
        write_marker(run_dir / PRUNED_MARKER, f"pruned by the {plan.pruner} pruner after epoch {outcome.pruned_epoch}: "
                                              f"val_{plan.metric} {value}\n")
        study.tell(trial, state=TrialState.PRUNED)
        log.info("search: trial %d pruned after epoch %d (val_%s %s)", trial.number, outcome.pruned_epoch,
                 plan.metric, value)
        return outcome, TrialState.PRUNED
    value = best_value(run_dir, plan.metric) if outcome.exit_code == 0 else None
    if value is None:
        log.error("search: trial %d failed (exit %d%s); its output: %s", trial.number, outcome.exit_code,
                  "" if outcome.exit_code else f", no finite best {plan.metric}", run_dir / "output.log")
        study.tell(trial, state=TrialState.FAIL)
        return outcome, TrialState.FAIL
    study.tell(trial, value)
    log.info("search: trial %d complete: %s %.6g", trial.number, plan.metric, value)
    return outcome, TrialState.COMPLETE


def frozen_value(study, number: int, epoch: int) -> Optional[float]:
    return study.get_trials(deepcopy=False)[number].intermediate_values.get(epoch)


def best_value(run_dir: Path, metric: str) -> Optional[float]:
    """The trial's result: its best.pt's value of the deciding metric (summary.json `best`)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    value = (summary.get("best") or {}).get(metric)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def write_marker(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
