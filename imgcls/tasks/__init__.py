"""The kinds of label, registered in one place. A new kind is one module with a `Task` subclass
(tasks/base.py says what it answers) and one entry in TASKS."""
from __future__ import annotations

from typing import Optional

from imgcls.core.errors import ConfigError
from imgcls.tasks.base import LOSS, SHARED_METRICS, Metric, Task
from imgcls.tasks.multi_label import MultiLabel
from imgcls.tasks.single_label import SingleLabel

TASKS: dict[str, Task] = {task.name: task for task in (SingleLabel(), MultiLabel())}


def get_task(name: str) -> Task:
    return TASKS[name]


def task_of(cfg) -> Task:
    """The task of a config (its `data.task`)."""
    return TASKS[cfg.data.task]


def check_config(cfg, explicit: set[str]) -> None:
    """Config validation of `data.task`: its Task's own checks, then early_stop.metric against the metrics it
    declares selectable."""
    if cfg.data.task not in TASKS:
        raise ConfigError(f"'data.task' = {cfg.data.task!r}: one of {', '.join(TASKS)}")
    task = task_of(cfg)
    task.check_config(cfg, explicit)
    names = task.selectable_metrics()
    if cfg.early_stop.metric not in names:
        owner = owner_of_metric(cfg.early_stop.metric)
        where = f"needs data.task={owner.name}; " if owner is not None else "is no metric; "
        raise ConfigError(f"'early_stop.metric' = {cfg.early_stop.metric} {where}with data.task={task.name} use "
                          f"one of {', '.join(names)}")


def owner_of_metric(name: str) -> Optional[Task]:
    """The first task that declares `name` selectable (for messages), or None."""
    return next((task for task in TASKS.values() if name in task.selectable_metrics()), None)


def metric_named(name: str) -> Metric:
    """A declared metric by name, whichever task declares it (the same name means the same thing)."""
    return next(m for task in TASKS.values() for m in task.metrics if m.name == name)


def is_improvement(value: float, best: Optional[float], metric: str, min_delta: float) -> bool:
    return metric_named(metric).is_improvement(value, best, min_delta)


def deciding_metric(metrics: dict, metric: str) -> str:
    """The metric that chooses best.pt and drives early stopping and the plateau schedule: `metric`, or the loss
    where `metric` is undefined for the split (None: multi-label mAP of a split where no image carries a tag)."""
    return metric if metrics.get(metric) is not None else LOSS.name


def best_record(metrics: dict) -> dict:
    """summary.json's and best.pt's `best`: the declared metrics of a validation that are kept there."""
    kept = [m.name for task in TASKS.values() for m in task.metrics if m.in_best]
    kept += [m.name for m in SHARED_METRICS if m.in_best]
    return {name: metrics[name] for name in dict.fromkeys(kept) if name in metrics}


def csv_metric_columns() -> list[str]:
    """metrics.csv's validation columns: every task's, each named once, in registration order."""
    names = [m.name for task in TASKS.values() for m in task.metrics if m.in_csv]
    names += [m.name for m in SHARED_METRICS if m.in_csv]
    return [f"val_{name}" for name in dict.fromkeys(names)]


def selectable_metrics() -> list[str]:
    """Every value early_stop.metric may take, over all tasks."""
    return list(dict.fromkeys(name for task in TASKS.values() for name in task.selectable_metrics()))
