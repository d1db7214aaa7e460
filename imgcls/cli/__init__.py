"""The command line: `imgcls COMMAND [ARGS ...]` (also `python -m imgcls`, and `python train.py` from a
checkout) runs one command's `main` and turns its outcome into an exit status.

Exit status: 0 done; 1 the job failed; 2 usage or config error (before any work); 143 / 130 / 138 after a
SIGTERM / SIGINT / SIGUSR1 made the run save and stop. Nothing here imports torch, so `--help` and usage errors
answer before the heavy imports.
"""
from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
import sys
import threading
from typing import Callable, NoReturn

from imgcls.compute.cpu_tuning import tune_process_start
from imgcls.core.errors import JOB_FAILURES, USAGE_ERRORS, ConfigError, Terminated

OUT_OF_MEMORY_ADVICE = (
    "The batch does not fit in memory. What helps, in this order: 1. mixed precision (train.amp=bf16, or fp16 "
    "on CUDA) halves the activations; 2. a smaller per-process batch (train.batch_size=N) with "
    "train.accum_steps=K to keep the effective batch (batch_size x accum_steps x processes), or "
    "train.batch_size=auto to find the largest batch that fits and keep the effective batch "
    "(train.target_effective_batch); 3. activation checkpointing (model.grad_checkpointing=true): ~20-30% "
    "more compute for much less activation memory; 4. a smaller data.img_size. On the CPU, "
    "train.memory_budget_gb bounds what batch_size=auto may use; python tune.py shows the memory breakdown.")
FRAGMENTATION_ADVICE = ("Reserved memory is much larger than allocated (fragmentation): also try "
                        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")


def announce(what: str) -> None:
    """A command's first line, on stderr before its heavy imports (torch, timm: seconds, tens of them on a
    loaded machine), so the wait is not silent. `--help` and usage errors print nothing of it."""
    print(f"{what} (loading torch...)", file=sys.stderr, flush=True)


def out_of_memory_message(err: Exception) -> str:
    """The error, what fills the memory (the notes the training step added), and the options in the order
    that helps."""
    notes = list(getattr(err, "__notes__", None) or [])
    text = str(err)
    lines = [f"error: out of memory: {text}", *notes, OUT_OF_MEMORY_ADVICE]
    if "expandable_segments" not in " ".join(notes) and _reserved_much_larger(text):
        lines.append(FRAGMENTATION_ADVICE)
    return "\n".join(lines)


def _reserved_much_larger(message: str) -> bool:
    """From CUDA's message: "X GiB is allocated by PyTorch, and Y MiB is reserved by PyTorch but unallocated"."""
    import re

    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    found = re.search(r"([\d.]+) (B|KiB|MiB|GiB) is allocated by PyTorch, and ([\d.]+) (B|KiB|MiB|GiB) is "
                      r"reserved by PyTorch but unallocated", message)
    if not found:
        return False
    allocated = float(found.group(1)) * units[found.group(2)]
    unallocated = float(found.group(3)) * units[found.group(4)]
    return unallocated > 0.25 * allocated


def run_main(main: Callable[[], int], outermost: bool | None = None) -> None:
    """Call `main` and exit with its status; usage errors exit 2, other failures 1, with one clear line.
    First, before any command imports torch, the process-start half of the CPU tuning
    (`compute.cpu_tuning.tune_process_start`). `outermost`: whether nothing runs after the command in this
    process (`exit_process`); by default, whether run_main was called by a script's top level."""
    tune_process_start()
    try:
        code = main()
    except USAGE_ERRORS as err:
        code = _report(f"error: {err}", 2)
    except Terminated:
        code = _report("terminated", 143)
    except KeyboardInterrupt:
        code = _report("interrupted", 130)
    except BrokenPipeError:  # stdout's reader left (`| head`): nothing more can reach it; end as `cat` would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 128 + signal.SIGPIPE
    except JOB_FAILURES as err:  # the message says why (the torchrun variables, the exporter's reason)
        code = _report(f"error: {err}", 1)
    except Exception as err:  # the job failed: the traceback (a bug to report), then one line saying why
        if _is_out_of_memory(err):
            code = _report(out_of_memory_message(err), 1)
        else:
            import traceback

            traceback.print_exc()
            code = _report(f"error: {type(err).__name__}: {err}", 1)
    exit_process(code, _called_from_top_level(sys._getframe()) if outermost is None else outermost)


def exit_process(code: int, outermost: bool) -> NoReturn:
    """End the command's process with `code`. The interpreter's own exit walks and frees every object torch,
    torchvision and timm made at import (1.0-1.3 s of every command's end with them; with gc.freeze, 0.16 s for
    torch alone and 0.3-0.5 s after a photos run on two cores, a sixth of what follows its last epoch), which
    nothing needs: when run_main is the outermost caller (not under runpy, cProfile or a test's wrapper, which
    go on after it) and no other thread runs, the exit handlers run (logging's flush, MLflow's run, worker
    processes, coverage), the standard streams are flushed, and the process ends with os._exit. Otherwise
    sys.exit, with the collector frozen (the same walk, without the collector's passes)."""
    gc.freeze()
    if not outermost or threading.active_count() > 1 or not hasattr(atexit, "_run_exitfuncs"):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`) or stream: nothing more can reach it
            pass
    os._exit(0 if code is None else int(code))


def _called_from_top_level(frame) -> bool:
    """Whether `frame` (run_main's) was called by the __main__ script's top level with nothing beneath it:
    `python train.py`, not runpy, cProfile, pdb or a test's wrapper, which have code to run after it."""
    caller = frame.f_back
    return (caller is not None and caller.f_back is None and caller.f_code.co_name == "<module>"
            and caller.f_globals.get("__name__") == "__main__")


def _report(line: str, code: int) -> int:
    """`line` on stderr, and in the run's log file when the run has written to it (train.log, opened at its
    first record): a run stopped by bad data would otherwise leave a train.log that does not say why.
    Returns `code`."""
    print(line, file=sys.stderr)
    record = logging.makeLogRecord({"name": "imgcls", "levelno": logging.ERROR, "levelname": "ERROR", "msg": line})
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and handler.stream is not None:
            handler.handle(record)
    return code


def _is_out_of_memory(err: Exception) -> bool:
    if isinstance(err, MemoryError):
        return True
    if "torch" in sys.modules:  # any out-of-memory error came from torch, which is then imported
        from imgcls.compute.device import is_out_of_memory

        return is_out_of_memory(err)
    return "out of memory" in str(err).lower()


def finite_float(text: str) -> float:
    """argparse type: a finite number (nan and inf are refused, exit 2: a NaN threshold rejects nothing)."""
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r}: a finite number is needed")
    return value


# ---------------------------------------------------------------- optional dependencies

# pyproject.toml's extras and the modules each one brings (import names); a command whose extra is missing exits 2
# before any work, naming the extra (tests/config_cli/test_package.py keeps this table and pyproject in step)
EXTRAS = {
    "export": ("onnx", "onnxscript", "onnxruntime"),
    "openvino": ("openvino", "nncf"),
    "serve": ("fastapi", "uvicorn", "python_multipart|multipart"),  # python-multipart's name before 0.0.13: multipart
    "tune": ("optuna",),
    "audit": ("imagehash", "cleanlab"),
    "embed": ("faiss",),
    "explain": ("pytorch_grad_cam",),
    "track": ("mlflow",),
    "executorch": ("executorch",),
    "litert": ("litert_torch", "ai_edge_litert"),
}
# extras that imgcls[all] leaves out: litert-torch pins older pydantic, anyio and typing_extensions and pulls JAX
# and transformers (docs/edge.md)
OUTSIDE_ALL = ("litert",)


def module_available(names: str) -> bool:
    """Whether `import name` would find the module (one of `a|b`), without importing it (a None in sys.modules:
    blocked)."""
    import importlib.util

    for name in names.split("|"):
        if name in sys.modules:
            if sys.modules[name] is not None:
                return True
            continue
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            pass
    return False


def require_extra(extra: str, what: str, modules: tuple[str, ...] | None = None) -> None:
    """ConfigError (exit 2) naming the extra to install when one of its modules (or of `modules`, the part of
    it `what` needs) is missing."""
    missing = [name.split("|")[0] for name in modules or EXTRAS[extra] if not module_available(name)]
    if missing:
        also = "" if extra in OUTSIDE_ALL else ' (or "imgcls[all]")'
        raise ConfigError(f"{what} needs imgcls's optional dependencies [{extra}] ({', '.join(missing)} not "
                          f"installed): pip install \"imgcls[{extra}]\"{also}")


def require_model_runtime(path: str | None, flag: str = "--checkpoint") -> None:
    """The extra that runs a model file of this kind: ONNX files need [export] (onnxruntime), OpenVINO IRs
    [openvino], .pte files [executorch], .tflite files [litert] (its runtime, ai-edge-litert); checkpoints, .pt2
    files and timm folders need nothing more."""
    if not path:
        return
    lowered = path.lower()
    if lowered.endswith(".onnx"):  # running one takes onnxruntime alone (the slim serving image's case)
        require_extra("export", f"{flag} {path} (an ONNX file)", ("onnxruntime",))
    elif lowered.endswith(".xml") or os.path.isfile(os.path.join(path, "model.xml")):
        require_extra("openvino", f"{flag} {path} (an OpenVINO IR)", ("openvino",))
    elif lowered.endswith(".pte"):
        require_extra("executorch", f"{flag} {path} (an ExecuTorch program)", ("executorch",))
    elif lowered.endswith(".tflite"):  # running one takes the runtime alone, not the converter
        require_extra("litert", f"{flag} {path} (a LiteRT model)", ("ai_edge_litert",))


# ---------------------------------------------------------------- imgcls COMMAND

# each command is the `main` of imgcls.cli.<name>; `imgcls --help` lists it with its line here
COMMANDS = ("train", "eval", "infer", "export", "serve", "tune", "audit", "embed", "search", "benchmark", "label")
SUMMARIES = {
    "train": "train a classifier from a config (--config NAME|FILE, KEY=VALUE overrides, --resume)",
    "eval": "evaluate a checkpoint or an export on a split (JSON report, per-class table)",
    "infer": "classify images, folders or globs (table, CSV or JSON rows)",
    "export": "export a checkpoint to ONNX, int8 ONNX, pt2, a timm folder, OpenVINO, ExecuTorch or LiteRT, checked "
              "before it is done",
    "serve": "HTTP inference: POST /predict, /embed, /similar",
    "tune": "batch-size sweep, LR range test, or an Optuna search (--search)",
    "audit": "check a data set before training: unreadable files, duplicates, leaks, likely label errors",
    "embed": "write embeddings and a similarity index for images",
    "search": "the nearest indexed images of query images",
    "benchmark": "measure the loader, training or inference rate (one JSON object)",
    "label": "what to label next (pick), and the round trip through Label Studio (push, pull)",
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {SUMMARIES[name]}" for name in COMMANDS]
    return ("usage: imgcls COMMAND [ARGS ...]   (imgcls COMMAND --help: that command's arguments)\n\n"
            "commands:\n" + "\n".join(lines) + "\n\nExit status: 0 done, 1 failed, 2 usage or config error.")


def main(argv: list[str] | None = None) -> None:
    """`imgcls COMMAND ARGS`: the command's `main` under run_main, with `imgcls COMMAND` as its program name."""
    import difflib
    import importlib

    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        sys.exit(0 if argv else 2)
    name = argv[0]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        print(f"error: imgcls {name}: no such command{hint} (one of: {', '.join(COMMANDS)})", file=sys.stderr)
        sys.exit(2)
    sys.argv = [f"imgcls {name}", *argv[1:]]
    # the `imgcls` console script calls main from its top level: nothing runs after the command
    run_main(importlib.import_module(f"imgcls.cli.{name}").main, outermost=_called_from_top_level(sys._getframe()))
