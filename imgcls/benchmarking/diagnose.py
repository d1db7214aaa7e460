"""`benchmark.py --mode diagnose`: which part bounds training. It measures the loader alone (the configured
workers, and 0, 1, 2, 4, ... up to the core count), the model alone (real training steps on a synthetic
batch on the device) and the real training step (loader and model together), then names the bottleneck
with the numbers behind it and the overrides to apply.

`bottleneck_verdict` is pure: tests inject the rates, so no verdict depends on the test machine's speed."""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

SLOWER = 0.9       # one rate below 90% of another: that part holds the other back
MATCHES = 0.85     # the real step runs at >= 85% of the slower part alone: nothing is lost combining them


def worker_counts(cores: int, configured: int) -> list[int]:
    """0, 1, 2, 4, ... up to the core count, plus the configured count."""
    counts, n = {0, configured}, 1
    while n <= max(cores, 1):
        counts.add(n)
        n *= 2
    return sorted(counts)


def bottleneck_verdict(loader_rate: float, model_rate: float, step_rate: float, workers_rates: dict[int, float],
                       configured_workers: int, cfg_hints: Optional[dict] = None) -> dict:
    """`data`, `compute` or `transfer` from img/s of the loader alone (configured workers), the model alone
    and the real step; `workers_rates` maps worker counts to the loader's img/s. Returns the verdict, why,
    and the overrides to apply."""
    hints = cfg_hints or {}
    limit = min(loader_rate, model_rate)
    if loader_rate < SLOWER * model_rate:
        enough = sorted(w for w, rate in workers_rates.items() if rate >= model_rate)
        best = max(workers_rates, key=workers_rates.get) if workers_rates else configured_workers
        overrides = [f"data.num_workers={enough[0]}"] if enough else (
            [f"data.num_workers={best}"] if best != configured_workers else [])
        if not enough:
            overrides += [f"data.img_size={max(8, hints.get('img_size', 224) * 3 // 4)}"]
        why = (f"the loader alone gives {loader_rate:.1f} img/s with {configured_workers} workers, the model alone "
               f"{model_rate:.1f} img/s: the GPU/CPU waits for data. " +
               (f"{enough[0]} workers reach the model's rate." if enough else
                f"No worker count reaches it (best {workers_rates.get(best, loader_rate):.1f} img/s at {best}): "
                f"decoding is the cost; store images pre-resized near data.img_size, or train at a smaller "
                f"data.img_size."))
        return {"bottleneck": "data", "why": why, "overrides": overrides}
    if step_rate >= MATCHES * limit:
        overrides = [o for o, on in (("train.amp=bf16", hints.get("amp") == "fp32" and hints.get("fast_bf16")),
                                     ("train.channels_last=true", hints.get("channels_last") is False),
                                     ("train.compile=true", hints.get("compile") is False)) if on]
        why = (f"the real step runs at {step_rate:.1f} img/s, the model alone at {model_rate:.1f} img/s and the "
               f"loader is faster ({loader_rate:.1f} img/s): compute bounds the run; mixed precision, "
               f"channels_last and torch.compile make each step cheaper.")
        return {"bottleneck": "compute", "why": why, "overrides": overrides}
    why = (f"the loader alone ({loader_rate:.1f} img/s) and the model alone ({model_rate:.1f} img/s) are both "
           f"faster than the real step ({step_rate:.1f} img/s): the time goes between them, in the host-to-device "
           f"copy or host syncs; pin the loader's memory and prefetch more batches.")
    overrides = [o for o, on in (("data.pin_memory=true", hints.get("cuda") and hints.get("pin_memory") is not True),
                                 (f"data.prefetch_factor={2 * hints.get('prefetch_factor', 2)}", True)) if on]
    return {"bottleneck": "transfer", "why": why, "overrides": overrides}


def diagnose(cfg, device, amp_dtype, batch_size: int, steps: int, warmup: int) -> dict:
    """The measurements and the verdict (benchmark.py's JSON object)."""
    from imgcls.benchmarking.loader import bench_loader
    from imgcls.benchmarking.modes import bench_train
    from imgcls.runtime.device import cpu_has_fast_bf16, pin_memory_for, precision_name

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    configured = cfg.data.num_workers
    workers_rates = {}
    for workers in worker_counts(cores, configured):
        at = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, num_workers=workers))
        workers_rates[workers] = bench_loader(at, device, batch_size, steps, 1, None)["img_per_s"]
    model = bench_train(cfg, device, amp_dtype, batch_size, steps, warmup, synthetic=True)
    step = bench_train(cfg, device, amp_dtype, batch_size, steps, warmup, synthetic=False)
    hints = {"img_size": cfg.data.img_size, "amp": precision_name(amp_dtype), "channels_last": cfg.train.channels_last,
             "compile": cfg.train.compile, "pin_memory": pin_memory_for(cfg.data.pin_memory, device),
             "prefetch_factor": cfg.data.prefetch_factor, "cuda": device.type == "cuda",
             "fast_bf16": device.type == "cuda" or cpu_has_fast_bf16()}
    verdict = bottleneck_verdict(workers_rates[configured], model["img_per_s"], step["img_per_s"], workers_rates,
                                 configured, hints)
    return {"mode": "diagnose", "img_per_s": step["img_per_s"], **verdict,
            "loader_img_per_s": workers_rates[configured], "loader_img_per_s_by_workers": workers_rates,
            "model_img_per_s": model["img_per_s"], "step_img_per_s": step["img_per_s"],
            "step_data_wait_frac": step["data_wait_frac"], "cores": cores}
