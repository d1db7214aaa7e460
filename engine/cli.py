"""Shared entry-script plumbing: argument parsing of KEY=VALUE overrides and exit codes.

Exit status: 0 done; 1 the job failed; 2 usage or config error (before any work); 143 / 130 after a
SIGTERM / SIGINT made the run save and stop.
"""
from __future__ import annotations

import logging
import sys
from typing import Callable

from data.folder import DataTreeError
from engine.checkpoint import CheckpointError
from engine.config import ConfigError
from models.factory import ModelError

USAGE_ERRORS = (ConfigError, DataTreeError, ModelError, CheckpointError)


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
    except Exception as err:  # the job failed: say why in one line, keep the traceback in the log
        logging.getLogger("train").debug("failure", exc_info=True)
        if _is_out_of_memory(err):
            print(f"error: out of memory: {err}", file=sys.stderr)
        else:
            import traceback

            traceback.print_exc()
            print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        code = 1
    sys.exit(code)


def _is_out_of_memory(err: Exception) -> bool:
    return "out of memory" in str(err).lower() or type(err).__name__ == "OutOfMemoryError"
