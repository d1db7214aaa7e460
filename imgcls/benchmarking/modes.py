"""Photo-like JPEG trees to benchmark the loader on: generated noisy photos, or crops of scikit-learn's
two real sample photos at ImageNet sizes (`benchmark.py --make-photos`).

`benchmark.py --mode find-batch`'s reading for a person (stderr; stdout keeps the one JSON object): what to
set, why, and how far the timings can be trusted.

Loader throughput: our training loader against torchvision's ImageFolder + PIL + transforms, timed in
alternation, whole epochs at a time (`benchmark.py --mode loader`).

`benchmark.py --mode train|infer`: real training steps and infer.py's prediction pass, on the real
loader or on a synthetic batch already on the device.

`benchmark.py --mode diagnose`: which part bounds training. It measures the loader alone (the configured
workers, and 0, 1, 2, 4, ... up to the core count), the model alone (real training steps on a synthetic
batch on the device) and the real training step (loader and model together), then names the bottleneck
with the numbers behind it and the overrides to apply.

`bottleneck_verdict` is pure: tests inject the rates, so no verdict depends on the test machine's speed."""
from __future__ import annotations

import dataclasses
import os
import time
from itertools import repeat
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import torch
from PIL import Image

from imgcls.compute.cpu_tuning import omp_wait_description
from imgcls.compute.device import DeviceInput, memory_format, pin_memory_for, precision_name
from imgcls.compute.memory import mib, peak_memory_bytes, reset_peak_memory
from imgcls.data.build import for_timing
from imgcls.data.settings import eval_size
from imgcls.evaluation.evaluate import predict
from imgcls.models.factory import build_model
from imgcls.training.batch_finder import (build_training_probe, process_tree_cpu_seconds, sync, synthetic_batch,
                                          time_train_steps)
from imgcls.training.schedule import ceil_div


def photo(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """A photo-like RGB array: smooth colour gradients and soft blobs (low frequencies) plus sensor-like
    noise, which JPEG-compresses to a realistic few hundred KB per megapixel."""
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None]
    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :]
    out = np.empty((height, width, 3), dtype=np.float32)
    for c in range(3):
        a, b, d = rng.uniform(-120, 120, size=3)
        out[..., c] = 128 + a * x + b * y + d * x * y
    for _ in range(4):
        cx, cy = rng.uniform(0, 1, size=2)
        radius = rng.uniform(0.05, 0.3)
        colour = rng.uniform(-90, 90, size=3).astype(np.float32)
        blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * radius ** 2))
        out += blob[..., None] * colour
    out += rng.normal(0, 10, size=out.shape).astype(np.float32)
    return np.clip(out, 0, 255).astype(np.uint8)


def sample_photo_crop(rng: np.random.Generator, sources: list) -> Image.Image:
    """A real photo at an ImageNet-like size: a random crop (60-100% of each side) of one of `sources` (PIL
    images), maybe mirrored or turned, resized so its long side is 400-640 px."""
    src = sources[int(rng.integers(len(sources)))]
    fraction = rng.uniform(0.6, 1.0)
    w, h = int(src.width * fraction), int(src.height * fraction)
    left, top = int(rng.integers(0, src.width - w + 1)), int(rng.integers(0, src.height - h + 1))
    img = src.crop((left, top, left + w, top + h))
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    if rng.random() < 0.3:
        img = img.transpose(Image.Transpose.ROTATE_90)
    scale = rng.uniform(400, 640) / max(img.size)
    return img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.Resampling.LANCZOS)


def write_photo_tree(root: Path, train_images: int = 200, val_images: int = 40, classes: int = 4, seed: int = 0,
                     quality: int = 90, source: str = "generated") -> Path:
    """root/{train,val}/class_k/*.jpg.

    source `generated`: photo-like JPEGs of 500x375 up to 1024x768 (landscape and portrait) with sensor-like
    noise, at `quality` (decode-heavy). `samples`: crops of scikit-learn's two real sample photos
    (china.jpg, flower.jpg, 640x427) at 400-640 px, quality 85-95, the sizes of ImageNet's photos."""
    rng = np.random.default_rng(seed)
    sources = []
    if source == "samples":
        from sklearn.datasets import load_sample_images

        sources = [Image.fromarray(array) for array in load_sample_images().images]
    for split, count in (("train", train_images), ("val", val_images)):
        for i in range(count):
            folder = Path(root) / split / f"class_{i % classes}"
            folder.mkdir(parents=True, exist_ok=True)
            if sources:
                img = sample_photo_crop(rng, sources)
                img.save(folder / f"{i:05d}.jpg", quality=int(rng.integers(85, 96)))
                continue
            width = int(rng.integers(500, 1025))
            height = int(round(width * 0.75))
            if rng.random() < 0.25:
                width, height = height, width
            Image.fromarray(photo(rng, width, height)).save(folder / f"{i:05d}.jpg", quality=quality)
    return Path(root)

# the recommendation leaves at least this many optimizer steps per epoch (an effective batch close to the
# training split gives one or two updates per epoch: nothing to schedule, warm up or early-stop on)
MIN_STEPS_PER_EPOCH = 8


def find_batch_summary(report: dict) -> str:
    """Lines: the setting to use, the speed table (median img/s over the timing rounds and their spread), the
    steps per epoch it leaves, and a warning when the timings did not settle."""
    lines = [f"find-batch: use train.batch_size={report['batch_size']} train.accum_steps={report['accum_steps']} "
             f"(effective batch {report['effective_batch']} on {report['world_size']} process(es); the largest "
             f"batch that fits is {report['max_batch']}, the smallest as fast as the best is "
             f"{report['fastest_small_batch']})"]
    if report.get("steps_per_epoch") is not None:
        lines.append(f"  {report['steps_per_epoch']} optimizer steps per epoch over {report['train_images']} "
                     f"training images (the target effective batch is kept to at least {MIN_STEPS_PER_EPOCH})")
    lines.append(f"  {'batch':>6} {'img/s':>9} {'spread':>7} {'peak MiB':>9}")
    for row in report["table"]:
        lines.append(f"  {row['batch']:>6} {row['img_per_s']:>9.1f} {100 * row.get('img_per_s_spread', 0):>6.1f}% "
                     f"{row['peak_memory_mb']:>9.0f}")
    rounds = report.get("timing_rounds", 1)
    if report.get("timing_stable", True):
        lines.append(f"  timings stable: {rounds} round(s), every batch within 10% of itself")
    else:
        worst = max(row.get("img_per_s_spread", 0) for row in report["table"])
        lines.append(f"  WARNING: timings not stable after {rounds} rounds (a batch's img/s varied by "
                     f"{100 * worst:.0f}%): the machine is busy, and a run now may pick another batch; rerun "
                     f"when it is idle, or take the largest that fits")
    return "\n".join(lines)


def time_loader_epochs(loader, min_batches: int, sampler=None, epoch: int = 0,
                       consume: Callable = lambda images: images) -> tuple[float, float, int, int]:
    """Iterate whole epochs until at least `min_batches` batches came; returns (seconds, CPU seconds of this
    process and its workers, images, epochs).

    Whole epochs, so no worker is still busy with prefetched batches when another loader is timed next.
    `consume(images)` takes each batch to where the model would read it (device, float, normalised).
    """
    batches = images = epochs = 0
    cpu_start = process_tree_cpu_seconds()
    start = time.perf_counter()
    while batches < min_batches:
        if sampler is not None:
            sampler.set_epoch(epoch + epochs)
        for batch in loader:
            consume(batch[0])
            batches += 1
            images += batch[0].shape[0]
        epochs += 1
        if batches == 0:
            raise ValueError("the loader yields no batches (batch size larger than the split?)")
    seconds = time.perf_counter() - start
    return seconds, process_tree_cpu_seconds() - cpu_start, images, epochs


def torchvision_train_loader(cfg, batch_size: int, pin_memory: bool):
    """The common reference pipeline: ImageFolder + PIL + torchvision.transforms, float tensors normalised
    in the workers, with the same augmentation (the auto-augment policy on the PIL crop, as torchvision's
    reference scripts apply it), workers and prefetch as ours."""
    import torchvision
    from torchvision import transforms as T

    from imgcls.data.transforms import TV_INTERPOLATION, auto_augment_policy

    d = cfg.data
    policy = auto_augment_policy(d.auto_augment, d.auto_augment_magnitude, d.auto_augment_ops, d.interpolation)
    transform = T.Compose([
        T.RandomResizedCrop(d.img_size, scale=tuple(d.scale), ratio=tuple(d.ratio),
                            interpolation=TV_INTERPOLATION[d.interpolation]),
        T.RandomHorizontalFlip(d.hflip),
        *([policy] if policy is not None else []),
        T.ToTensor(),
        T.Normalize(d.mean, d.std),
    ])
    dataset = torchvision.datasets.ImageFolder(str(Path(d.root).expanduser() / d.train_split), transform=transform)
    extra = {}
    if d.num_workers > 0:
        extra = {"persistent_workers": d.persistent_workers, "prefetch_factor": d.prefetch_factor}
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=d.num_workers,
                                       pin_memory=pin_memory, drop_last=True, **extra)


def bench_loader(cfg, device: torch.device, batch_size: int, steps: int, rounds: int, baseline: Optional[str]) -> dict:
    """Our training loader (uint8 batches; on CUDA also normalised there, once per batch) against, optionally,
    torchvision's ImageFolder + PIL pipeline (float batches normalised in the workers); timed in
    alternation, whole epochs at a time. On the CPU the normalisation is part of the training step
    (`--mode train`), as in the trainer."""
    from imgcls.data.build import build_run_data
    from imgcls.data.transforms import normalize_batch

    pin = pin_memory_for(cfg.data.pin_memory, device)
    data = build_run_data(cfg, batch_size, 0, 1, pin)

    def ours(images):
        images = images.to(device, non_blocking=True)
        if device.type == "cuda":  # part of the loader's hand-over there; on the CPU, of the training step
            return normalize_batch(images, cfg.data.mean, cfg.data.std, channels_last=cfg.train.channels_last)
        return images

    def theirs(images):
        return images.to(device, non_blocking=True)

    contenders = [("ours", data.train_loader, data.sampler, ours)]
    if baseline == "torchvision":
        contenders.append(("torchvision", torchvision_train_loader(cfg, batch_size, pin), None, theirs))
    totals = {name: [0.0, 0.0, 0] for name, *_ in contenders}
    per_round = {name: [] for name, *_ in contenders}
    epochs = {name: 0 for name, *_ in contenders}
    for name, loader, sampler, consume in contenders:  # untimed: start workers, fill the page cache
        *_, n = time_loader_epochs(loader, 1, sampler, epochs[name], consume)
        epochs[name] += n
    for _ in range(rounds):
        for name, loader, sampler, consume in contenders:
            seconds, cpu, images, n = time_loader_epochs(loader, steps, sampler, epochs[name], consume)
            sync(device)
            epochs[name] += n
            totals[name][0] += seconds
            totals[name][1] += cpu
            totals[name][2] += images
            per_round[name].append(round(images / seconds, 1))
    rate = {name: images / seconds for name, (seconds, _, images) in totals.items()}
    cpu_ms = {name: 1000 * cpu / images for name, (_, cpu, images) in totals.items()}
    out = {"mode": "loader", "img_per_s": round(rate["ours"], 1), "img_per_s_rounds": per_round["ours"],
           "cpu_ms_per_img": round(cpu_ms["ours"], 3), "images": totals["ours"][2],
           "seconds": round(totals["ours"][0], 3), "train_images": len(data.train_index), "pin_memory": pin,
           "prefetch_factor": cfg.data.prefetch_factor}
    if baseline:
        out["baseline"] = baseline
        out["baseline_img_per_s"] = round(rate[baseline], 1)
        out["baseline_img_per_s_rounds"] = per_round[baseline]
        out["baseline_cpu_ms_per_img"] = round(cpu_ms[baseline], 3)
        out["ratio"] = round(rate["ours"] / rate[baseline], 3)
        # The same ratio from CPU time (main process + workers): what the wall-clock ratio is on an idle machine.
        out["cpu_ratio"] = round(cpu_ms[baseline] / cpu_ms["ours"], 3)
    return out


def loader_batches(loader, sampler=None, start_epoch: int = 0) -> Iterator:
    """Batches from a loader across epochs, forever (the sampler's epoch advances like the trainer's)."""
    epoch = start_epoch
    while True:
        if sampler is not None:
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def settings(cfg, runtime, batch_size: int, synthetic: bool) -> dict:
    device, amp_dtype = runtime.device, runtime.amp_dtype
    return {"model": cfg.model.name, "img_size": cfg.data.img_size, "batch": batch_size,
            "amp": precision_name(amp_dtype),
            "channels_last": cfg.train.channels_last, "compile": cfg.train.compile,
            "workers": 0 if synthetic else cfg.data.num_workers, "device": str(device), "synthetic": synthetic,
            "torch_threads": torch.get_num_threads(), "omp_wait": omp_wait_description(),
            "reuse_host_memory": cfg.train.reuse_host_memory}


def bench_train(cfg, device: torch.device, amp_dtype, batch_size: int, steps: int, warmup: int,
                synthetic: bool) -> dict:
    """Real training steps: on the real loader, or (`synthetic`) on one random batch already on the device."""
    if synthetic:
        num_classes = 1000
        batches = repeat(synthetic_batch(batch_size, cfg.data.img_size, num_classes, device,
                                         channels=cfg.data.channels))
    else:
        from imgcls.data.build import build_run_data

        pin = pin_memory_for(cfg.data.pin_memory, device)
        data = build_run_data(cfg, batch_size, 0, 1, pin)
        num_classes = len(data.classes)
        batches = loader_batches(data.train_loader, data.sampler)
    step = build_training_probe(cfg, num_classes, device, amp_dtype, compile_model=cfg.train.compile)
    timing = time_train_steps(step, batches, steps, warmup)
    compute = timing.total_s - timing.data_wait_s
    return {"mode": "train", "img_per_s": round(timing.img_per_s, 2), "steps": steps, "warmup": warmup,
            "step_s": round(timing.step_s, 5), "data_wait_s": round(timing.data_wait_s / steps, 5),
            "compute_s": round(compute / steps, 5),
            "data_wait_frac": round(timing.data_wait_s / timing.total_s, 4) if timing.total_s else 0.0,
            "cpu_s_per_step": round(timing.cpu_s / steps, 5), "peak_memory_mb": mib(timing.peak_memory_bytes),
            "peak_memory_kind": "cuda_max_allocated" if device.type == "cuda" else "process_peak_rss"}


def bench_infer(cfg, device: torch.device, amp_dtype, batch_size: int, steps: int, warmup: int,
                synthetic: bool) -> dict:
    """infer.py's path: padded fixed-shape batches from the eval transform (decode, resize, centre crop, uint8)
    in loader workers, then `evaluation.evaluate.predict`; or (`synthetic`) the forward alone on a random
    batch already on the device. Non-synthetic runs go over the validation split's files, repeated to
    at least `steps` batches."""
    if synthetic:
        num_classes = 1000
        images = synthetic_batch(batch_size, eval_size(cfg.data), num_classes, device, train=False,
                                 channels=cfg.data.channels)[0]
        batch = (images, torch.ones(batch_size, dtype=torch.bool), torch.arange(batch_size), [""] * batch_size)
        loader, warm_loader = [batch] * steps, [batch] * max(1, warmup)
    else:
        from imgcls.data.build import eval_transform, scan_splits
        from imgcls.data.datasets import FileListDataset, build_inference_loader

        pin = pin_memory_for(cfg.data.pin_memory, device)
        _, val_index = scan_splits(cfg)
        num_classes = len(val_index.classes)
        paths = list(val_index.paths) * max(1, ceil_div(steps * batch_size, len(val_index.paths)))
        transform = eval_transform(cfg.data)
        loader = build_inference_loader(FileListDataset(paths, transform, transform.img_size), batch_size,
                                        cfg.data.num_workers, pin, cfg.data.prefetch_factor)
        warm_loader = build_inference_loader(FileListDataset(paths[:batch_size], transform, transform.img_size),
                                             batch_size, 0, pin)
    model = build_model(cfg.model, num_classes, cfg.data.channels)
    model = model.to(device, memory_format=memory_format(cfg.train.channels_last)).eval()
    if cfg.train.compile:
        model = torch.compile(model, dynamic=False)
    k = min(5, num_classes)
    device_input = DeviceInput.from_config(for_timing(cfg), device, amp_dtype)
    predict(model, warm_loader, device_input, k)
    reset_peak_memory(device)
    sync(device)
    start = time.perf_counter()
    preds = predict(model, loader, device_input, k)
    sync(device)
    seconds = time.perf_counter() - start
    images = int(preds.valid.sum())
    return {"mode": "infer", "img_per_s": round(images / seconds, 2), "images": images,
            "seconds": round(seconds, 3), "peak_memory_mb": mib(peak_memory_bytes(device)),
            "peak_memory_kind": "cuda_max_allocated" if device.type == "cuda" else "process_peak_rss"}


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
    from imgcls.compute.device import cpu_has_fast_bf16, pin_memory_for, precision_name

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
