"""`tune.py --search`: an Optuna study (TPE sampler, median or Hyperband pruner) in `DIR/study.db` whose trials
are train.py runs in `DIR/trials/<number>/` (tuning/search_trial.py). The study is resumable: the same command
continues it, taking up a trial that an earlier process left running (killed, or stopped by a signal) from its
last.pt, so no trial is lost or counted twice, until N trials are finished (complete or pruned)."""
from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from imgcls.core.errors import ConfigError
from imgcls.tuning.search_space import Dimension, override_text, space_record, suggest
from imgcls.tuning.search_trial import StopRequest, TrialOutcome, run_trial

log = logging.getLogger(__name__)

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

    def identity(self) -> dict:
        """What makes two commands the same study (the trial count and pruner settings may change)."""
        return json.loads(json.dumps({"config": self.config, "overrides": self.overrides, "metric": self.metric,
                                      "space": space_record(self.dims)}))


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
    if recorded is None:
        study.set_user_attr("search", wanted)
    elif recorded != wanted:
        differ = [k for k in wanted if recorded.get(k) != wanted[k]]
        raise ConfigError(f"--study {plan.study_dir} holds a study of another search (its {', '.join(differ)} "
                          f"differ: {', '.join(f'{k} {recorded.get(k)!r}' for k in differ)}); re-run its own "
                          f"command to continue it, or pass a new --study DIR")
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
    from imgcls.tuning.search_report import finish_study

    files = finish_study(study, plan, done=code == 0)
    if tracking is not None:
        tracking.close(files, finished=code == 0)
    return code


def open_tracking(study, plan: SearchPlan):
    """tracking.backend=mlflow: the study's run (the one an earlier process opened, when continued)."""
    if plan.tracking is None or plan.tracking.backend == "none":
        return None
    from imgcls.tracking.search import StudyTracking

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
