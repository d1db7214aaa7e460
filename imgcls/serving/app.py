"""The HTTP API (FastAPI): `POST /predict` takes an image as the raw body or as a multipart `file` field
and answers infer.py's JSON row for it; `GET /health` describes the loaded model. A body over `max_bytes`
gets 413 after the rest of it is read and thrown away (kept: at most `max_bytes`), so a client that sends
its whole body before reading (no `Expect: 100-continue`: urllib, requests) reads the 413 instead of a
reset; a body (or a declared length) over `drain_bytes` gets 413 at once and the connection is closed. A
body that has not arrived within `body_timeout_s` gets 408 and the connection is closed (a slow client
holds no connection longer). An image that cannot be decoded gets 400 with a JSON error naming the
problem; with an API key, `/predict` wants `Authorization: Bearer KEY` (401). One access-log line per
request with its status and latency.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from imgcls.serving.batcher import DynamicBatcher
from imgcls.serving.errors import BadImage
from imgcls.serving.requests import ImageRequests

if TYPE_CHECKING:
    from imgcls.embedding.index import LoadedIndex

if TYPE_CHECKING:  # the torch path's model; the ONNX-only one (serving.onnx_only) has the same methods
    from imgcls.serving.model import ServedModel

log = logging.getLogger("serve")
access_log = logging.getLogger("serve.access")


@dataclass
class ServeSettings:
    max_batch: int = 32
    max_wait_ms: float = 10.0
    decode_workers: int = 2
    max_bytes: int = 10_000_000
    api_key: Optional[str] = None
    drain_bytes: int = 64_000_000   # an oversized body up to this is read and discarded before the 413
    body_timeout_s: float = 30.0    # the whole body must arrive within this (408 and close after)


PROTECTED = ("/predict", "/embed", "/similar")  # the paths an API key guards


class BodyTooLarge(Exception):
    """args: (bytes seen or declared, whether the body was read to its end)."""


def error(status: int, kind: str, detail: str) -> JSONResponse:
    return JSONResponse({"error": kind, "detail": detail}, status_code=status)


ROUTING_ERRORS = {404: "not_found", 405: "method_not_allowed"}


def routing_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """The router's own answers (an unknown path, a wrong method) in the API's `{"error", "detail"}` shape,
    with their headers (405's `Allow`) kept."""
    kind = ROUTING_ERRORS.get(exc.status_code, "http_error")
    if exc.status_code == 404:
        detail = f"no such endpoint: {request.url.path} (POST /predict, GET /health)"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        detail = f"{request.method} is not allowed on {request.url.path}" + (f"; use {allowed}" if allowed else "")
    else:
        detail = str(exc.detail)
    response = error(exc.status_code, kind, detail)
    for name, value in (exc.headers or {}).items():
        response.headers[name] = value
    return response


async def read_body(request: Request, max_bytes: int, drain_bytes: int) -> bytes:
    """The whole body, or BodyTooLarge when it passes `max_bytes`: after reading (and dropping) the rest of
    it when it ends within `drain_bytes`, at once (not read to its end) when it, or its declared length,
    passes `drain_bytes`. At most `max_bytes` are kept in memory."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max(max_bytes, drain_bytes):
        raise BodyTooLarge(int(declared), False)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max(max_bytes, drain_bytes):
            raise BodyTooLarge(size, False)
        if size <= max_bytes:
            chunks.append(chunk)
    if size > max_bytes:
        raise BodyTooLarge(size, True)
    return b"".join(chunks)


def closing(response: JSONResponse) -> JSONResponse:
    """The response, with the connection closed after it (a body left unread cannot be skipped)."""
    response.headers["Connection"] = "close"
    return response


async def multipart_file(request: Request, body: bytes) -> tuple[bytes, Optional[str]]:
    """The `file` field of a multipart body already read: (bytes, filename). BadImage without one."""
    sent = False

    async def replay():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await Request(request.scope, replay).form()
    except Exception as err:  # python-multipart's parse errors, a missing boundary, ...
        raise BadImage("bad_multipart", f"the multipart body cannot be parsed: {err}") from err
    field = form.get("file")
    if not isinstance(field, UploadFile):
        raise BadImage("no_file_field", "a multipart body needs the image in a field named 'file'")
    return await field.read(), field.filename


def authorized(request: Request, api_key: Optional[str]) -> bool:
    if api_key is None:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def run_items(served: "ServedModel", items: list) -> list:
    """One batch of (kind, image, name) items: the `predict` ones classified together, the `embed` ones
    embedded together (each a padded batch); results in the items' order."""
    results: list = [None] * len(items)
    for kind, run in (("predict", served.classify), ("embed", lambda images, names: served.embed(images))):
        positions = [i for i, item in enumerate(items) if item[0] == kind]
        if positions:
            answers = run([items[i][1] for i in positions], [items[i][2] for i in positions])
            for i, answer in zip(positions, answers):
                results[i] = answer
    return results


def create_app(served: "ServedModel", settings: ServeSettings, index: Optional["LoadedIndex"] = None) -> FastAPI:
    batcher = DynamicBatcher(lambda items: run_items(served, items), served.max_batch, settings.max_wait_ms / 1000.0)
    decoders = ThreadPoolExecutor(max_workers=settings.decode_workers, thread_name_prefix="decode")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher.start()
        yield
        await batcher.stop()  # after uvicorn has answered every request in flight
        decoders.shutdown(wait=True)

    app = FastAPI(title="imgcls serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  exception_handlers={StarletteHTTPException: routing_error})
    app.state.batcher = batcher
    app.state.in_flight = 0  # requests whose headers are in and whose answer is not yet sent

    @app.middleware("http")
    async def access_and_auth(request: Request, call_next):
        start = time.perf_counter()
        if request.url.path in PROTECTED and not authorized(request, settings.api_key):
            response = error(401, "unauthorized", "send the API key as 'Authorization: Bearer KEY'")
            response.headers["WWW-Authenticate"] = "Bearer"
        else:
            app.state.in_flight += 1
            try:
                response = await call_next(request)
            finally:
                app.state.in_flight -= 1
        client = request.client.host if request.client else "-"
        access_log.info("access %s \"%s %s\" %d %.1f ms", client, request.method, request.url.path,
                        response.status_code, (time.perf_counter() - start) * 1000.0)
        return response

    @app.get("/health")
    async def health():
        return {**served.health(), "served": {"images": batcher.items_run, "batches": batcher.batches_run},
                "in_flight": app.state.in_flight - 1}  # less this request

    @app.post("/predict")
    async def predict(request: Request):
        image = await decoded_image(request, served, settings, decoders)
        if isinstance(image, JSONResponse):
            return image
        return await batcher.submit(("predict", *image))

    ImageRequests(served, index, batcher, lambda request: decoded_image(request, served, settings, decoders)).add_to(app)
    return app


async def decoded_image(request: Request, served: "ServedModel", settings: ServeSettings, decoders):
    """(image, file name) of a request's body, or the error response (413, 408, 400)."""
    try:
        body = await asyncio.wait_for(read_body(request, settings.max_bytes, settings.drain_bytes),
                                      settings.body_timeout_s)
    except BodyTooLarge as err:
        size, drained = err.args
        response = error(413, "too_large", f"the body has {'' if drained else 'at least '}{size} bytes, above "
                                           f"--max-bytes {settings.max_bytes}")
        return response if drained else closing(response)
    except (asyncio.TimeoutError, TimeoutError):
        return closing(error(408, "body_timeout", f"the body did not arrive within --body-timeout "
                                                  f"{settings.body_timeout_s:g} s"))
    try:
        name = None
        if request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
            body, name = await multipart_file(request, body)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(decoders, served.decode, body), name
    except BadImage as err:
        return error(400, err.kind, err.detail)
