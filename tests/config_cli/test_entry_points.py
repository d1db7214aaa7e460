"""Every command answers `--help` and a usage error without importing torch or timm (what made `--help`
take ~20 s): checked on the modules the script loaded, never with a timer."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO

HEAVY = ("torch", "torchvision", "timm")

# Runs an entry script as `python SCRIPT ARGS` would, then reports its exit status and which heavy modules
# it imported, as one JSON line on stdout (after whatever the script printed).
PROBE = """
import json, runpy, sys
script, args = sys.argv[1], sys.argv[2:]
sys.argv = [script, *args]
sys.path.insert(0, {repo!r})
try:
    runpy.run_path(script, run_name="__main__")
    code = 0
except SystemExit as exit:
    code = exit.code
print(json.dumps({{"code": code, "heavy": [m for m in {heavy!r} if m in sys.modules]}}))
"""

CASES = {
    "train --help": ("train.py", ["--help"], 0),
    "train without --config": ("train.py", [], 2),
    "train --resume auto without --config": ("train.py", ["--resume", "auto"], 2),
    "train with a config mistake": ("train.py", ["--config", "quickstart", "train.epochz=3"], 2),
    "train with an unknown config": ("train.py", ["--config", "nosuch"], 2),
    "eval --help": ("eval.py", ["--help"], 0),
    "eval without --checkpoint": ("eval.py", [], 2),
    "infer --help": ("infer.py", ["--help"], 0),
    "infer without inputs": ("infer.py", [], 2),
    "infer with a bad --batch-size": ("infer.py", ["x.png", "--batch-size", "0"], 2),
    "infer with a bad --output": ("infer.py", ["x.png", "--output", "out.txt"], 2),
    "benchmark --help": ("benchmark.py", ["--help"], 0),
    "serve --help": ("serve.py", ["--help"], 0),
    "serve with a bad --max-batch": ("serve.py", ["--checkpoint", "x.pt", "--max-batch", "0"], 2),
    "export --quantize with pt2": ("export.py", ["--checkpoint", "x.pt", "--format", "pt2", "--output", "m.pt2",
                                                 "--quantize", "int8"], 2),
    "benchmark with a bad --mode": ("benchmark.py", ["--mode", "fast"], 2),
    "benchmark without --config": ("benchmark.py", ["--mode", "train"], 2),
    "benchmark with a config mistake": ("benchmark.py", ["--config", "quickstart", "--mode", "train", "x.y=3"], 2),
    "audit --help": ("audit.py", ["--help"], 0),
    "embed --help": ("embed.py", ["--help"], 0),
    "embed without --output": ("embed.py", ["x.png", "--checkpoint", "best.pt"], 2),
    "embed with a bad --batch-size": ("embed.py", ["x.png", "--checkpoint", "b.pt", "--output", "v", "--batch-size", "0"], 2),
    "search --help": ("search.py", ["--help"], 0),
    "search with a bad --top-k": ("search.py", ["x.png", "--index", "v", "--top-k", "0"], 2),
    "search with a bad --output": ("search.py", ["x.png", "--index", "v", "--output", "found.txt"], 2),
    "audit with one fold": ("audit.py", ["--config", "quickstart", "--folds", "1"], 2),
    "audit with a missing checkpoint": ("audit.py", ["--config", "quickstart", "data.builtin=null", "data.root=.", "data.val_fraction=0.2",
                                                     "--checkpoint", "nothing.pt"], 2),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_help_and_usage_errors_do_not_import_torch(case, tmp_path):
    script, args, want = CASES[case]
    probe = PROBE.format(repo=str(REPO), heavy=HEAVY)
    done = subprocess.run([sys.executable, "-c", probe, str(REPO / script), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["code"] == want, done.stderr[-2000:]
    assert report["heavy"] == [], f"{case} imported {report['heavy']}"
    if want == 0:
        assert "usage:" in done.stdout
    else:
        assert "error" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_train_help_lists_the_configs_and_points_to_base_yaml(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / "train.py"), "--help"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    names = sorted(p.stem for p in (REPO / "configs").glob("*.yaml"))
    assert f"({', '.join(names)})" in text and "configs/base.yaml" in text


# Runs an entry script until it first imports a heavy module, then stops it there (exit 99) after saying so.
STOP_AT_HEAVY = """
import os, runpy, sys
script, args = sys.argv[1], sys.argv[2:]
class StopAtHeavy:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {heavy!r}:
            print("importing " + name, file=sys.stderr, flush=True)
            os._exit(99)
        return None
sys.meta_path.insert(0, StopAtHeavy())
sys.argv = [script, *args]
sys.path.insert(0, {repo!r})
runpy.run_path(script, run_name="__main__")
"""

FIRST_LINES = {
    "train.py": (["--config", "base", "data.root=/no/such/data", "output.dir=runs/x"],
                 "train.py: training resnet50 on /no/such/data into runs/x"),
    "train.py --resume": (["--resume", "runs/x/last.pt"],
                          "train.py: continuing the run of runs/x/last.pt with the config it recorded"),
    "eval.py": (["--checkpoint", "best.pt"], "eval.py: evaluating best.pt"),
    "infer.py": (["a.png", "--checkpoint", "best.pt"], "infer.py: classifying a.png with best.pt"),
    "export.py": (["--checkpoint", "best.pt", "--format", "onnx", "--output", "m.onnx"],
                  "export.py: exporting best.pt as onnx to m.onnx"),
    "tune.py": (["--config", "base", "--lr-range", "1e-4,1"], "tune.py: LR range test with --config base"),
    "benchmark.py": (["--config", "base", "--mode", "train"], "benchmark.py: --mode train with --config base"),
    "embed.py": (["a.png", "--checkpoint", "best.pt", "--output", "vecs"], "embed.py: embedding a.png with best.pt "
                                                                            "into vecs"),
    "search.py": (["a.png", "--index", "vecs"], "search.py: searching vecs for a.png"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(FIRST_LINES))
def test_each_command_says_what_it_does_before_importing_torch(case, tmp_path):
    args, first = FIRST_LINES[case]
    probe = STOP_AT_HEAVY.format(repo=str(REPO), heavy=HEAVY)
    done = subprocess.run([sys.executable, "-c", probe, str(REPO / case.split()[0]), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    lines = done.stderr.splitlines()
    assert done.returncode == 99, done.stderr[-2000:]
    assert lines[0] == f"{first} (loading torch...)" and lines[-1].startswith("importing "), lines


# A command's end, as `python SCRIPT` runs it (run_main at the script's top level) and under a wrapper: the exit
# status, the exit handlers and the log file are the same; only the outermost caller ends with os._exit.
ENDING = """
import atexit, logging, os, sys
sys.path.insert(0, {repo!r})
from imgcls.cli import run_main
log = logging.getLogger("ending")
log.addHandler(logging.FileHandler(sys.argv[1]))
log.setLevel(logging.INFO)
atexit.register(lambda: open(sys.argv[2], "w").write("handler ran"))
class TornDown:  # freed by the interpreter's teardown of sys.modules, which os._exit skips
    def __del__(self, write=os.write):
        write(2, b"torn down")
sys.modules["teardown_probe"] = TornDown()
def main():
    log.info("the last line")
    print("stdout line", end="")   # no newline: the stream still holds it when the command ends
    return 3
if __name__ == "__main__":
    run_main(main)
"""


def test_the_outermost_command_ends_fast_and_loses_nothing(tmp_path):
    from imgcls.cli import _called_from_top_level

    script = tmp_path / "command.py"
    script.write_text(ENDING.format(repo=str(REPO)))
    profile = tmp_path / "profile.out"
    for wrapper in ([], ["-m", "cProfile", "-o", str(profile)]):
        log, handler = tmp_path / f"log{len(wrapper)}.txt", tmp_path / f"handler{len(wrapper)}.txt"
        done = subprocess.run([sys.executable, *wrapper, str(script), str(log), str(handler)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == (0 if wrapper else 3), done.stderr     # cProfile exits 0 after SystemExit
        assert done.stdout == "stdout line" and log.read_text() == "the last line\n"
        assert handler.read_text() == "handler ran"
        assert done.stderr.endswith("torn down") == bool(wrapper)   # the teardown: skipped only when outermost
    assert profile.stat().st_size > 0    # cProfile wrote its profile after the command: it was not cut short
    # under a wrapper (runpy, cProfile, a test) the wrapper's code after the command still runs
    wrapped = subprocess.run([sys.executable, "-c", f"import runpy, sys; sys.argv = ['c', {str(tmp_path / 'l')!r}, "
                              f"{str(tmp_path / 'h')!r}]\ntry:\n    runpy.run_path({str(script)!r}, run_name='__main__')\n"
                              "except SystemExit as e:\n    print('after', e.code)"],
                             capture_output=True, text=True, timeout=120)
    assert wrapped.returncode == 0 and wrapped.stdout.rstrip().endswith("after 3"), wrapped.stderr
    assert not _called_from_top_level(sys._getframe())   # pytest's own frames lie beneath this test
