"""What to label next, and the round trip through Label Studio.

imgcls label pick --checkpoint CKPT --pool DIR|CSV [...] --budget K --output PICKS.csv [--exclude LABELLED.csv]
                  [--strategy default|random|margin|entropy|coreset] [--seed S] [--max-pool N] [--skip-foreign]
                  [--duplicate-similarity X] [--device auto|cpu|cuda] [--num-workers N]
imgcls label push --input PICKS.csv (--output TASKS.json | --url URL --project ID) [--image-root DIR]
imgcls label pull (--input EXPORT.json | --url URL --project ID) --output LABELS.csv [--labelled LABELLED.csv]
                  [--append]

pick: the K pool images to label next; PICKS.csv has `path`, `label` and `prob` (the model's), `score` and
`reason` (why picked). Left out, each counted: unreadable files, images listed in --exclude, near duplicates
of labelled images (embedding cosine similarity >= --duplicate-similarity, default 0.9995), and with
--skip-foreign what the reject option calls unknown (off by default: the stored threshold also rejects the
in-distribution images the model knows least, which are the ones worth labelling). The same checkpoint, pool
and seed give the same picks.
push: the picks (or audit.py --json's likely label errors) as Label Studio tasks, each image with the model's
label as a pre-annotation (`predictions`, with its score): a JSON file to import, or sent to a project of a
running Label Studio (--url; the token from LABEL_STUDIO_API_KEY, never printed). Images are referred to as
Label Studio's local-files URLs (/data/local-files/?d=PATH relative to --image-root, which must be the server's
LABEL_STUDIO_LOCAL_FILES_DOCUMENT_ROOT).
pull: finished annotations (of a project, or an exported JSON) as `path,label` rows train.py reads with
data.format=csv; skipped, cancelled and conflicting annotations are left out and counted. --output never
replaces an existing file; --labelled LABELLED.csv --append writes LABELLED.csv's rows plus the new ones.
"""
import argparse
import logging
import sys

from imgcls.cli import announce
from imgcls.core.errors import ConfigError

SUBCOMMANDS = ("pick", "push", "pull")


def build_parser() -> argparse.ArgumentParser:
    from imgcls.labelling.strategies import STRATEGIES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True, metavar="{pick,push,pull}")
    pick = sub.add_parser("pick", help="the pool images to label next")
    pick.add_argument("--checkpoint", required=True, help="best.pt, last.pt or a timm folder")
    pick.add_argument("--pool", required=True, nargs="+", metavar="DIR|CSV", help="unlabelled images: folders "
                      "(recursive), files, globs or CSV lists with a path column")
    pick.add_argument("--budget", required=True, type=int, metavar="K", help="how many to pick")
    pick.add_argument("--output", required=True, metavar="PICKS.csv")
    pick.add_argument("--exclude", metavar="LABELLED.csv", help="the labelled path,label CSV: its images are not "
                      "picked, and their near duplicates are left out")
    pick.add_argument("--strategy", choices=STRATEGIES, default="default")
    pick.add_argument("--seed", type=int, default=0)
    pick.add_argument("--max-pool", type=int, default=None, help="score at most N pool images (a seeded random "
                      "subset; default 20000)")
    pick.add_argument("--skip-foreign", action="store_true", help="leave out what the reject option calls unknown "
                      "(needs best.pt's stored threshold)")
    pick.add_argument("--duplicate-similarity", type=float, default=None, help="embedding cosine similarity to a "
                      "labelled image from which a pool image is its near duplicate (default 0.9995; 1.01: off)")
    pick.add_argument("--device", default="auto")
    pick.add_argument("--num-workers", type=int, default=0)
    push = sub.add_parser("push", help="picks or audit findings as Label Studio tasks")
    push.add_argument("--input", required=True, metavar="PICKS.csv|AUDIT.json")
    push.add_argument("--output", metavar="TASKS.json")
    push.add_argument("--format", choices=("label-studio",), default="label-studio")
    push.add_argument("--url", help="a running Label Studio (token: LABEL_STUDIO_API_KEY)")
    push.add_argument("--project", type=int, metavar="ID")
    push.add_argument("--image-root", metavar="DIR", help="the server's LABEL_STUDIO_LOCAL_FILES_DOCUMENT_ROOT "
                      "(default: the current folder)")
    pull = sub.add_parser("pull", help="finished annotations as a path,label CSV")
    pull.add_argument("--input", metavar="EXPORT.json")
    pull.add_argument("--url")
    pull.add_argument("--project", type=int, metavar="ID")
    pull.add_argument("--output", required=True, metavar="LABELS.csv")
    pull.add_argument("--image-root", metavar="DIR", help="as for push (default: the current folder)")
    pull.add_argument("--labelled", metavar="LABELLED.csv", help="the labelled CSV these annotations extend")
    pull.add_argument("--append", action="store_true", help="write --labelled's rows and the new ones to --output")
    return parser


def check_source(args, flag_of_file: str) -> None:
    """Exactly one of a file and a server (--url with --project)."""
    from_file = getattr(args, flag_of_file) is not None
    if from_file == (args.url is not None):
        raise ConfigError(f"label {args.action}: give --{flag_of_file} FILE or --url URL --project ID (one of them)")
    if args.url is not None and args.project is None:
        raise ConfigError(f"label {args.action} --url {args.url}: name the project (--project ID)")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s", stream=sys.stderr)
    if args.action == "pick":
        return pick(args)
    from imgcls.labelling import label_studio

    if args.action == "push":
        if args.url is None and args.output is None:
            raise ConfigError("label push: give --output TASKS.json or --url URL --project ID")
        if args.url is not None and args.output is not None:
            raise ConfigError("label push: give --output TASKS.json or --url URL --project ID, not both")
        if args.url is not None and args.project is None:
            raise ConfigError(f"label push --url {args.url}: name the project (--project ID)")
        return label_studio.run_push(args.input, args.output, args.url, args.project, args.image_root)
    check_source(args, "input")
    if args.append and not args.labelled:
        raise ConfigError("label pull --append: name the labelled CSV it extends (--labelled LABELLED.csv)")
    return label_studio.run_pull(args.input, args.url, args.project, args.output, args.image_root, args.labelled,
                                 args.append)


def pick(args) -> int:
    from imgcls.core.files import check_output_file, check_outputs_apart

    if args.budget < 1:
        raise ConfigError(f"--budget {args.budget}: must be >= 1")
    if args.max_pool is not None and args.max_pool < args.budget:
        raise ConfigError(f"--max-pool {args.max_pool}: must be at least --budget {args.budget}")
    check_output_file("--output", args.output, ".csv")
    check_outputs_apart({"--output": args.output}, {"checkpoint": [args.checkpoint], "--exclude": [args.exclude],
                                                    "pool list": [p for p in args.pool if p.lower().endswith(".csv")]},
                        {"pool folder": [p for p in args.pool if not p.lower().endswith(".csv")]})
    announce(f"label pick: {args.budget} of {' '.join(args.pool[:3])} with {args.checkpoint}")
    from imgcls.labelling.picking import DEFAULT_DUPLICATE_SIMILARITY, DEFAULT_MAX_POOL, PickOptions, run_pick

    options = PickOptions(args.budget, args.strategy, args.seed,
                          DEFAULT_MAX_POOL if args.max_pool is None else args.max_pool, args.skip_foreign,
                          DEFAULT_DUPLICATE_SIMILARITY if args.duplicate_similarity is None
                          else args.duplicate_similarity, args.device, args.num_workers)
    return run_pick(args.checkpoint, args.pool, args.output, args.exclude, options)
