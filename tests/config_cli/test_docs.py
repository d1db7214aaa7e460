"""The README and the documentation site say what the code does: the site builds with `mkdocs build --strict`
(a broken link, anchor or missing page fails it), the configuration reference is what configs/base.yaml gives,
and every command line they show uses flags the scripts accept and config keys and values the config accepts,
so a renamed flag or key breaks the build instead of the reader. All in-process: nothing trains, no process
starts."""
from __future__ import annotations

import ast
import contextlib
import io
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, class_image

from imgcls.config import ConfigError, all_keys, load_config

DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ENTRY_SCRIPTS = ("train.py", "eval.py", "infer.py", "export.py", "tune.py", "audit.py", "serve.py", "benchmark.py",
                 "embed.py", "search.py")
CONFIG_COMMANDS = ("train.py", "audit.py", "tune.py", "benchmark.py")  # --config CONFIG [KEY=VALUE ...]
FENCE = re.compile(r"```(?:bash|sh)?\n(.*?)```", re.S)
INLINE = re.compile(r"`(python [^`]+)`")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*$")  # data.num_workers=W: the reader puts a value there


# --- the site ---------------------------------------------------------------------------------------------

def test_mkdocs_build_strict_builds_every_page(tmp_path, monkeypatch):
    from mkdocs.commands.build import build
    from mkdocs.config import load_config as load_mkdocs_config

    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")
    monkeypatch.chdir(REPO)
    config = load_mkdocs_config(str(REPO / "mkdocs.yml"), site_dir=str(tmp_path / "site"), strict=True)
    build(config)  # strict: any warning (broken link or anchor, a page outside the nav) raises Abort
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    pages = [next(iter(entry.values())) for entry in nav]
    assert set(pages) == {p.name for p in (REPO / "docs").glob("*.md")}, "every docs page is in the nav"
    for page in pages:
        built = tmp_path / "site" / ("index.html" if page == "index.md" else f"{page[:-3]}/index.html")
        assert built.is_file(), page


def test_every_page_is_in_the_nav_the_index_and_the_readme_in_one_order():
    """The rule: every page of docs/ but the home page is listed once in mkdocs.yml's nav, in docs/index.md's
    Pages table and in the README's Documentation table, in the nav's order."""
    nav = [page for entry in yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"] for page in entry.values()
           if page != "index.md"]
    index_rows = page_rows((REPO / "docs" / "index.md").read_text().split("## Pages", 1)[1], "")
    readme_rows = page_rows((REPO / "README.md").read_text().split("## Documentation", 1)[1], "docs/")
    assert sorted(nav) == sorted(p.name for p in (REPO / "docs").glob("*.md") if p.name != "index.md")
    assert [page for page, _ in index_rows] == nav, "docs/index.md's Pages table: the nav's pages, in its order"
    # one list (issue 64: the two had drifted apart): the README's table is docs/index.md's, row for row
    assert readme_rows == index_rows, "the README's Documentation table is docs/index.md's Pages table"


def page_rows(text: str, prefix: str) -> list[tuple[str, str]]:
    """(page, the whole row with its link made relative to docs/) of the first page table in `text`, whose
    links start with `prefix`."""
    rows = re.findall(rf"^\| \[[^\]]+\]\({prefix}([a-z_]+\.md)\) \|.*\|$", text.split("\n\n#", 1)[0], re.M)
    lines = re.findall(rf"^\| \[[^\]]+\]\({prefix}[a-z_]+\.md\) \|.*\|$", text.split("\n\n#", 1)[0], re.M)
    return [(page, line.replace(f"]({prefix}{page})", f"]({page})", 1)) for page, line in zip(rows, lines)]


def test_readme_links_point_at_files_and_headings():
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", text)
    assert links
    for target, anchor in links:
        if target.startswith(("http://", "https://")):
            continue
        path = REPO / target
        assert path.exists(), f"README links to {target}, which does not exist"
        if anchor:
            slugs = {slug(h) for h in re.findall(r"^#+ (.+)$", path.read_text(), re.M)}
            assert anchor in slugs, f"README links to {target}#{anchor}; its headings give {sorted(slugs)}"


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc gives a heading."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[-\s]+", "-", text).strip("-")


def test_readme_is_short_and_keeps_the_commands_ci_runs():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 210
    assert "python train.py --config quickstart" in text
    test_command = "python -m pytest -q -n 2 --dist loadfile"
    install = 'pip install -e ".[all]" -r requirements-dev.txt'
    # the quick subset first, then the whole suite as CI runs it (issue 64)
    assert f'{install} && python -m pytest -q -m "not slow" -n 2 --dist loadfile\n{test_command}' in text
    assert 'pip install -e ".[all]" && python train.py' in text
    ci = (REPO / ".ci" / "run").read_text()
    ci_runs = [line.split(" ||")[0] for line in ci.splitlines() if line.startswith("python -m pytest")]
    assert install.replace("pip install", "pip install -q") in ci and ci_runs[0] == test_command  # the README's
    assert ci_runs[1] == f'{test_command} -m "container or slurm or labelstudio or litert"'  # and what a plain run leaves out
    first_screen = "\n".join(text.splitlines()[:60])
    for command in ("python train.py", "python infer.py", "python serve.py"):
        assert command in first_screen


# --- the configuration reference -------------------------------------------------------------------------

def test_base_yaml_and_the_reference_are_what_the_declarations_give(capsys):
    import imgcls.config as config_reference

    assert config_reference.main(["--check"]) == 0, capsys.readouterr().err


def test_configuration_reference_lists_every_key_the_config_has():
    page = (REPO / "docs" / "configuration.md").read_text()
    listed = set(re.findall(r"^\| `([a-z_]+\.[a-z_.]+)` \|", page, re.M))
    assert listed == set(all_keys())


def test_the_reference_shows_each_key_s_default_allowed_values_help_and_owner():
    from imgcls.config import render_page

    page = render_page()
    assert ("| `train.amp` | `auto` | none \\| fp16 \\| bf16 \\| auto | none \\| fp16 (CUDA, GradScaler) \\| bf16 "
            "\\| auto (") in page
    assert "| `train.epochs` | `90` | int &gt;= 1 | training epochs |" in page
    assert "| `data.label_delimiter` | `' '` | text |" in page
    # a data source declares its own keys, beside its module
    assert "`imgcls/data/settings.py`" in page and "`imgcls/training/settings.py`" in page
    assert "## `distill`\n\nDeclared in `imgcls/objectives/settings.py`.\n\nknowledge distillation" in page


def test_check_mode_fails_on_stale_files_and_write_mends_them(tmp_path, monkeypatch, capsys):
    import imgcls.config as config_reference

    base, page = tmp_path / "configs" / "base.yaml", tmp_path / "docs" / "configuration.md"
    base.parent.mkdir()
    base.write_text("data: {}\n")
    monkeypatch.setattr(config_reference, "BASE", base)
    monkeypatch.setattr(config_reference, "PAGE", page)
    monkeypatch.setattr(config_reference, "REPO", tmp_path)
    assert config_reference.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "configs/base.yaml is not what" in err and "docs/configuration.md is not what" in err
    assert "python -m imgcls.config --write" in err
    assert config_reference.main(["--write"]) == 0 and config_reference.main(["--check"]) == 0
    assert yaml.safe_load(base.read_text()) == load_config(None).to_dict()


# --- the command lines shown -----------------------------------------------------------------------------

def shown_commands() -> list[tuple[str, list[str]]]:
    """(file name, argv after `python`) for every `python SCRIPT ...` / `python -m MODULE ...` / `torchrun ...
    SCRIPT ...` command in a fenced shell block or an inline code span of the README and the docs."""
    found = []
    for doc in DOC_FILES:
        text = doc.read_text()
        lines = []
        for block in FENCE.findall(text):
            lines += block.replace("\\\n", " ").splitlines()
        lines += INLINE.findall(FENCE.sub("", text))
        for line in lines:
            for part in re.split(r"&&|;|\|\s|\bdo\b|\bthen\b", line.split(" #")[0]):
                try:
                    words = [unbracket(w) for w in shlex.split(part, comments=True)]
                except ValueError:  # an inline span cut inside quotes
                    continue
                while words and words[0] not in ("python", "torchrun"):
                    words.pop(0)
                if words[:1] == ["torchrun"]:
                    scripts = [i for i, w in enumerate(words) if w.endswith(".py")]
                    words = ["python", *words[scripts[0]:]] if scripts else []
                if len(words) >= 2:
                    found.append((doc.name, words[1:]))
    return found


def unbracket(word: str) -> str:
    """`[--flag` / `value]` of a usage line's optional parts without the brackets; `key=[a,b]` kept whole."""
    return word if "=" in word else word.strip("[]")


def script_flags(argv0: list[str]) -> set[str] | None:
    """The flags a shown command's program accepts, or None for a program that is not ours."""
    if argv0[0] == "-m":
        path = REPO / (argv0[1].replace(".", "/") + ".py")
    else:
        path = REPO / argv0[0]
    if not path.is_file():
        return None
    if path.name in ENTRY_SCRIPTS and path.parent == REPO:
        return help_flags(path)
    return parsed_flags(path)


_HELP_CACHE: dict[Path, set[str]] = {}


def help_flags(script: Path) -> set[str]:
    """The flags in the script's own `--help` (its main() run in-process: the entry scripts parse their arguments
    before importing torch)."""
    if script not in _HELP_CACHE:
        main = runpy.run_path(str(script), run_name="docs_check")["main"]
        out, argv = io.StringIO(), sys.argv
        sys.argv = [script.name, "--help"]
        try:
            with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
                main()
        finally:
            sys.argv = argv
        assert done.value.code == 0
        assert "usage:" in out.getvalue()
        _HELP_CACHE[script] = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.getvalue()))
    return _HELP_CACHE[script]


def parsed_flags(module: Path) -> set[str]:
    """The flags a module's argparse parser declares, read from its source (these modules import torch first)."""
    flags = set()
    for node in ast.walk(ast.parse(module.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return flags | {"--help"}


def test_the_docs_show_commands_of_every_entry_script():
    shown = {argv[0] for _, argv in shown_commands()}
    assert set(ENTRY_SCRIPTS) <= shown
    assert {"-m"} <= shown


def test_every_flag_shown_is_accepted():
    checked = 0
    for doc, argv in shown_commands():
        accepted = script_flags(argv)
        if accepted is None:
            continue
        rest = argv[2:] if argv[0] == "-m" else argv[1:]
        for word in rest:
            flag = word.split("=")[0]
            if flag.startswith("--"):
                assert flag in accepted, f"{doc}: `python {' '.join(argv)}` uses {flag}, which {argv[0]} " \
                                         f"{argv[1] if argv[0] == '-m' else ''} does not accept"
                checked += 1
    assert checked > 100


def overrides_of(argv: list[str]) -> list[str]:
    return [w for w in argv if re.match(r"^[a-z_]+\.[a-z_.]+=", w) and "$" not in w]


def test_every_config_key_shown_exists():
    keys = set(all_keys())
    for doc, argv in shown_commands():
        if argv[0] in ENTRY_SCRIPTS:
            for override in overrides_of(argv):
                assert override.split("=")[0] in keys, f"{doc}: `python {' '.join(argv)}`: no key {override}"


def test_the_configs_and_overrides_shown_validate():
    """`--config NAME KEY=VALUE ...` as train.py, audit.py, tune.py and benchmark.py read it: the config loads and
    validates (data paths are checked later, when the run starts, so /data/x placeholders are fine here)."""
    validated = 0
    for doc, argv in shown_commands():
        if argv[0] not in CONFIG_COMMANDS or "--config" not in argv:
            continue
        name = argv[argv.index("--config") + 1]
        if "$" in name or name.isupper():  # a shell variable, or a usage line's CONFIG
            continue
        try:
            load_config(name, [o for o in overrides_of(argv) if not PLACEHOLDER.match(o.split("=", 1)[1])])
        except ConfigError as err:
            pytest.fail(f"{doc}: `python {' '.join(argv)}`: {err}")
        validated += 1
    assert validated > 30


# --- every flag on the page of its command -----------------------------------------------------------------

COMMAND_PAGES = {"train.py": "training.md", "eval.py": "evaluation.md", "infer.py": "evaluation.md",
                 "export.py": "export.md", "serve.py": "serving.md", "tune.py": "tuning.md", "audit.py": "audit.md",
                 "benchmark.py": "performance.md", "embed.py": "embeddings.md", "search.py": "embeddings.md"}


class ParserBuilt(Exception):
    """Raised where the entry script's main() would parse its arguments: carries the parser it built."""


def declared_flags(script: str, monkeypatch) -> set[str]:
    """The long options the entry script's argparse parser declares, read from the parser its main() builds
    (in-process: the entry scripts build it before importing torch)."""
    import argparse

    def caught(parser, *args, **kwargs):
        raise ParserBuilt(parser)

    main = runpy.run_path(str(REPO / script), run_name="docs_check")["main"]
    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_known_args", caught)
        patch.setattr(sys, "argv", [script])
        with pytest.raises(ParserBuilt) as built:
            main()
    parser = built.value.args[0]
    return {flag for action in parser._actions for flag in action.option_strings
            if flag.startswith("--") and flag != "--help"}


@pytest.mark.parametrize("script", ENTRY_SCRIPTS)
def test_every_flag_of_an_entry_script_is_on_the_page_of_its_command(script, monkeypatch):
    page = (REPO / "docs" / COMMAND_PAGES[script]).read_text()
    flags = declared_flags(script, monkeypatch)
    assert flags, script
    missing = sorted(flag for flag in flags if not re.search(re.escape(flag) + r"(?![\w-])", page))
    assert not missing, f"docs/{COMMAND_PAGES[script]} does not mention {script}'s {', '.join(missing)}"


def test_the_docs_preview_and_serve_py_take_different_ports():
    """`mkdocs serve` and the README's `serve.py --port 8000` both took port 8000: the second one failed."""
    root = REPO
    serve_port = re.search(r'"--port", type=int, default=(\d+)', (root / "imgcls" / "cli" / "serve.py").read_text()).group(1)
    site = yaml.safe_load((root / "mkdocs.yml").read_text())
    assert site["dev_addr"].rsplit(":", 1)[1] != serve_port
    documented = re.findall(r"mkdocs serve( -a [\d.:]+)?", (root / "README.md").read_text()
                            + (root / "docs" / "index.md").read_text())
    assert documented and all(f"127.0.0.1:{site['dev_addr'].rsplit(':', 1)[1]}" in a for a in documented)


def test_the_architecture_page_names_rooms_and_files_that_exist_and_every_room():
    """docs/architecture.md is true to the code: each room of its table is a subpackage (or module) of imgcls, each
    file a row names exists in that room, each path elsewhere on the page exists, and no room is left out."""
    page = (REPO / "docs" / "architecture.md").read_text()
    package = REPO / "imgcls"
    table = page.split("## The rooms, lowest first")[1].split("\n## ")[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    rooms = [re.match(r"\| `([\w./]+)`", row).group(1) for row in rows]
    missing = [room for room in rooms if not (package / room).exists()]
    for row, room in zip(rows, rooms):
        folder = package / room if room.endswith("/") else package
        missing += [f"{room}{name}" for name in re.findall(r"`([\w/]+\.py)`", row)
                    if not (folder / name).exists() and not (package / name).exists()]
    rest = page.replace(table, "")
    missing += [path for path in re.findall(r"`([\w]+/[\w/]*\.py)`", rest)
                if not (package / path).exists() and not (REPO / path).exists()]
    tested = {name for name in re.findall(r"`(test_\w+\.py)`", page)}
    missing += [name for name in tested if not list((REPO / "tests").rglob(name))]
    assert missing == []
    actual = {p.name + "/" for p in package.iterdir() if (p / "__init__.py").exists()} | {"config.py"}
    assert actual == set(rooms)


def test_the_multilabel_page_shows_both_csv_forms_and_the_shown_keys_read_them(tmp_path):
    """Issue 64: the page showed `path,label` only and never named data.csv_label_column; a list in the
    `image_name,labels` form (many Kaggle and fastai lists) needs the two column keys, shown with it."""
    from imgcls.data.listing import DataTreeError
    from imgcls.data.sources.source_csv import scan_csv

    page = (REPO / "docs" / "multilabel.md").read_text()
    block = FENCE.findall(page)[0]
    assert "# train.csv:            path,label" in block and "# train.csv:            image_name,labels" in block
    shown = [words for name, words in shown_commands() if name == "multilabel.md" and words[0] == "train.py"]
    kaggle = next(words for words in shown if "data.csv_label_column=labels" in words)
    overrides = {w.split("=", 1)[0]: w.split("=", 1)[1] for w in kaggle if "=" in w}
    assert overrides["data.csv_path_column"] == "image_name"
    rows = []
    for i in range(8):
        class_image(i % 2, size=(8, 8)).save(tmp_path / f"train_{i}.jpg")
        rows.append(f"train_{i}.jpg,{'haze primary' if i % 2 else 'clear'}")
    (tmp_path / "train.csv").write_text("image_name,labels\n" + "\n".join(rows) + "\n")
    overrides.update({"data.root": str(tmp_path), "data.train_csv": str(tmp_path / "train.csv")})
    cfg = load_config(kaggle[kaggle.index("--config") + 1], [f"{k}={v}" for k, v in overrides.items()])
    sources = scan_csv(cfg.data)
    assert len(sources.train_index.paths) + len(sources.val_index.paths) == 8
    assert sources.classes == ["clear", "haze", "primary"]
    with pytest.raises(DataTreeError, match="no column 'path'.*image_name, labels"):
        scan_csv(load_config("multilabel", [f"data.root={tmp_path}", f"data.train_csv={tmp_path / 'train.csv'}",
                                            "data.val_fraction=0.25"]).data)
