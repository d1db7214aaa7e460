"""Entry-script plumbing: run a command's `main` and turn its outcome into an exit status.

Exit status: 0 done; 1 the job failed; 2 usage or config error (before any work); 143 / 130 after a
SIGTERM / SIGINT made the run save and stop. Nothing here imports torch, so `--help` and usage errors
answer before the heavy imports.
"""
from __future__ import annotations

import sys
from typing import Callable

from core.errors import USAGE_ERRORS, DistributedSetupError

OUT_OF_MEMORY_ADVICE = (
    "The batch does not fit in memory. Options: a smaller per-process batch (train.batch_size=N), with "
    "train.accum_steps=K to keep the effective batch (batch_size x accum_steps x processes); "
    "train.batch_size=auto to find the largest batch that fits and keep the effective batch "
    "(train.target_effective_batch); mixed precision (train.amp=bf16, or fp16 on CUDA); a smaller "
    "data.img_size; on the CPU, train.memory_budget_gb bounds what batch_size=auto may use.")


def run_main(main: Callable[[], int]) -> None:
    """Call `main` and exit with its status; usage errors exit 2, other failures 1, with one clear line."""
    try:
        code = main()
    except USAGE_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except DistributedSetupError as err:  # the job failed to start; the message names the torchrun variables
        print(f"error: {err}", file=sys.stderr)
        code = 1
    except Exception as err:  # the job failed: the traceback (a bug to report), then one line saying why
        if _is_out_of_memory(err):
            print(f"error: out of memory: {err}\n{OUT_OF_MEMORY_ADVICE}", file=sys.stderr)
        else:
            import traceback

            traceback.print_exc()
            print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        code = 1
    sys.exit(code)


def check_output_file(flag: str, path: str | None) -> None:
    """ConfigError (exit 2) before any work when an output file cannot be written where asked: the name is
    a folder, or a part of the path above it is a file."""
    if not path:
        return
    from pathlib import Path

    from core.errors import ConfigError

    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{flag} {path}: is a folder; pass a file name (for example {target / 'out'}{target.suffix or '.json'})")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{flag} {path}: {parent} is a file, not a folder")
            break


def _is_out_of_memory(err: Exception) -> bool:
    if isinstance(err, MemoryError):
        return True
    if "torch" in sys.modules:  # any out-of-memory error came from torch, which is then imported
        from engine.device import is_out_of_memory

        return is_out_of_memory(err)
    return "out of memory" in str(err).lower()
