"""Running the app under uvicorn: the model loaded and warmed up before the port opens, one line saying
where it listens, and SIGTERM as a graceful stop (uvicorn stops accepting, answers what is in flight, the
batcher finishes its queue) that exits 0 instead of re-raising the signal as uvicorn does."""
from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import Optional

import uvicorn

from imgcls.core.errors import ConfigError
from imgcls.serving.app import ServeSettings, create_app

log = logging.getLogger("serve")
GRACEFUL_SHUTDOWN_S = 30  # the longest SIGTERM waits for requests in flight


class GracefulServer(uvicorn.Server):
    """uvicorn's server; after SIGTERM it returns normally (uvicorn re-raises the signal once it has shut
    down, which would end the process with 143 instead of 0)."""

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGTERM:
            log.info("SIGTERM: no new connections; answering the requests in flight, then exiting")
            self.should_exit = True
            return
        super().handle_exit(sig, frame)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                print(f"listening on http://{host}:{port}", file=sys.stderr, flush=True)


def open_index(index_dir: Optional[str]):
    """serve.py --index DIR: the folder's index (ConfigError, exit 2, when it is not one)."""
    if index_dir is None:
        return None

    from imgcls.embedding.index import load_index

    return load_index(Path(index_dir))


def check_served_index(served, index, index_dir: Optional[str]) -> None:
    """ConfigError (exit 2) when --index holds another model's vectors or the served model gives none."""
    if index is None:
        return
    if not served.embeds:
        raise ConfigError(f"--index {index_dir}: the served model file gives logits only; serve the checkpoint or "
                          f"an ONNX file written by export.py --embedding")
    from imgcls.embedding.index import check_index_model

    check_index_model(index, Path(index_dir), served.model_file.path, served.embedder.digest)


def check_served_index_dim(served, index, index_dir: Optional[str]) -> None:
    """ConfigError (exit 2) at start-up when the served model's vectors are not of --index's length (an
    index.json whose digest names this model over another model's vectors), not at the first /similar."""
    if index is None:
        return
    from imgcls.data.transforms import blank_for
    from imgcls.embedding.index import check_index_dim

    blank = blank_for(served.predictor.transform, served.predictor.transform.img_size)
    check_index_dim(index, Path(index_dir), served.model_file.path, served.embed([blank]).shape[1])


def serve(checkpoint: str, host: str, port: int, settings: ServeSettings, topk: int, device: str,
          trust=None, index_dir: Optional[str] = None) -> int:
    from imgcls.serving.model import ServedModel  # torch: imported here, so the ONNX-only server can use GracefulServer

    index = open_index(index_dir)
    served = ServedModel.load(checkpoint, topk, settings.max_batch, device, trust)
    check_served_index(served, index, index_dir)
    settings.max_batch = served.max_batch
    served.warm_up()
    check_served_index_dim(served, index, index_dir)
    log.info("%s (%s, %d classes) on %s, batches of up to %d (shapes %s), waiting up to %g ms for a batch, "
             "%d decode threads%s", served.model_file.path, served.model_file.cfg.model.name, len(served.classes),
             served.device_input.device, served.max_batch, served.shapes, settings.max_wait_ms,
             settings.decode_workers, ", API key required" if settings.api_key else "")
    config = uvicorn.Config(create_app(served, settings, index), host=host, port=port, access_log=False,
                            log_level="warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="on")
    GracefulServer(config).run()
    return 0
