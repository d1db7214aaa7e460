"""Export a trained checkpoint for deployment, and check the export against the checkpoint.

python export.py --checkpoint CKPT --format onnx|pt2|openvino|executorch|litert|timm --output PATH
                 [--batch-size N | --dynamic-batch]
                 [--overwrite] [--quantize int8 [--calibration-images N] [--min-agreement F]] [--embedding]

onnx: an ONNX model (BatchNorm folded) with the classes and preprocessing in its metadata_props;
pt2: a torch.export program with the same metadata as the archive's imgcls.json; openvino: an IR folder
(model.xml, model.bin) with the same metadata in the IR's rt_info; timm: a folder with
model.safetensors and config.json that timm.create_model("local-dir:PATH", pretrained=True) loads;
executorch: a .pte program lowered to XNNPACK, the metadata in its constant method imgcls_metadata;
litert: a .tflite model (litert-torch, a fixed batch), the metadata in its metadata table as `imgcls`.
Each export is read back and compared with the checkpoint on a few images (fails above 1e-4 in
probability). --quantize int8: static int8 quantization (onnx: by onnxruntime; openvino: NNCF's
post-training quantization; executorch: PT2E with XNNPACK's quantizer), calibrated on
--calibration-images of the checkpoint's validation split, then compared with the fp32 export on up to
1,000 validation images (top-1 agreement, both accuracies).
--embedding (onnx): a second output named `embedding`, the pooled pre-logits features that embed.py,
search.py and serve.py /embed read (checked: cosine >= 0.999 against the checkpoint's on every check image).
Exit 0 done, 1 the export failed or disagrees, 2 a usage error or a model the format cannot carry.
"""
import argparse
import logging
import sys

from imgcls.cli import announce, require_extra

# the formats export.py writes, named here so --help needs no torch (a test holds them equal to the registered
# export formats of model_files/formats/)
EXPORT_FORMATS = ("onnx", "pt2", "openvino", "executorch", "litert", "timm")
# the optional dependencies a format needs (pt2 and timm: torch and timm alone)
FORMAT_EXTRAS = {"onnx": "export", "openvino": "openvino", "executorch": "executorch", "litert": "litert"}
QUANTIZED_FORMATS = ("onnx", "openvino", "executorch")  # --quantize int8


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="best.pt or last.pt written by train.py")
    parser.add_argument("--format", required=True, choices=EXPORT_FORMATS, help="what to write")
    parser.add_argument("--output", required=True, help="FILE.onnx, FILE.pt2, FILE.pte, FILE.tflite, or a folder "
                        "for openvino and timm")
    batch = parser.add_mutually_exclusive_group()
    batch.add_argument("--batch-size", type=int, help="onnx/pt2/openvino/executorch/litert: the fixed "
                       "batch the model is traced for (default 1)")
    batch.add_argument("--dynamic-batch", action="store_true", help="onnx/pt2/openvino: any batch size; "
                       "executorch: 1 to 32 a call (larger batches run in chunks); litert: refused (fixed only)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing export at --output (never "
                        "a run directory's files)")
    parser.add_argument("--quantize", choices=("int8",), help="onnx (QDQ, per-channel weights), openvino (NNCF) or "
                        "executorch (PT2E, XNNPACK quantizer): static int8, calibrated on the checkpoint's "
                        "validation images")
    parser.add_argument("--calibration-images", type=int, default=256, help="--quantize: validation images the "
                                                                            "activation ranges come from")
    parser.add_argument("--min-agreement", type=float, default=0.97, help="--quantize: exit 1 when int8 and fp32 "
                        "top-1 agree on fewer of up to 1,000 validation images than this fraction")
    parser.add_argument("--embedding", action="store_true", help="onnx: also output the pooled pre-logits "
                        "features as `embedding` (for embed.py, search.py, serve.py /embed)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s", stream=sys.stderr)

    from imgcls.core.errors import ConfigError

    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size}: must be >= 1")
    if args.format == "timm" and (args.batch_size is not None or args.dynamic_batch):
        raise ConfigError("--batch-size / --dynamic-batch: a timm folder holds weights, which take any batch; "
                          "drop the option")

    if args.format == "litert" and args.dynamic_batch:
        raise ConfigError("--dynamic-batch: litert-torch converts a fixed batch only; use --batch-size N (infer.py "
                          "and eval.py run padded batches of N)")
    if args.quantize and args.format not in QUANTIZED_FORMATS:
        raise ConfigError(f"--quantize {args.quantize}: only an ONNX, OpenVINO or ExecuTorch export is quantized; use "
                          f"--format onnx, openvino or executorch")
    if args.quantize and args.calibration_images < 1:
        raise ConfigError(f"--calibration-images {args.calibration_images}: must be >= 1")
    if args.quantize and not 0.0 <= args.min_agreement <= 1.0:
        raise ConfigError(f"--min-agreement {args.min_agreement}: must be between 0 and 1 (a fraction of images)")

    if args.embedding and (args.format != "onnx" or args.quantize):
        raise ConfigError("--embedding: only an fp32 ONNX export carries the embedding output; use --format onnx "
                          "without --quantize")

    if args.format in FORMAT_EXTRAS:
        require_extra(FORMAT_EXTRAS[args.format], f"--format {args.format}")
    announce(f"export.py: exporting {args.checkpoint} as {args.format} to {args.output}")
    from imgcls.commands.export import run_export
    from imgcls.core.errors import sigterm_unwinds

    with sigterm_unwinds():  # the temporary fp32 export, staging and quantization folders go with the process
        return run_export(args.checkpoint, args.format, args.output,
                          None if args.dynamic_batch else args.batch_size or 1, args.quantize, args.calibration_images,
                          args.min_agreement, overwrite=args.overwrite, embedding=args.embedding)
