"""Whether the Hugging Face hub can be reached, found once per process with one short connection.

Without a network, huggingface_hub retries every file it looks for (five times, with back-off, for each of
the two weight-file names timm asks for): some 50 s of warnings before the error. One probe decides
instead; when the hub cannot be reached, offline mode is set for the rest of the process (the environment
for child processes, huggingface_hub's constant for this one), so the cache answers at once and a file that
is not cached fails at once.
"""
from __future__ import annotations

import os
import socket
import urllib.request
from typing import Optional
from urllib.parse import urlsplit

PROBE_TIMEOUT_S = 3.0
DEFAULT_ENDPOINT = "https://huggingface.co"
_TRUE = {"1", "on", "yes", "true"}

_decided: Optional[tuple[bool, str]] = None  # (offline, why), once per process


def offline_by_environment() -> bool:
    return any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def probe_address() -> tuple[str, int]:
    """Where a download would first connect: the HTTPS proxy when one is set, else the hub's endpoint."""
    proxy = urllib.request.getproxies().get("https")
    url = urlsplit(proxy if proxy and "://" in proxy else (f"http://{proxy}" if proxy else
                                                          os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT))
    return url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)


def can_connect(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """None when a TCP connection to host:port opens within `timeout`, else why not."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return None
    except OSError as err:
        return f"{host}:{port} cannot be reached: {err.strerror or err}"


def hub_offline() -> tuple[bool, str]:
    """(offline, why): decided once per process, by HF_HUB_OFFLINE or by one probe; when the probe fails,
    offline mode is switched on so that nothing retries."""
    global _decided
    if _decided is None:
        why = "HF_HUB_OFFLINE is set" if offline_by_environment() else can_connect(*probe_address())
        _decided = (why is not None, why or "")
        if why is not None:
            set_offline()
    return _decided


def set_offline() -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import huggingface_hub.constants  # read its environment at import: the constant is what it checks

    huggingface_hub.constants.HF_HUB_OFFLINE = True
