"""`benchmark.py --mode train|infer`: real training steps and infer.py's prediction pass, on the real
loader or on a synthetic batch already on the device."""
from __future__ import annotations

import time
from itertools import repeat
from typing import Iterator

import torch

from imgcls.core.config import eval_size
from imgcls.runtime.cpu_tuning import omp_wait_description
from imgcls.tuning.batch_finder import build_training_probe
from imgcls.data.normalisation import for_timing
from imgcls.runtime.device import DeviceInput, memory_format, pin_memory_for, precision_name
from imgcls.evaluation.evaluate import predict
from imgcls.runtime.memory import mib, peak_memory_bytes, reset_peak_memory
from imgcls.training.schedule import ceil_div
from imgcls.tuning.timing import sync, synthetic_batch, time_train_steps
from imgcls.models.factory import build_model


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
        from imgcls.data.file_list import FileListDataset, build_inference_loader

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
