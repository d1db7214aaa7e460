"""The architecture holds: each layer imports only from the layers below it, each room only from the
rooms before it, and no two modules import each other (module-level or inside a function). A package's config
section lives in its `settings` module, which sits at core's level and imports nothing but the standard library,
core and other settings modules; imgcls/config.py composes them into the tree, so core itself imports nothing
above it."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from conftest import REPO

# the rooms under imgcls/, lowest first; a module may import its own room and the ones before it
LEVELS = ["core", "tasks", "config", "data", "models", "tracking", "compute", "evaluation", "model_files",
          "embedding", "objectives", "incremental", "training", "tuning", "auditing", "labelling", "commands",
          "benchmarking", "serving", "cli"]
PACKAGE = REPO / "imgcls"


def is_settings(module: str) -> bool:
    """A config section's declaration: torch-free, at core's level."""
    last = module.split(".")[-1]
    return last == "settings" or last.endswith("_settings")


def room_of(module: str) -> str:
    """`imgcls.data.images` -> `data`; the package itself and `imgcls.__main__` sit at the top."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] != "__main__" else "top"


def level_of(module: str) -> int | None:
    room = room_of(module)
    if is_settings(module) or room == "core":
        return LEVELS.index("core")
    if room == "top":
        return len(LEVELS)
    if room == "models":  # data and models sit side by side
        return LEVELS.index("data")
    return LEVELS.index(room) if room in LEVELS else None


def project_modules() -> dict[str, Path]:
    """Every module of the package, by its dotted name (the entry shims beside it import only imgcls.cli)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
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
    assert "imgcls.training.trainer" in modules and "imgcls.compute.device" in modules
    graph = {name: imports_of(path, set(modules)) - {name} for name, path in modules.items()}
    upward = [f"{name} imports {target}" for name, targets in graph.items() for target in targets
              if level_of(target) > level_of(name)]
    mutual = sorted({" <-> ".join(sorted((a, b))) for a, targets in graph.items() for b in targets if a in graph[b]})
    assert upward == [] and mutual == []


def test_the_bottom_layer_imports_nothing_above_it():
    """core/ is the config machinery, errors, files and host facts: it imports only core (the tree of sections is
    assembled in imgcls/config.py, where it is used)."""
    modules = project_modules()
    upward = [f"{name} imports {target}" for name, path in modules.items() if room_of(name) == "core"
              for target in imports_of(path, set(modules)) if room_of(target) != "core"]
    assert upward == []


def test_only_the_task_package_and_config_validation_ask_which_kind_of_label_this_is():
    """The rest of the code asks the Task (tasks/), never `data.task`: no conditional on `data.task` or on a
    `multilabel` flag outside tasks/ and imgcls/config.py."""
    import re

    asks = re.compile(r"\b(if|elif)\b.*(\.task\s*[!=]=|data\.task\b|\bmultilabel\b|\bmulticlass\b)")
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
             for name, path in project_modules().items() if room_of(name) != "tasks" and name != "imgcls.config"
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if asks.search(line.split("#")[0]) and not line.strip().startswith(("#", '"', "'"))]
    assert found == [], "\n".join(found)


def test_house_rules_no_function_over_70_lines_no_class_over_300():
    long = []
    for name, path in project_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            limit = 70 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else \
                300 if isinstance(node, ast.ClassDef) else None
            if limit and node.end_lineno - node.lineno + 1 > limit:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines (limit {limit})")
    assert long == [], "\n".join(long)


def test_no_top_level_room_holds_more_than_30_percent_of_the_code():
    lines: dict[str, int] = {}
    for name, path in project_modules().items():
        top = room_of(name)
        lines[top] = lines.get(top, 0) + len(path.read_text().splitlines())
    total = sum(lines.values())
    assert max(lines.values()) <= 0.3 * total, {k: round(v / total, 2) for k, v in sorted(lines.items())}


def all_imports_of(path: Path) -> set[str]:
    """Every module a file imports (module level or inside a function), as written."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_settings_modules_import_only_the_standard_library_core_and_settings():
    modules = project_modules()
    settings = {name: path for name, path in modules.items() if is_settings(name)}
    assert {"imgcls.data.settings", "imgcls.models.settings", "imgcls.training.settings", "imgcls.tracking.settings", "imgcls.training.settings",
            "imgcls.objectives.settings", "imgcls.data.settings"} <= set(settings)
    wrong = [f"{name} imports {target}" for name, path in settings.items() for target in all_imports_of(path)
             if not (target.split(".")[0] in sys.stdlib_module_names or target == "__future__"
                     or target.startswith("imgcls.core.") or is_settings(target))]
    assert wrong == []


def test_loading_validating_and_documenting_a_config_imports_no_torch():
    """A fresh interpreter: every settings module, the config machinery and the reference generator, one config
    loaded and validated with overrides of every section, and torch (nor timm, PIL) is never imported (NumPy may be: the tasks' rows are NumPy, as the slim server's)."""
    settings = sorted(name for name in project_modules() if is_settings(name))
    code = (f"import importlib, sys\n"
            f"for name in {settings!r}: importlib.import_module(name)\n"
            f"from imgcls.config import load_config\n"
            f"from imgcls.config import render_base_yaml, render_page\n"
            f"render_base_yaml(); render_page()\n"
            f"load_config('resnet50_a3', ['optim.name=adan', 'optim.options.no_prox=true', 'distill.teacher=t.pt', "
            f"'data.format=csv', 'data.train_csv=t.csv', 'data.val_fraction=0.2', 'tracking.backend=mlflow'])\n"
            f"print(sorted(m for m in ('torch', 'timm', 'PIL') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
