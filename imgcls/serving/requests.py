"""serve.py's embedding endpoints: `POST /embed` answers the image's L2-normalised pooled pre-logits
vector (`{"embedding": [...]}`); with --index DIR, `POST /similar?k=K` answers its K nearest indexed images
(`{"neighbours": [{"path", "score"}]}`, cosine, nearest first). Both go through the dynamic batcher with
/predict, so concurrent requests share forward passes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

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
        async def similar(request: Request, k: int = 5):
            if self.index is None:
                return _error(404, "no_index", "start serve.py with --index DIR (a folder written by embed.py)")
            if not 1 <= k <= MAX_K:
                return _error(400, "bad_k", f"k={k}: must be between 1 and {MAX_K}")
            vector = await self.vector(request)
            if isinstance(vector, JSONResponse):
                return vector
            import asyncio

            from imgcls.embedding.neighbours import neighbours

            found = await asyncio.get_running_loop().run_in_executor(None, neighbours, self.index, vector, k)
            return {"neighbours": found}
