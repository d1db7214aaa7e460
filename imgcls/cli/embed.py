"""Write the embeddings (pooled pre-logits features) of images, folders (recursive), globs or CSV lists,
with a similarity index over them for search.py and serve.py --index.

python embed.py PATH [PATH ...] --checkpoint CKPT_OR_EXPORT --output DIR [--batch-size N] [--amp none|bf16|fp16|auto]
                [--num-workers N] [--device auto|cpu|cuda]

CKPT_OR_EXPORT: a checkpoint written by train.py, a timm folder, or an ONNX file written by export.py
--embedding. DIR gets embeddings.npy (float32, one L2-normalised row per readable image), paths.csv
(index, path, error: an unreadable file has an error and no row), index.faiss and index.json (model, dim,
metric, count, kind, the model file and its sha256). Run again on a grown folder, only the new files are
embedded and added. Exit 0 when DIR holds vectors, 1 when no file could be read, 2 on a usage error (also:
DIR holds another model's vectors).
"""
import argparse
import logging
import sys

from imgcls.cli import announce, require_extra, require_model_runtime
from imgcls.core.errors import ConfigError
from imgcls.core.host import usable_cpus


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", metavar="PATH", help="image files, folders (recursive), globs or CSV "
                                                                  "lists")
    parser.add_argument("--checkpoint", required=True, help="best.pt or last.pt, a timm folder, or FILE.onnx "
                                                            "written by export.py --embedding")
    parser.add_argument("--output", required=True, metavar="DIR", help="the embedding folder (created; an earlier "
                                                                       "one grows by the new files)")
    parser.add_argument("--batch-size", type=int, help="images per forward pass, the last batch padded (default 32; "
                                                       "a fixed-batch export's own batch)")
    parser.add_argument("--amp", choices=("none", "bf16", "fp16", "auto"),
                        help="precision (default: the checkpoint's train.amp, resolved for this device)")
    parser.add_argument("--num-workers", type=int, default=min(8, usable_cpus()),
                        help="decoding processes (default: one per usable core, at most 8)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s", stream=sys.stderr)
    batch_size = 1 if args.batch_size is None else args.batch_size  # None: the default (or the export's own)
    for flag, value, low in (("--batch-size", batch_size, 1), ("--num-workers", args.num_workers, 0)):
        if value < low:
            raise ConfigError(f"{flag} {value}: must be >= {low}")
    require_extra("embed", "embed.py")
    require_model_runtime(args.checkpoint)
    announce(f"embed.py: embedding {' '.join(args.inputs[:3])}{' ...' if len(args.inputs) > 3 else ''} with "
             f"{args.checkpoint} into {args.output}")

    from imgcls.commands.embed import run_embed

    return run_embed(args.inputs, args.checkpoint, args.output, args.batch_size, args.amp, args.num_workers,
                     args.device)
