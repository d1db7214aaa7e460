"""Find the indexed images nearest to each query image (cosine of the embeddings).

python search.py QUERY [QUERY ...] --index DIR [--top-k K] [--output FILE.csv|FILE.json] [--checkpoint CKPT]
                 [--batch-size N] [--num-workers N] [--device auto|cpu|cuda]

DIR: a folder written by embed.py. The queries (files, folders, globs, CSV lists) are embedded with the
model that built the index (index.json names it; --checkpoint names it elsewhere, or its export.py
--embedding ONNX file). Rows: query, rank, path, score (cosine, higher is closer); an unreadable query gets
an error. Exit 0 when at least one query was read, 1 when none could be, 2 on a usage error (also: a
query model other than the index's, naming both).
"""
import argparse
import logging
import os
import sys

from imgcls.cli import announce, require_extra, require_model_runtime
from imgcls.core.errors import ConfigError
from imgcls.core.files import check_output_file
from imgcls.core.host import usable_cpus


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("queries", nargs="+", metavar="QUERY", help="image files, folders (recursive), globs or "
                                                                    "CSV lists")
    parser.add_argument("--index", required=True, metavar="DIR", help="a folder written by embed.py")
    parser.add_argument("--top-k", type=int, default=5, help="neighbours per query (default 5)")
    parser.add_argument("--output", help="write the rows to FILE.csv or FILE.json")
    parser.add_argument("--checkpoint", help="the index's model at another path (default: the one index.json names)")
    parser.add_argument("--batch-size", type=int, help="query images per forward pass (default 32)")
    parser.add_argument("--num-workers", type=int, default=min(8, usable_cpus()), help="decoding processes")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s", stream=sys.stderr)
    batch_size = 1 if args.batch_size is None else args.batch_size  # None: the default
    for flag, value in (("--top-k", args.top_k), ("--batch-size", batch_size)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: must be >= 1")
    if args.num_workers < 0:
        raise ConfigError(f"--num-workers {args.num_workers}: must be >= 0")
    if args.output and os.path.splitext(args.output)[1].lower() not in (".csv", ".json"):
        raise ConfigError(f"--output {args.output}: the name must end in .csv or .json")
    check_output_file("--output", args.output)
    require_extra("embed", "search.py")
    require_model_runtime(args.checkpoint)
    announce(f"search.py: searching {args.index} for {' '.join(args.queries[:3])}"
             f"{' ...' if len(args.queries) > 3 else ''}")

    from imgcls.commands.embed import run_search

    return run_search(args.queries, args.index, args.top_k, args.output, args.checkpoint, args.batch_size,
                      args.num_workers, args.device)
