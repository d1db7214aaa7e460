"""`Objective`: what one micro-batch's loss is. The epoch calls `loss, logs = objective(model, images, targets)`
and knows nothing else about it; a run's objective is chosen once (`objectives.build_objective`) and saved
and restored with the run through `state_dict` / `load_state_dict`, like every other part.

Besides the loss, an objective may train parameters of its own (`parameters`, an optimizer group), average
their gradients at a window's end under DDP (`end_window`), add figures to the step line (`interval_logs`),
look at the validation split before the first step (`prepare`), release what it holds (`close`), wrap the evaluated
model during validation (`validation_model`, then `validation_metrics`), add a record to summary.json (`summary`),
and adjust the weights best.pt holds (`best_weights`)."""
from __future__ import annotations

from typing import Optional

import torch


class Objective:
    name = "task"
    in_best_file = False  # its state_dict is also saved in best.pt (what eval.py reads of it)

    def __init__(self, criterion: torch.nn.Module):
        self.criterion = criterion

    def __call__(self, model: torch.nn.Module, images: torch.Tensor,
                 targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """(loss, logs) of one micro-batch, under the caller's autocast; logs are detached device scalars."""
        return self.criterion(model(images), targets), {}

    def parameters(self) -> list[torch.nn.Parameter]:
        return []

    def end_window(self, distributed: bool) -> None:
        """At an accumulation window's end, before the update."""

    def interval_logs(self) -> dict:
        """Host figures for the step line (read at log lines only)."""
        return {}

    def prepare(self, val_loader, device_input, classes: list[str]) -> None:
        """Before the first step of a run (or of its resumed part)."""

    def validation_model(self, eval_model: torch.nn.Module) -> tuple[torch.nn.Module, Optional[object]]:
        """(what validation runs, its per-batch `on_outputs` or None)."""
        return eval_model, None

    def validation_metrics(self, model: torch.nn.Module) -> dict:
        """More validation metrics, read after the pass from what `validation_model` returned."""
        return {}

    def summary(self) -> dict:
        """More of summary.json."""
        return {}

    def best_weights(self, weights: dict) -> dict:
        """The weights best.pt holds, from the evaluated model's (a bare state_dict; not changed in place)."""
        return weights

    def close(self) -> None:
        """Release what the objective holds (loader workers) at the run's end, on every exit path."""

    def check_resume(self, ckpt: dict) -> None:
        """ConfigError (exit 2) when `ckpt` was trained with another objective."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
