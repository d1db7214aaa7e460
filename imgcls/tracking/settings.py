"""The `tracking` section: where a run's parameters, curves and files are also logged, and the checks of it that
run before any work (a URI MLflow can use, the client installed)."""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from typing import Literal, Optional, Union
from urllib.parse import urlsplit

from imgcls.core.errors import ConfigError, redact_uri, secret_query_names
from imgcls.core.settings import setting

# tracking.uri schemes MLflow serves (a plain path is a local store); anything else is refused before any work
TRACKING_URI_SCHEMES = ("file", "sqlite", "http", "https", "postgresql", "mysql", "mssql")
TRACKING_NAME_MAX = 250  # MLflow's limit on experiment and run names


@dataclass
class TrackingConfig:
    HELP = "experiment tracking (docs/tracking.md); only global rank 0 logs"

    backend: Literal["none", "mlflow"] = setting("none", "none | mlflow (parameters, tags, curves and files of the "
                                                         "run also go to an MLflow run)", resume_free=True)
    uri: Optional[str] = setting(None, "null: MLflow's own (MLFLOW_TRACKING_URI, else a local store) | a folder | "
                                       "sqlite:///FILE.db | http(s)://HOST:PORT", resume_free=True)
    experiment: Optional[str] = setting(None, "the MLflow experiment (null: the config's name, e.g. quickstart)",
                                        resume_free=True)
    run_name: Optional[str] = setting(None, "the MLflow run's name (null: output.dir's folder name)",
                                      resume_free=True)
    log_checkpoints: Union[bool, Literal["best"]] = setting(False, "false | best (also log best.pt as an artifact "
                                                                   "at the end)", resume_free=True)

    def check(self, cfg) -> None:
        check_tracking(self)


def check_tracking(t: TrackingConfig) -> None:
    """tracking.*: a URI MLflow can use (a known scheme, a host for http(s), no credentials in it: those go in
    MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN), printable names."""
    if t.log_checkpoints is True:
        raise ConfigError("'tracking.log_checkpoints' = true: allowed are false or best (log best.pt at the end)")
    for key, value in (("tracking.uri", t.uri), ("tracking.experiment", t.experiment),
                       ("tracking.run_name", t.run_name)):
        if value is not None and (not value.strip() or not value.isprintable() or len(value) > 2000):
            raise ConfigError(f"'{key}' = {redact_uri(value)!r}: must be non-empty printable text (no control "
                              f"characters)")
    for key, value in (("tracking.experiment", t.experiment), ("tracking.run_name", t.run_name)):
        if value is not None and len(value) > TRACKING_NAME_MAX:
            raise ConfigError(f"'{key}' is {len(value)} characters long; MLflow takes at most {TRACKING_NAME_MAX}")
    if t.uri is not None:
        problem = tracking_uri_problem(t.uri)
        if problem:
            raise ConfigError(f"'tracking.uri' = {redact_uri(t.uri)!r}: {problem}; allowed: null (MLflow's own: "
                              f"MLFLOW_TRACKING_URI, else a local store), a folder, sqlite:///FILE.db, "
                              f"http(s)://HOST:PORT, or {', '.join(TRACKING_URI_SCHEMES[4:])}://...")


def tracking_client_installed() -> bool:
    return importlib.util.find_spec("mlflow") is not None


def tracking_uri_problem(uri: str) -> Optional[str]:
    """What is wrong with a tracking URI (None: nothing). A string without `scheme:` is a folder."""
    if any(c.isspace() for c in uri):
        return "it contains white space"
    match = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):", uri)
    if match is None or re.match(r"^[A-Za-z]:[\\/]", uri):  # no scheme, or a Windows drive letter
        return None
    scheme = match.group(1).lower()
    if scheme not in TRACKING_URI_SCHEMES:
        return f"unknown scheme '{scheme}'"
    try:
        parts = urlsplit(uri)
        port = parts.port
    except ValueError as err:
        return f"malformed ({err})"
    secrets = secret_query_names(uri)
    if parts.username is not None or parts.password is not None or secrets:
        held = f"a secret in its query ({', '.join(secrets)})" if secrets and parts.username is None else "credentials"
        return (f"it holds {held}, which would be saved in config.yaml and the checkpoints; put them in "
                f"MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) instead")
    if scheme in ("http", "https") and not parts.hostname:
        return "no host (http://HOST:PORT)"
    if scheme == "sqlite" and not uri.lower().startswith("sqlite:///"):
        return "a SQLite store is sqlite:///RELATIVE.db or sqlite:////ABSOLUTE.db"
    if port == 0:
        return "port 0"
    return None
