"""Evaluate a checkpoint on its validation data (a class-folder split, the held-out files of a
data.val_fraction split, a CSV list or WebDataset shards), exactly as training validated it.

python eval.py --checkpoint CKPT [--data ROOT] [--split val] [--batch-size N] [--json FILE] [--tta] [--classes FILE]
               [--reliability FILE.png] [--reject-below X] [--knn K] [--linear-probe]
               [KEY=VALUE ...]

CKPT: a checkpoint written by train.py, or a model written by export.py (FILE.onnx, FILE.pt2, an OpenVINO IR
folder or its .xml, a timm folder).
--knn K / --linear-probe judge the pooled pre-logits features without the head: knn_top1 (cosine kNN, the
training split as the memory bank, a weighted vote of K neighbours) / linear_probe_top1 (a logistic
regression fitted on the frozen training-split features). One process: eval.py does not run under torchrun.
"""
import argparse
import logging
import sys

from imgcls.cli import announce, finite_float, require_model_runtime
from imgcls.core.files import check_output_file


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="best.pt or last.pt written by train.py, or a model "
                        "written by export.py (FILE.onnx, FILE.pt2, an OpenVINO IR folder or its .xml, a timm folder)")
    parser.add_argument("--data", help="data root holding SPLIT/<class>/... (default: the checkpoint's data.root), "
                                       "or a CSV list (path,label) to evaluate")
    parser.add_argument("--split", help="split folder under the data root (default: the checkpoint's data.val_split)")
    parser.add_argument("--batch-size", type=int, help="default: the training batch size, which reproduces "
                                                       "training's validation numbers exactly")
    parser.add_argument("--json", help="write the metrics here, the confusion matrix as <name>_confusion.png, the "
                                       "precision-recall curves as <name>_pr.png (single-label) and the "
                                       "misclassified images as <name>_errors.csv and <name>_errors.html beside it")
    parser.add_argument("--tta", action="store_true", help="average the predictions of the image and its mirror image")
    parser.add_argument("--classes", help="class names, one per line, for a model that records none (a foreign ONNX "
                                          "file; default class_0, class_1, ...)")
    parser.add_argument("--reliability", metavar="FILE.png", help="draw the reliability diagram (calibrated "
                                                                  "probabilities) here")
    parser.add_argument("--predictions", metavar="FILE.csv|FILE.json", help="write infer.py's row for every "
                        "evaluated image here, with its `target` (the Predictor's rows, as infer.py and serve.py give)")
    parser.add_argument("--reject-below", type=finite_float, metavar="X", help="the reject score threshold for the "
                        "'selective' figures (default: the one stored with the model)")
    parser.add_argument("--knn", type=int, metavar="K", help="also knn_top1: cosine kNN of the split's features "
                        "against the training split's, a weighted vote of K neighbours")
    parser.add_argument("--linear-probe", action="store_true", help="also linear_probe_top1: a logistic regression "
                        "fitted on the training split's frozen features")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="override the checkpoint's config, e.g. train.device=cpu data.num_workers=4; "
                             "tracking.backend=mlflow [tracking.uri=STORE] adds the figures to the checkpoint's "
                             "tracking run (never to a store only the checkpoint names)")
    args = parser.parse_intermixed_args(argv)  # options may come before or after the positionals
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s", stream=sys.stderr)
    if args.knn is not None and args.knn < 1:
        from imgcls.core.errors import ConfigError

        raise ConfigError(f"--knn {args.knn}: must be >= 1 (neighbours voting)")
    check_output_file("--json", args.json)
    check_output_file("--reliability", args.reliability, ".png")
    check_output_file("--predictions", args.predictions)
    require_model_runtime(args.checkpoint)
    from imgcls.tracking.runs import check_eval_tracking

    check_eval_tracking(args.overrides, args.checkpoint, args.data)  # only the tracking asked for here, checked now
    announce(f"eval.py: evaluating {args.checkpoint}" + (f" on {args.data}" if args.data else ""))

    from imgcls.commands.evaluate import (evaluate_checkpoint, pretrained_features_only, report_evaluation,
                                          report_features_only)
    from imgcls.commands.output_roles import confusion_png_path

    features_only = pretrained_features_only(args.checkpoint, args.data, args.overrides, args.knn, args.linear_probe)
    if features_only is not None:
        report_features_only(features_only, args.json)
        return 0 if features_only["num_samples"] else 1
    result = evaluate_checkpoint(args.checkpoint, args.data, args.split, args.batch_size, args.tta, args.overrides,
                                 args.classes, args.reject_below,
                                 outputs={"--json": args.json, "--reliability": args.reliability,
                                          "--predictions": args.predictions},
                                 knn=args.knn, linear_probe=args.linear_probe)
    report_evaluation(result, args.json, args.reliability, args.predictions)
    from imgcls.tracking.runs import log_evaluation

    log_evaluation(args.checkpoint, args.overrides, {**result.metrics, **(result.trust or {})},
                   [args.json, confusion_png_path(args.json) if args.json else None, args.reliability])
    if result.metrics["num_samples"] == 0:
        print("error: no image in the split could be read", file=sys.stderr)
        return 1
    return 0
