"""The project's error types, and which exit status each one means.

Usage errors (exit 2, found before any work): ConfigError, DataTreeError, ModelError, CheckpointError.
Job failures (exit 1): BadDataError, NonFiniteError, DiskFullError, DistributedSetupError, ExportError,
ModelOutputError,
ImageDecodeError escaping a split.

Credentials in URIs kept out of what is printed, logged and saved: the user:password part of a URL and the
values of secret-like query parameters (token, key, secret, password, sig, ...) become ***."""
from __future__ import annotations

import logging
import re
import signal
import threading
from contextlib import contextmanager
from urllib.parse import parse_qsl, urlsplit


class ConfigError(Exception):
    """A usage or config mistake; the entry scripts exit 2 with this message."""


class InputTypeError(ConfigError, TypeError):
    """The Python API was given a value of a type it does not take (None, a number, ...): a usage error, and a
    TypeError for callers that catch those."""


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

MASK = "***"


# query parameter names whose value is a secret: one of these words as a part of the name (api_key, X-Amz-Signature,
# access_token), or a name ending in one (sslpassword); `sslkey`, a path to a key file, is not one
SECRET_WORDS = ("token", "secret", "password", "passwd", "pwd", "sig", "signature", "key", "apikey", "auth",
                "credential", "credentials", "sas")


SECRET_SUFFIXES = ("token", "secret", "password", "passwd")


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s'\"<>]+@")


_QUERY_VALUE = re.compile(r"(?P<name>(?<=[?&;])[A-Za-z0-9_.\-]+)=(?P<value>[^&#\s'\"<>]*)")


def is_secret_name(name: str) -> bool:
    lowered = name.lower()
    parts = re.split(r"[-_.]", lowered)
    return any(part in SECRET_WORDS for part in parts) or lowered.endswith(SECRET_SUFFIXES)


def secret_query_names(uri: str) -> list[str]:
    """The query parameters of `uri` whose names say they hold a secret."""
    try:
        query = urlsplit(uri).query
    except ValueError:
        return []
    return [name for name, _ in parse_qsl(query, keep_blank_values=True) if is_secret_name(name)]


def redact_text(text: str) -> str:
    """`text` with the userinfo of every URL in it and the values of secret-like query parameters masked."""
    text = _USERINFO.sub(lambda m: m.group("scheme") + MASK + "@", str(text))
    return _QUERY_VALUE.sub(lambda m: f"{m.group('name')}={MASK}" if is_secret_name(m.group("name")) and m.group("value")
                            else m.group(0), text)


def redact_uri(uri):
    """A URI as it may be shown: None stays None."""
    return None if uri is None else redact_text(uri)


class RedactingFilter(logging.Filter):
    """Masks credentials in every record a handler emits (a client library's request log names the URL)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "://" in message or "=" in message:
            clean = redact_text(message)
            if clean != message:
                record.msg, record.args = clean, None
        return True


def install_log_redaction(logger_names=("", "mlflow")) -> None:
    """Add a RedactingFilter to the handlers of these loggers (the root's and MLflow's own, which does not
    propagate), once each."""
    for name in logger_names:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RedactingFilter) for f in handler.filters):
                handler.addFilter(RedactingFilter())


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command was by `sigterm_unwinds`: it unwinds as Ctrl-C does (exit 143)."""


@contextmanager
def sigterm_unwinds():
    """While the block runs, SIGTERM (docker stop, kill, a scheduler's pre-emption) raises Terminated where
    the command is, so `finally` blocks and temporary folders clean up on the way out; Python's default
    ends the process on the spot and leaves them. Only the main thread can take signals. Yields a list the
    signal is also noted in, for code that catches the KeyboardInterrupt itself (tune.py's sweep)."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def terminate(signum, frame):
        received.append(signum)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)
