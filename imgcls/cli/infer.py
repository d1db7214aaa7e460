"""Classify images, folders (recursively) or globs with a trained checkpoint.

python infer.py PATH [PATH ...] [--checkpoint CKPT] [--batch-size N] [--topk K] [--output FILE.csv|FILE.json]
                [--amp none|bf16|fp16|auto] [--compile] [--num-workers N] [--device auto|cpu|cuda] [--classes FILE]
                [--reject] [--reject-below X] [--explain DIR] [--threshold X] [--save-images DIR]
                [--pseudo-labels FILE.csv] [--pseudo-threshold X]

PATH may be an image URL (http:// or https://): downloaded (at most 10 MB, within 30 s) and read like a file;
a URL that fails (an HTTP error, a timeout, too large, not an image) gets a row with `error`.

CKPT is a checkpoint written by train.py or a model written by export.py (FILE.onnx, run by onnxruntime;
FILE.pt2; an OpenVINO IR folder or its model.xml, run by OpenVINO; a timm folder). `prob` is calibrated: the
softmax of the logits divided by the temperature stored with the model (none stored: the plain softmax).

--pseudo-labels FILE.csv: offline self-training; the images whose calibrated `prob` is at least --pseudo-threshold
(default 0.9) are written as rows path (absolute), label, prob, threshold, a list train.py takes as
data.extra_train_csv (docs/semi_supervised.md). Single-label models only.

Without --checkpoint, the newest best.pt under ./runs/ is used. Exit 0 when at least one image was
classified, 1 when none could be, 2 on a usage error.
"""
import argparse
import logging
import os
import sys

from imgcls.cli import announce, finite_float, require_extra, require_model_runtime
from imgcls.core.errors import ConfigError
from imgcls.core.files import check_output_file
from imgcls.core.host import usable_cpus

OUTPUT_FORMATS = (".csv", ".json")


def default_workers() -> int:
    """Up to 8 decoding processes, one per usable core."""
    return min(8, usable_cpus())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", metavar="PATH", help="image files, folders (recursive), globs or image "
                                                                  "URLs (http(s)://...; at most 10 MB, 30 s each)")
    parser.add_argument("--checkpoint", help="best.pt or last.pt, or an export: FILE.onnx, FILE.pt2, an OpenVINO "
                        "IR folder or its .xml, a timm folder (default: the newest best.pt under ./runs/)")
    parser.add_argument("--batch-size", type=int, help="images per forward pass, the last batch padded (default 32; "
                                                       "a fixed-batch export's own batch)")
    parser.add_argument("--classes", help="class names, one per line, for a model that records none (a foreign "
                                          "ONNX file; default class_0, class_1, ...)")
    parser.add_argument("--topk", type=int, default=5, help="labels and probabilities kept per image (clipped to "
                                                            "the class count)")
    parser.add_argument("--output", help="write one row per input file to FILE.csv or FILE.json")
    parser.add_argument("--amp", choices=("none", "bf16", "fp16", "auto"),
                        help="precision (default: the checkpoint's train.amp, resolved for this device)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (one shape, one compile)")
    parser.add_argument("--num-workers", type=int, default=default_workers(), help="decoding processes")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--reject", action="store_true", help="label 'unknown' every image whose reject score is "
                        "below the threshold stored with the model (kept: calibration.coverage of the validation "
                        "images); the would-be label goes to 'predicted'")
    parser.add_argument("--reject-below", type=finite_float, metavar="X", help="--reject with this score threshold "
                        "instead of the stored one")
    parser.add_argument("--explain", metavar="DIR", help="write a Grad-CAM overlay PNG per image into DIR and its "
                        "heatmap peak (original pixels) into the rows (checkpoints only)")
    parser.add_argument("--save-images", metavar="DIR", help="write each classified image into DIR as a PNG with its "
                        "label and probability drawn on it (00007_name.png: never over an input)")
    parser.add_argument("--threshold", type=float, help="multi-label models: call a tag at this probability for "
                                                        "every class (default: the per-class thresholds tuned "
                                                        "in training)")
    parser.add_argument("--pseudo-labels", metavar="FILE.csv", help="also write the confident predictions as "
                        "path,label,prob,threshold rows: extra training data (data.extra_train_csv)")
    parser.add_argument("--pseudo-threshold", type=finite_float, default=0.9, metavar="X",
                        help="--pseudo-labels: the least calibrated probability a row needs (default 0.9)")
    args = parser.parse_intermixed_args(argv)  # options may come before or after the positionals
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s", stream=sys.stderr)

    batch_size = 1 if args.batch_size is None else args.batch_size  # None: the default (or the export's own)
    for flag, value, low in (("--batch-size", batch_size, 1), ("--topk", args.topk, 1),
                             ("--num-workers", args.num_workers, 0)):
        if value < low:
            raise ConfigError(f"{flag} {value}: must be >= {low}")
    if args.output and os.path.splitext(args.output)[1].lower() not in OUTPUT_FORMATS:
        raise ConfigError(f"--output {args.output}: the name must end in .csv or .json")
    check_output_file("--output", args.output)
    if args.save_images and os.path.exists(args.save_images) and not os.path.isdir(args.save_images):
        raise ConfigError(f"--save-images {args.save_images}: a file is there; name a folder for the annotated images")
    if args.pseudo_labels and not args.pseudo_labels.lower().endswith(".csv"):
        raise ConfigError(f"--pseudo-labels {args.pseudo_labels}: the name must end in .csv")
    if not 0.0 <= args.pseudo_threshold <= 1.0:
        raise ConfigError(f"--pseudo-threshold {args.pseudo_threshold}: a probability within [0, 1]")
    check_output_file("--pseudo-labels", args.pseudo_labels)
    require_model_runtime(args.checkpoint)
    if args.explain:
        require_extra("explain", "--explain")
    announce(f"infer.py: classifying {' '.join(args.inputs[:3])}{' ...' if len(args.inputs) > 3 else ''} with "
             f"{args.checkpoint or 'the newest best.pt under runs/'}")

    from imgcls.commands.infer import run_inference
    from imgcls.commands.infer import PseudoLabels
    from imgcls.model_files.predictor import TrustOptions

    pseudo = PseudoLabels(args.pseudo_labels, args.pseudo_threshold) if args.pseudo_labels else None
    return run_inference(args.inputs, args.checkpoint, args.batch_size, args.topk, args.output, args.amp,
                         args.compile, args.num_workers, args.device, args.classes,
                         TrustOptions(args.reject, args.reject_below, args.explain), args.threshold,
                         args.save_images, pseudo)
