"""The objectives, registered in `OBJECTIVES`; the run's is chosen by its config (`objective_name`) and built
once by `build_objective`."""
from __future__ import annotations

from typing import Optional

import torch

from imgcls.objectives.base import Objective
from imgcls.objectives.distillation import build_distiller, check_no_teacher
from imgcls.objectives.incremental import KEY as INCREMENTAL, build_incremental, check_not_extended, checked_base
from imgcls.objectives.semi import build_semi, check_no_semi, check_semi
from imgcls.objectives.teacher import check_teacher
from imgcls.tasks import task_of


def build_task_objective(cfg, classes: Optional[list[str]], model: torch.nn.Module,
                         device: torch.device) -> Objective:
    return Objective(task_of(cfg).criterion(cfg.train))


OBJECTIVES = {"task": build_task_objective, "distill": build_distiller, INCREMENTAL: build_incremental,
              "semi": build_semi}


def objective_name(cfg) -> str:
    """semi.method, incremental.base and distill.teacher exclude each other (their settings)."""
    if cfg.incremental.base:
        return INCREMENTAL
    if cfg.semi.method != "none":
        return "semi"
    return "distill" if cfg.distill.teacher else "task"


def check_objective(cfg) -> None:
    """Before any work (exit 2): what the objective needs can be had (distillation: a teacher that can teach;
    semi-supervised: a single-label task, unlabelled images that can be read)."""
    if objective_name(cfg) == "distill":
        check_teacher(cfg)
    elif objective_name(cfg) == INCREMENTAL:
        checked_base(cfg, fresh=True)
    elif objective_name(cfg) == "semi":
        check_semi(cfg)


def build_objective(cfg, classes: Optional[list[str]], model: torch.nn.Module, device: torch.device) -> Objective:
    """The run's objective around the bare `model`. `classes` None: for measuring a step's cost only (tune.py's
    batch finder on synthetic data), nothing is checked against the data."""
    return OBJECTIVES[objective_name(cfg)](cfg, classes, model, device)


def check_resume_objective(ckpt: dict, objective: Objective) -> None:
    """--resume continues with the objective the checkpoint was trained with (ConfigError, exit 2)."""
    objective.check_resume(ckpt)
    if objective.name != "distill":
        check_no_teacher(ckpt)
    if objective.name != INCREMENTAL:
        check_not_extended(ckpt)
    if objective.name != "semi":
        check_no_semi(ckpt)
