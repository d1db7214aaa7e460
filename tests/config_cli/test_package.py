"""What `pip install .` gives: one package, imgcls, with its configs inside; one command, `imgcls COMMAND`; the
optional stacks as extras, named when missing (exit 2 before any work); requirements.txt is the plain install and
every extra; a user's own `data` or `models` package beside an installed imgcls is not shadowed."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from conftest import REPO, make_tree

from imgcls.cli import COMMANDS, EXTRAS, OUTSIDE_ALL

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def requirement_name(requirement: str) -> str:
    return re.split(r"[<>=!~ ;\[]", requirement.strip())[0].lower()


def requirement_lines(path: Path) -> set[str]:
    return {line.split("#")[0].strip() for line in path.read_text().splitlines() if line.split("#")[0].strip()}


def test_pyproject_installs_one_package_and_one_command():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["packages"]["find"]["include"] == ["imgcls", "imgcls.*"]
    assert "py-modules" not in setuptools
    assert PROJECT["scripts"] == {"imgcls": "imgcls.cli:main"}


# extras for working on the project rather than a command's optional stack: not in [all], requirements.txt or
# imgcls.cli.EXTRAS; requirements-dev.txt pins the same distributions
WORKING_EXTRAS = {"docs"}


def test_requirements_txt_is_the_plain_install_and_every_extra():
    """...every extra of [all]: OUTSIDE_ALL's are installed on their own."""
    extras = PROJECT["optional-dependencies"]
    inside = [name for name in extras if name != "all" and name not in OUTSIDE_ALL and name not in WORKING_EXTRAS]
    assert extras["all"] == [f"imgcls[{','.join(inside)}]"]
    whole = set(PROJECT["dependencies"]) | {r for name in inside for r in extras[name]}
    assert requirement_lines(REPO / "requirements.txt") == whole


def test_the_docs_extra_installs_what_the_readme_serves_the_site_with():
    """Issue 64: the README said `mkdocs serve` while mkdocs was only in requirements-dev.txt. `.[docs]` installs
    it, the README names that extra where it shows the command, and requirements-dev.txt pins the same."""
    docs = {requirement_name(r) for r in PROJECT["optional-dependencies"]["docs"]}
    dev = {requirement_name(line) for line in requirement_lines(REPO / "requirements-dev.txt")}
    assert docs == {"mkdocs", "mkdocs-material"} and docs <= dev
    readme = (REPO / "README.md").read_text()
    first = readme.index("mkdocs serve")
    assert '.[docs]"' in readme[max(0, first - 200):first], readme[max(0, first - 200):first + 40]


def test_each_extra_brings_the_modules_the_commands_ask_for():
    """imgcls.cli.EXTRAS (what a command checks) and pyproject's extras (what pip installs) name the same
    stacks, and each module a command asks for is installed by a distribution of its extra."""
    extras = PROJECT["optional-dependencies"]
    assert set(EXTRAS) == set(extras) - {"all"} - WORKING_EXTRAS
    installed_by = packages_distributions()
    for extra, modules in EXTRAS.items():
        names = {requirement_name(r) for r in extras[extra]}
        if extra in OUTSIDE_ALL:  # not installed by [all]: each module is its distribution's name
            assert {module.replace("_", "-") for module in modules} <= names, (extra, modules)
            continue
        for module in modules:
            installed = next(name for name in module.split("|") if name in installed_by)
            assert {d.lower() for d in installed_by[installed]} & names, (extra, module)


def imgcls_command(*args: str, cwd: Path = REPO, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "imgcls", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, **(env or {})))


def test_imgcls_help_lists_every_command_and_an_unknown_one_exits_2():
    shown = imgcls_command("--help")
    assert shown.returncode == 0
    assert all(re.search(rf"^  {name} +\S", shown.stdout, re.M) for name in COMMANDS), shown.stdout
    assert imgcls_command().returncode == 2
    typo = imgcls_command("trian", "--config", "quickstart")
    assert typo.returncode == 2 and "did you mean 'train'" in typo.stderr


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_takes_its_script_s_arguments(command):
    shown = imgcls_command(command, "--help")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith(f"usage: imgcls {command}")
    assert "loading torch" not in shown.stderr


def blocked(module: str, argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`imgcls ARGV` with `module` unimportable, as where its extra was never installed."""
    code = f"import sys; sys.modules[{module!r}] = None; from imgcls.cli import main; main({argv!r})"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))


@pytest.mark.parametrize("extra, module, argv", [
    ("tune", "optuna", ["tune", "--config", "quickstart", "--search", "space.yaml", "--trials", "1", "--study", "st"]),
    ("audit", "cleanlab", ["audit", "--config", "base", "data.root=data"]),
    ("embed", "faiss", ["embed", "data", "--checkpoint", "best.pt", "--output", "vectors"]),
    ("embed", "faiss", ["search", "q.png", "--index", "vectors"]),
    ("export", "onnxruntime", ["export", "--checkpoint", "best.pt", "--format", "onnx", "--output", "m.onnx"]),
    ("openvino", "openvino", ["export", "--checkpoint", "best.pt", "--format", "openvino", "--output", "ir"]),
    ("executorch", "executorch", ["export", "--checkpoint", "best.pt", "--format", "executorch", "--output", "m.pte"]),
    ("litert", "litert_torch", ["export", "--checkpoint", "best.pt", "--format", "litert", "--output", "m.tflite"]),
    ("executorch", "executorch", ["infer", "data", "--checkpoint", "m.pte"]),
    ("litert", "ai_edge_litert", ["eval", "--checkpoint", "m.tflite"]),
    ("serve", "fastapi", ["serve", "--checkpoint", "best.pt"]),
    ("export", "onnxruntime", ["infer", "data", "--checkpoint", "m.onnx"]),
    ("explain", "pytorch_grad_cam", ["infer", "data", "--checkpoint", "best.pt", "--explain", "cams"]),
    ("export", "onnxruntime", ["eval", "--checkpoint", "m.onnx"]),
    ("serve", "uvicorn", ["serve", "--checkpoint", "m.onnx"]),
])
def test_a_command_whose_extra_is_missing_exits_2_naming_the_extra(tmp_path, extra, module, argv):
    """(onnx and onnxscript export; running an .onnx file takes onnxruntime alone, as in the slim image.)"""
    make_tree(tmp_path / "data", {"a": 2, "b": 2})
    done = blocked(module, argv, tmp_path)
    assert done.returncode == 2, done.stderr
    assert f'pip install "imgcls[{extra}]"' in done.stderr
    assert "loading torch" not in done.stderr  # before any work
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # nothing written


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip install .` would install, built from a copy of the tracked files (so the build leaves
    nothing in the working copy)."""
    source = tmp_path_factory.mktemp("source")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        origin, copy = REPO / name, source / name
        copy.parent.mkdir(parents=True, exist_ok=True)
        if origin.is_symlink():
            copy.symlink_to(os.readlink(origin))
        elif origin.is_file():
            shutil.copy2(origin, copy)
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(out), str(source)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    return next(out.glob("imgcls-*.whl"))


@pytest.mark.slow
def test_the_wheel_holds_imgcls_alone_with_its_configs(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"imgcls", next(n for n in names if ".dist-info/" in n)
                                                      .split("/")[0]}
    assert "imgcls/configs/quickstart.yaml" in names and "imgcls/configs/base.yaml" in names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "imgcls = imgcls.cli:main" in entry_points


@pytest.mark.slow
def test_a_user_package_named_data_or_models_beside_an_installed_imgcls_is_its_own(wheel, tmp_path):
    """A user's project with its own data/ and models/ packages imports imgcls's API and its own packages, and
    `--config quickstart` resolves inside the installed package, from any directory."""
    site = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                                str(wheel)], capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr[-2000:]
    project = tmp_path / "project"
    for package in ("data", "models"):
        (project / package).mkdir(parents=True)
        (project / package / "__init__.py").write_text(f"OWNER = 'the user: {package}'\n")
    code = ("import data, models, imgcls\n"
            "from imgcls import Classifier, load_config\n"
            "from imgcls.data.transforms import EvalTransform\n"
            "cfg = load_config('quickstart', {'train.epochs': 2})\n"
            "print(data.OWNER, '|', models.OWNER, '|', imgcls.__file__, '|', cfg.train.epochs)\n")
    env = dict(os.environ, PYTHONPATH=str(site))
    done = subprocess.run([sys.executable, "-c", code], cwd=project, capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    owner_data, owner_models, location, epochs = [part.strip() for part in done.stdout.split("|")]
    assert (owner_data, owner_models, epochs) == ("the user: data", "the user: models", "2")
    assert Path(location).is_relative_to(site)
    shown = imgcls_command("train", "--help", cwd=project, env={"PYTHONPATH": str(site)})
    assert shown.returncode == 0 and "quickstart" in shown.stdout


def test_running_an_onnx_file_needs_onnxruntime_alone(tmp_path):
    """The slim serving image installs onnxruntime, not the exporter's onnx / onnxscript: serve and infer on an
    .onnx file pass the extra check without them (and fail later only because m.onnx does not exist)."""
    for argv in (["infer", "x.png", "--checkpoint", "m.onnx"], ["serve", "--checkpoint", "m.onnx"]):
        code = ("import sys; sys.modules.update(onnx=None, onnxscript=None); from imgcls.cli import main; "
                f"main({argv!r})")
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert "imgcls[export]" not in done.stderr, done.stderr
