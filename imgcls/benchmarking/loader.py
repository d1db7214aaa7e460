"""Loader throughput: our training loader against torchvision's ImageFolder + PIL + transforms, timed in
alternation, whole epochs at a time (`benchmark.py --mode loader`)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

import torch

from imgcls.runtime.device import pin_memory_for
from imgcls.tuning.timing import process_tree_cpu_seconds, sync


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
