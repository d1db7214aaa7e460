"""Image URLs as inputs (infer.py, the Python API): each `http://` / `https://` input is downloaded, at most
MAX_URL_BYTES (serve.py's default upload limit) within URL_TIMEOUT_S seconds, into a private temporary
folder, and read from there by the same decoding as a file (EXIF, modes, bands, broken images). A URL that
cannot be had (an HTTP error, a refused connection, a timeout, too many bytes) keeps its place as an empty
file, so its row comes back with `error` saying why; the folder goes when the pass ends. Standard library only.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Iterator, Optional

MAX_URL_BYTES = 10_000_000   # serve.py's --max-bytes default: one limit on an image from the network
URL_TIMEOUT_S = 30.0         # the whole download, not one socket read
CHUNK = 1 << 16


def is_url(item: str) -> bool:
    return item.lower().startswith(("http://", "https://"))


def url_name(url: str) -> str:
    """The last part of the URL's path (`image` when it has none), for output names."""
    return PurePosixPath(urllib.parse.urlparse(url).path).name or "image"


def _suffix(url: str) -> str:
    suffix = PurePosixPath(urllib.parse.urlparse(url).path).suffix.lower()
    return suffix if re.fullmatch(r"\.[a-z0-9]{1,5}", suffix) else ""


class URLError(Exception):
    """Why a URL gave no image bytes (the row's `error`)."""


def fetch(url: str, max_bytes: int, timeout_s: float) -> bytes:
    """The body at `url`, or URLError: HTTP status >= 400, no connection, over `max_bytes` (by Content-Length
    or by counting), or not complete within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(url, headers={"User-Agent": "imgcls"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            declared = response.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise URLError(f"{declared} bytes, over the limit of {max_bytes}")
            body = bytearray()
            while chunk := response.read(CHUNK):
                body += chunk
                if len(body) > max_bytes:
                    raise URLError(f"over the limit of {max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise URLError(f"not downloaded within {timeout_s:g} s")
            return bytes(body)
    except urllib.error.HTTPError as err:
        raise URLError(f"HTTP {err.code} {err.reason}") from None
    except (socket.timeout, TimeoutError):
        raise URLError(f"no answer within {timeout_s:g} s") from None
    except urllib.error.URLError as err:
        reason = err.reason
        if isinstance(reason, (socket.timeout, TimeoutError)):
            raise URLError(f"no answer within {timeout_s:g} s") from None
        raise URLError(f"cannot connect: {reason}") from None
    except (OSError, ValueError) as err:
        raise URLError(f"{type(err).__name__}: {err}") from None


@dataclass
class Downloads:
    """What the inputs became: `inputs` with each URL replaced by its local file; `url_of` maps a local file
    back to its URL; `failed` maps a local (empty) file to why its URL gave nothing."""

    inputs: list[str]
    url_of: dict = field(default_factory=dict)
    failed: dict = field(default_factory=dict)

    def restore(self, rows: list[dict]) -> list[dict]:
        """Rows named by their URLs again; a failed download's row says why, a decoding error names the URL."""
        for row in rows:
            local = row.get("path")
            url = self.url_of.get(local)
            if url is None:
                continue
            row["path"] = url
            if local in self.failed:
                row["error"] = self.failed[local]
            elif row.get("error"):
                row["error"] = str(row["error"]).replace(local, url)
        return rows


@contextlib.contextmanager
def downloaded(inputs: list[str], max_bytes: Optional[int] = None,
               timeout_s: Optional[float] = None) -> Iterator[Downloads]:
    """`Downloads` of `inputs` (no URL among them: the inputs as they are, nothing written); the temporary
    folder is removed on leaving. None: MAX_URL_BYTES, URL_TIMEOUT_S."""
    if not any(is_url(item) for item in inputs):
        yield Downloads(list(inputs))
        return
    folder = tempfile.mkdtemp(prefix="imgcls-urls-")
    try:
        yield _download_all(inputs, folder, max_bytes or MAX_URL_BYTES, timeout_s or URL_TIMEOUT_S)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _download_all(inputs: list[str], folder: str, max_bytes: int, timeout_s: float) -> Downloads:
    result, local_of = Downloads([]), {}
    for item in inputs:
        if not is_url(item):
            result.inputs.append(item)
            continue
        if item not in local_of:
            local = os.path.join(folder, f"{len(local_of):05d}{_suffix(item)}")
            error: Optional[str] = None
            try:
                body = fetch(item, max_bytes, timeout_s)
            except URLError as err:
                body, error = b"", str(err)
            with open(local, "wb") as f:
                f.write(body)
            local_of[item] = local
            result.url_of[local] = item
            if error is not None:
                result.failed[local] = error
        result.inputs.append(local_of[item])
    return result
