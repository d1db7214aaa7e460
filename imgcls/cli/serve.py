"""Serve a trained model over HTTP, with dynamic batching.

python serve.py --checkpoint CKPT_OR_EXPORT [--host 127.0.0.1] [--port 8000] [--max-batch 32]
                [--max-wait-ms 10] [--workers N] [--max-bytes 10000000] [--api-key KEY] [--topk 5]
                [--device auto|cpu|cuda] [--index DIR]

POST /predict with the image as the body (or as a multipart field named `file`) answers infer.py's JSON
row for it (label, prob, top-k); GET /health answers the model, its classes and its preprocessing.
Requests are decoded one by one, then classified together: a batch closes at --max-batch images or
--max-wait-ms after its first one. An unreadable image gets 400 with a JSON error naming the problem, a
body over --max-bytes 413 (read and dropped up to --drain-bytes, so the client reads it; above that the
connection is closed), a body slower than --body-timeout 408; with --api-key (or IMGCLS_API_KEY in the environment) /predict needs
`Authorization: Bearer KEY` (401 without). SIGTERM stops accepting, answers what is in flight, exits 0.
POST /embed answers the image's embedding ({"embedding": [...]}, L2-normalised pooled pre-logits
features, as embed.py writes them); with --index DIR (a folder written by embed.py with this model), POST
/similar?k=K answers its K nearest indexed images ({"neighbours": [{"path", "score"}]}, cosine). Both share
the dynamic batching with /predict.
--onnx-only (the default where torch is not installed, as in the slim serving image) serves an ONNX export
with onnxruntime, PIL and NumPy alone: the same rows, on the CPU.
Exit 2 on a usage error.
"""
import argparse
import importlib.util
import logging
import os
import sys

from imgcls.cli import finite_float, require_extra, require_model_runtime
from imgcls.core.errors import ConfigError
from imgcls.core.host import usable_cpus

API_KEY_ENV = "IMGCLS_API_KEY"
MAX_BATCH_LIMIT = 1024


def check_arguments(args) -> None:
    """Usage mistakes exit 2 before the model loads."""
    for flag, value, low in (("--max-batch", args.max_batch, 1), ("--workers", args.workers, 1),
                             ("--max-bytes", args.max_bytes, 1), ("--drain-bytes", args.drain_bytes, 0),
                             ("--topk", args.topk, 1), ("--port", args.port, 0)):
        if value < low:
            raise ConfigError(f"{flag} {value}: must be >= {low}")
    if args.port > 65535:
        raise ConfigError(f"--port {args.port}: must be <= 65535")
    if not 0 <= args.max_wait_ms <= 10_000:
        raise ConfigError(f"--max-wait-ms {args.max_wait_ms}: must be between 0 and 10000")
    if not 0 < args.body_timeout <= 3600:
        raise ConfigError(f"--body-timeout {args.body_timeout}: must be above 0 and at most 3600 (seconds)")
    if args.api_key is not None and not args.api_key.strip():
        raise ConfigError(f"--api-key / ${API_KEY_ENV}: empty; pass a key or leave it unset")
    if args.api_key is not None and not (args.api_key.isascii() and args.api_key.isprintable()
                                         and args.api_key == args.api_key.strip()):
        raise ConfigError(f"--api-key / ${API_KEY_ENV}: printable ASCII without surrounding spaces is needed (an "
                          f"HTTP header carries no other key intact, so every request would get 401)")
    if args.max_batch > MAX_BATCH_LIMIT:
        raise ConfigError(f"--max-batch {args.max_batch}: must be <= {MAX_BATCH_LIMIT} (every power-of-two shape "
                          f"up to it is warmed up before the port opens)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="best.pt or last.pt, or an export: FILE.onnx, FILE.pt2, "
                        "an OpenVINO IR folder or its .xml, a timm folder")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free one, printed at start)")
    parser.add_argument("--max-batch", type=int, default=32, help="most images per forward pass")
    parser.add_argument("--max-wait-ms", type=float, default=10.0, help="longest a batch waits for more images "
                                                                        "after its first")
    parser.add_argument("--workers", type=int, default=min(8, usable_cpus()),
                        help="threads decoding request images (default: one per usable core, at most 8)")
    parser.add_argument("--max-bytes", type=int, default=10_000_000, help="largest request body accepted (413 above)")
    parser.add_argument("--drain-bytes", type=int, default=64_000_000, help="a body over --max-bytes but within "
                        "this is read and dropped before the 413 (clients that send before reading see it); above "
                        "it: 413 and the connection closed")
    parser.add_argument("--body-timeout", type=float, default=30.0, help="seconds a request body may take to "
                        "arrive (408 and the connection closed after)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"require 'Authorization: Bearer KEY' on /predict (default: ${API_KEY_ENV})")
    parser.add_argument("--topk", type=int, default=5, help="labels and probabilities per image (as infer.py)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--reject", action="store_true", help="as infer.py: label 'unknown' every image whose "
                        "reject score is below the threshold stored with the model ('predicted': the would-be label)")
    parser.add_argument("--reject-below", type=finite_float, metavar="X", help="--reject with this score threshold")
    parser.add_argument("--onnx-only", action="store_true",
                        help="serve an ONNX export without torch (onnxruntime, PIL, NumPy; the CPU); the default "
                             "where torch is not installed (the slim serving image)")
    parser.add_argument("--index", metavar="DIR", help="an embed.py folder built with this model: POST /similar?k=K "
                                                       "answers its nearest images")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s", stream=sys.stderr)

    check_arguments(args)
    require_extra("serve", "serve.py")
    require_model_runtime(args.checkpoint)
    if args.index:
        require_extra("embed", "--index")
    from imgcls.serving.app import ServeSettings

    settings = ServeSettings(args.max_batch, args.max_wait_ms, args.workers, args.max_bytes, args.api_key,
                             args.drain_bytes, args.body_timeout)
    if args.onnx_only or importlib.util.find_spec("torch") is None:
        from imgcls.serving.slim import serve_onnx

        return serve_onnx(args.checkpoint, args.host, args.port, settings, args.topk, args.device, args.reject,
                          args.reject_below, args.index)

    from imgcls.cli import announce

    announce(f"serve.py: serving {args.checkpoint} on {args.host}:{args.port}")
    from imgcls.model_files.predictor import TrustOptions
    from imgcls.serving.server import serve

    return serve(args.checkpoint, args.host, args.port, settings, args.topk, args.device,
                 TrustOptions(args.reject, args.reject_below), args.index)
