"""The project's error types, and which exit status each one means.

Usage errors (exit 2, found before any work): ConfigError, DataTreeError, ModelError, CheckpointError.
Job failures (exit 1): BadDataError, NonFiniteError, DiskFullError, DistributedSetupError, ExportError,
ModelOutputError,
ImageDecodeError escaping a split.
"""
from __future__ import annotations


class ConfigError(Exception):
    """A usage or config mistake; the entry scripts exit 2 with this message."""


class DataTreeError(Exception):
    """A data tree that cannot be used as it is (exit 2)."""


class ModelError(Exception):
    """An unknown model name or unusable weights file (exit 2)."""


class CheckpointError(Exception):
    """A checkpoint that is missing, damaged or not plain data (exit 2)."""


class ImageDecodeError(Exception):
    """A file that cannot be used as an image (truncated, empty, not an image, a decompression bomb)."""


class BadDataError(Exception):
    """Too many unreadable files in a split (exit 1)."""


class NonFiniteError(Exception):
    """Training produced a non-finite loss or gradient; the run stops keeping the last good checkpoint."""


class DiskFullError(Exception):
    """A checkpoint could not be written for lack of space (exit 1); the previous file is whole."""


class DistributedSetupError(Exception):
    """The environment asks for distributed training but the process group cannot start (exit 1)."""


class ExportError(Exception):
    """export.py could not write the model, or the export disagrees with the checkpoint (exit 1)."""


class ModelOutputError(Exception):
    """eval.py / infer.py: the model's outputs are not finite (damaged or diverged weights), exit 1."""


class StopRequested(Exception):
    """A signal asked the run to save and stop."""


USAGE_ERRORS = (ConfigError, DataTreeError, ModelError, CheckpointError)
# failures of the job whose message says everything: one line, exit 1, no traceback
JOB_FAILURES = (DistributedSetupError, ExportError, BadDataError, ModelOutputError)
