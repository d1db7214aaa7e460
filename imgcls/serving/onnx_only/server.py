"""serve.py without torch: the ONNX-only model (serving.onnx_only.model) behind the same app and server
(warm-up before the port opens, SIGTERM drains and exits 0)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import uvicorn

from imgcls.core.errors import ConfigError
from imgcls.serving.app import ServeSettings, create_app
from imgcls.serving.onnx_only.model import OnnxServedModel
from imgcls.serving.server import GRACEFUL_SHUTDOWN_S, GracefulServer, open_index

log = logging.getLogger("serve")
CPU_DEVICES = ("auto", "cpu")


def serve_onnx(checkpoint: str, host: str, port: int, settings: ServeSettings, topk: int, device: str,
               reject: bool = False, reject_below: Optional[float] = None, index_dir: Optional[str] = None) -> int:
    if device not in CPU_DEVICES:
        raise ConfigError(f"--device {device}: the ONNX-only server runs onnxruntime on the CPU (auto or cpu)")
    index = open_index(index_dir)
    served = OnnxServedModel.load(checkpoint, topk, settings.max_batch, reject, reject_below)
    if index is not None:
        if not served.embeds:
            raise ConfigError(f"--index {index_dir}: {checkpoint} has no 'embedding' output; export it with "
                              f"export.py --embedding")
        from imgcls.embedding.neighbours import check_index_model

        check_index_model(index, Path(index_dir), checkpoint, served.digest)
    settings.max_batch = served.max_batch
    served.warm_up()
    log.info("%s (%s, %d classes) on the CPU with onnxruntime (no torch), batches of up to %d (shapes %s), "
             "waiting up to %g ms for a batch, %d decode threads%s", served.export.path, served.export.model_name,
             len(served.classes), served.max_batch, served.shapes, settings.max_wait_ms, settings.decode_workers,
             ", API key required" if settings.api_key else "")
    config = uvicorn.Config(create_app(served, settings, index), host=host, port=port, access_log=False,
                            log_level="warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="on")
    GracefulServer(config).run()
    return 0
