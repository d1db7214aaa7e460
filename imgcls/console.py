"""The console commands `pip install .` makes (pyproject.toml's [project.scripts]): each runs its entry
script's `main` as `python <script>.py` does."""
from __future__ import annotations

import importlib

from commands.cli import run_main


def _run(script: str) -> None:
    run_main(importlib.import_module(script).main)


def train() -> None:
    _run("train")


def evaluate() -> None:
    _run("eval")


def infer() -> None:
    _run("infer")


def export() -> None:
    _run("export")


def serve() -> None:
    _run("serve")


def tune() -> None:
    _run("tune")


def audit() -> None:
    _run("audit")


def benchmark() -> None:
    _run("benchmark")


def embed() -> None:
    _run("embed")


def search() -> None:
    _run("search")
