"""The architecture holds: each layer imports only from the layers below it, each room only from the
rooms before it, and no two modules import each other (module-level or inside a function)."""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

# lowest first; a module may import its own level and the ones before it
LEVELS = ["core", "tasks", "data", "models", "tracking", "runtime", "evaluation", "model_files", "prediction",
          "embedding", "rundir", "objectives", "training", "tuning", "training_run", "auditing", "commands",
          "benchmarking", "serving"]
LAYER_OF_TOP = {"train", "eval", "infer", "export", "tune", "benchmark", "audit", "serve", "embed",
                "search"}  # entry scripts


def level_of(module: str) -> int | None:
    if module.split(".")[0] in LAYER_OF_TOP:
        return len(LEVELS)
    matches = [i for i, name in enumerate(LEVELS) if module == name or module.startswith(name + ".")]
    if module.startswith("data.") or module.startswith("models."):  # data and models sit side by side
        return LEVELS.index("data")
    if module == "tasks" or module.startswith("tasks."):  # so do core and tasks (config validation asks the task)
        return LEVELS.index("core")
    return max(matches) if matches else None


def project_modules() -> dict[str, Path]:
    modules = {}
    for path in REPO.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        if parts[0] in {"tests", ".venv", "venv", "docs", "runs", "datasets"} or parts[0].startswith("."):
            continue
        name = ".".join(p for p in parts if p != "__init__")
        if level_of(name) is not None:
            modules[name] = path
    return modules


def imports_of(path: Path, known: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            candidates = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found.update(c for c in candidates if c in known)
    return found


def test_layers_and_rooms_import_only_downwards_and_no_two_modules_import_each_other():
    modules = project_modules()
    assert "training_run.trainer" in modules and "runtime.runtime" in modules
    graph = {name: imports_of(path, set(modules)) - {name} for name, path in modules.items()}
    upward = [f"{name} imports {target}" for name, targets in graph.items() for target in targets
              if level_of(target) > level_of(name)
              and not (level_of(name) == LEVELS.index("data") and level_of(target) == LEVELS.index("data"))]
    mutual = sorted({" <-> ".join(sorted((a, b))) for a, targets in graph.items() for b in targets if a in graph[b]})
    assert upward == [] and mutual == []


def test_only_the_task_package_and_config_validation_ask_which_kind_of_label_this_is():
    """The rest of the code asks the Task (tasks/), never `data.task`: no conditional on `data.task` or on a
    `multilabel` flag outside tasks/ and core/config.py."""
    import re

    asks = re.compile(r"\b(if|elif)\b.*(\.task\s*[!=]=|data\.task\b|\bmultilabel\b|\bmulticlass\b)")
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
             for name, path in project_modules().items() if not (name == "tasks" or name.startswith("tasks."))
             and name != "core.config"
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if asks.search(line.split("#")[0]) and not line.strip().startswith(("#", '"', "'"))]
    assert found == [], "\n".join(found)
