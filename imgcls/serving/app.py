"""What a request body can be refused for, without torch: the JSON error's `kind` and its detail. Shared by
serve.py's torch path (serving.model) and its ONNX-only path (serving.slim).

The padded batch sizes a served model sees (both serve.py paths: torch, and ONNX only).

Dynamic batching for an asyncio server: requests wait in a queue; the first one waiting opens a batch,
which closes when it holds `max_batch` items or `max_wait_s` after it opened, then runs on one model
thread while the next batch gathers. Only decoded images enter the queue, so a bad upload never reaches
a batch; when a batch's run raises, its requests run one by one, so only one that fails alone fails.

serve.py's embedding endpoints: `POST /embed` answers the image's L2-normalised pooled pre-logits
vector (`{"embedding": [...]}`); with --index DIR, `POST /similar?k=K` answers its K nearest indexed images
(`{"neighbours": [{"path", "score"}]}`, cosine, nearest first). Both go through the dynamic batcher with
/predict, so concurrent requests share forward passes.

The HTTP API (FastAPI): `POST /predict` takes an image as the raw body or as a multipart `file` field
and answers infer.py's JSON row for it; `GET /health` describes the loaded model. A body over `max_bytes`
gets 413 after the rest of it is read and thrown away (kept: at most `max_bytes`), so a client that sends
its whole body before reading (no `Expect: 100-continue`: urllib, requests) reads the 413 instead of a
reset; a body (or a declared length) over `drain_bytes` gets 413 at once and the connection is closed. A
body that has not arrived within `body_timeout_s` gets 408 and the connection is closed (a slow client
holds no connection longer). An image that cannot be decoded gets 400 with a JSON error naming the
problem; with an API key, `/predict` wants `Authorization: Bearer KEY` (401). One access-log line per
request with its status and latency."""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from imgcls.serving import BadImage


class DynamicBatcher:
    """`await submit(item)` -> that item's result from `run_batch(items) -> results` (same order, same
    length), called with up to `max_batch` items at a time on a single worker thread."""

    def __init__(self, run_batch: Callable[[list], list], max_batch: int, max_wait_s: float):
        self.run_batch = run_batch
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.batches_run = 0
        self.items_run = 0
        self._queue: Optional[asyncio.Queue] = None
        self._task: Optional[asyncio.Task] = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def submit(self, item: Any) -> Any:
        if self._queue is None:
            raise RuntimeError("the batcher is not running")
        future = asyncio.get_running_loop().create_future()
        await self._queue.put((item, future))
        return await future

    async def stop(self) -> None:
        """Finish what is queued, then stop the loop and the model thread."""
        if self._task is not None:
            while self._queue is not None and not self._queue.empty():
                await asyncio.sleep(0.01)
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)

    async def _gather(self) -> list:
        """One batch: wait for the first item, then up to `max_wait_s` for more, up to `max_batch`."""
        pending = [await self._queue.get()]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        while len(pending) < self.max_batch:
            if not self._queue.empty():  # what queued during the last run: taken without waiting
                pending.append(self._queue.get_nowait())
                continue
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            try:
                pending.append(await asyncio.wait_for(self._queue.get(), remaining))
            except asyncio.TimeoutError:
                break
        return pending

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            pending = await self._gather()
            live = [(item, future) for item, future in pending if not future.cancelled()]  # client gone
            if not live:
                continue
            try:
                results = await loop.run_in_executor(self._executor, self.run_batch, [item for item, _ in live])
            except Exception as err:  # the model failed on this batch: each request runs alone, the server goes on
                if len(live) == 1:
                    log.exception("a batch of 1 failed")
                    if not live[0][1].done():
                        live[0][1].set_exception(err)
                    continue
                log.warning("a batch of %d failed (%s: %s): its requests run one by one, so only a failing one "
                            "fails", len(live), type(err).__name__, err)
                await self._run_alone(live)
                continue
            self.batches_run += 1
            self.items_run += len(live)
            for (_, future), result in zip(live, results):
                if not future.done():
                    future.set_result(result)

    async def _run_alone(self, live: list) -> None:
        """Each request of a failed batch as a batch of its own: one request's input that makes the model fail (a
        non-finite output) gets its 500 without failing the requests it was batched with."""
        loop = asyncio.get_running_loop()
        for item, future in live:
            try:
                result = (await loop.run_in_executor(self._executor, self.run_batch, [item]))[0]
            except Exception as err:
                log.exception("a request failed on its own")
                if not future.done():
                    future.set_exception(err)
                continue
            self.batches_run += 1
            self.items_run += 1
            if not future.done():
                future.set_result(result)

MAX_K = 1000


def _error(status: int, kind: str, detail: str) -> JSONResponse:
    return JSONResponse({"error": kind, "detail": detail}, status_code=status)


@dataclass
class ImageRequests:
    served: object            # serving.model.ServedModel or the ONNX-only one: `embeds`, `embed`
    index: Optional[object]   # embedding.index.LoadedIndex (serve.py --index)
    batcher: object
    decoded: Callable         # request -> (image, name) or an error response

    async def vector(self, request: Request):
        if not self.served.embeds:
            return _error(404, "no_embedding", "this model file gives logits only: serve a checkpoint, a timm "
                                               "folder or an ONNX file written by export.py --embedding")
        image = await self.decoded(request)
        if isinstance(image, JSONResponse):
            return image
        return await self.batcher.submit(("embed", *image))

    def add_to(self, app: FastAPI) -> None:
        @app.post("/embed")
        async def embed(request: Request):
            vector = await self.vector(request)
            return vector if isinstance(vector, JSONResponse) else {"embedding": [float(v) for v in vector]}

        @app.post("/similar")
        async def similar(request: Request):
            if self.index is None:
                return _error(404, "no_index", "start serve.py with --index DIR (a folder written by embed.py)")
            text = request.query_params.get("k", "5")
            # parsed here, not by FastAPI, so k=abc is answered in our error shape (not FastAPI's 422)
            k = int(text) if text.isascii() and text.isdigit() and len(text) <= 6 else 0
            if not 1 <= k <= MAX_K:
                return _error(400, "bad_k", f"k={text}: must be a whole number between 1 and {MAX_K}")
            vector = await self.vector(request)
            if isinstance(vector, JSONResponse):
                return vector
            import asyncio

            from imgcls.embedding.index import neighbours

            found = await asyncio.get_running_loop().run_in_executor(None, neighbours, self.index, vector, k)
            return {"neighbours": found}


if TYPE_CHECKING:  # the torch path's model; the ONNX-only one (serving/slim.py) has the same methods
    from imgcls.embedding.index import LoadedIndex
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
