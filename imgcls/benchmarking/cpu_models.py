"""Small models on a CPU: parameters, forward GFLOPs per image and inference img/s (fp32, eager) for a list of
model.name values, as docs/performance.md (which small models suit a CPU)'s guide shows them. Fresh weights: speed does not depend on them.

python -m imgcls.benchmarking.cpu_models [--models NAME,NAME,...] [--img-size 224] [--batch 8] [--repeats 5]
    [--threads N]     prints a Markdown table (one row a model, fastest first) and, with --json PATH, the rows
"""
from __future__ import annotations

import argparse
import statistics
import time

DEFAULT_MODELS = ("resnet10t", "resnet18", "mobilenetv3_small_100", "mobilenetv3_large_100", "mobilenetv4_conv_small",
                  "efficientnet_b0", "regnetx_004", "ghostnet_100", "tv:mobilenet_v3_small", "tv:shufflenet_v2_x1_0")


def model_row(name: str, img_size: int, batch: int, repeats: int, classes: int = 10) -> dict:
    """{"model", "params_m", "gflops", "img_per_s"} of `name` on the CPU: img/s is the median of `repeats` timed
    forward passes of a `batch` of random images, after one untimed pass."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from imgcls.config import load_config
    from imgcls.models.factory import build_model

    model = build_model(load_config("quickstart", [f"model.name={name}"]).model, classes).eval()
    params = sum(p.numel() for p in model.parameters())
    images = torch.randn(batch, 3, img_size, img_size)
    with torch.inference_mode():
        with FlopCounterMode(display=False) as counter:
            model(images[:1])
        model(images)
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(images)
            seconds.append(time.perf_counter() - start)
    # FlopCounterMode counts a multiply-add as 2 FLOPs
    return {"model": name, "params_m": round(params / 1e6, 2), "gflops": round(counter.get_total_flops() / 1e9, 3),
            "img_per_s": round(batch / statistics.median(seconds), 1)}


def markdown(rows: list[dict]) -> str:
    lines = ["| model.name | parameters (M) | GFLOPs / image | img/s |", "| --- | --- | --- | --- |"]
    lines += [f"| `{r['model']}` | {r['params_m']} | {r['gflops']} | {r['img_per_s']} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="model.name values, comma-separated")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    for flag, value in (("--img-size", args.img_size), ("--batch", args.batch), ("--repeats", args.repeats)):
        if value < 1:
            parser.error(f"{flag} {value}: must be at least 1")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [model_row(name.strip(), args.img_size, args.batch, args.repeats)
            for name in args.models.split(",") if name.strip()]
    rows.sort(key=lambda r: -r["img_per_s"])
    print(f"{args.img_size} px, batch {args.batch}, fp32, {torch.get_num_threads()} thread(s), median of "
          f"{args.repeats}")
    print(markdown(rows))
    if args.json:
        from imgcls.core.files import write_json

        write_json({"img_size": args.img_size, "batch": args.batch, "threads": torch.get_num_threads(),
                    "rows": rows}, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
