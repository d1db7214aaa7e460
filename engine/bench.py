"""Measuring the pieces of a training run: loader throughput, the real training step, evaluation.

Used by `benchmark.py` and by the batch-size finder (`engine/batch_finder.py`). Everything timed here is
the code the trainer runs: the loaders from `data.build`, `engine.loop.train_one_epoch` on a
`StepContext`, and infer.py's padded batches through `engine.inference.predict`; only the surroundings (which batches, how many) differ.
"""
from __future__ import annotations

import contextlib
from itertools import repeat
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterable, Iterator, Optional

import numpy as np
import torch

from engine.device import pin_memory_for
from engine.loop import EpochProgress, StepContext, StepHooks, train_one_epoch
from engine.optim import build_optimizer
from engine.schedule import build_scheduler
from models.factory import create_model


# ---------------------------------------------------------------- memory


def _read_status_kb(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window: CUDA's max-allocated counter, or the process's RSS high-water mark
    (Linux resets it when 5 is written to /proc/self/clear_refs; elsewhere the lifetime peak is kept)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA max allocated since the last reset, or the process's peak RSS on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    hwm = _read_status_kb("VmHWM")
    if hwm is not None:
        return hwm * 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def available_memory_bytes() -> int:
    kb = None
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    kb = int(line.split()[1])
    if kb is None:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return kb * 1024


def process_tree_cpu_seconds() -> float:
    """CPU time (user + system) of this process plus its live children (loader workers). On a busy machine
    wall-clock rates follow the load of other processes; CPU seconds per image do not."""
    import os

    usage = resource.getrusage(resource.RUSAGE_SELF)
    total = usage.ru_utime + usage.ru_stime
    me = os.getpid()
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:  # ppid; then utime, stime are fields 14, 15 of the whole line
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def current_rss_bytes() -> int:
    kb = _read_status_kb("VmRSS")
    return (kb or 0) * 1024


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- the training step


def build_step_context(cfg, num_classes: int, device: torch.device, amp_dtype: Optional[torch.dtype],
                       compile_model: bool = False) -> StepContext:
    """A model, optimizer and `StepContext` built like the trainer's, for measuring training steps."""
    model = create_model(cfg.model.name, num_classes, cfg.model.drop_rate, cfg.model.drop_path_rate,
                         cfg.model.norm, cfg.model.group_norm_groups)
    memory_format = torch.channels_last if cfg.train.channels_last else torch.contiguous_format
    model = model.to(device, memory_format=memory_format)
    optimizer = build_optimizer(model, cfg.optim, cfg.optim.lr)
    scheduler = build_scheduler(optimizer, 0, 10**9, 1.0, 1.0)  # constant LR: only the cost matters here
    train_model = torch.compile(model, dynamic=False) if compile_model else model
    return StepContext(
        model=train_model, criterion=torch.nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing),
        optimizer=optimizer, scheduler=scheduler,
        scaler=torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16), device=device,
        amp_dtype=amp_dtype, mean=cfg.data.mean, std=cfg.data.std, channels_last=cfg.train.channels_last,
        accum_steps=1, clip_grad_norm=cfg.train.clip_grad_norm, nonfinite=cfg.train.nonfinite,
        max_nonfinite_in_row=cfg.train.max_nonfinite_in_row,
        distributed=False)


def synthetic_batch(batch_size: int, img_size: int, num_classes: int, device: torch.device, train: bool = True):
    """Random uint8 images and labels already on the device, shaped like a loader batch."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (batch_size, 3, img_size, img_size), dtype=torch.uint8, generator=generator)
    targets = torch.randint(0, num_classes, (batch_size,), generator=generator)
    images, targets = images.to(device), targets.to(device)
    if train:
        return images, targets, torch.full((batch_size,), -1, dtype=torch.int64)
    return images, targets, torch.ones(batch_size, dtype=torch.bool), torch.arange(batch_size)


class TimedIterator:
    """Wraps batches and adds up the time spent waiting for the next one (the data wait)."""

    def __init__(self, batches: Iterable):
        self.batches = iter(batches)
        self.wait_s = 0.0

    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()
        try:
            return next(self.batches)
        finally:
            self.wait_s += time.perf_counter() - start


_NO_HOOKS = StepHooks(checkpoint_due=lambda step: False, stop_requested=lambda step: False,
                      save=lambda progress: None, log_step=lambda step, values: None)


@dataclass
class StepTiming:
    steps: int
    images: int
    total_s: float
    data_wait_s: float
    peak_memory_bytes: int
    cpu_s: float = 0.0

    @property
    def img_per_s(self) -> float:
        return self.images / self.total_s if self.total_s > 0 else 0.0

    @property
    def step_s(self) -> float:
        return self.total_s / max(self.steps, 1)


def time_train_steps(ctx: StepContext, batches: Iterable, steps: int, warmup: int) -> StepTiming:
    """Run `warmup` then `steps` real training steps (`train_one_epoch`) on `batches`; time the latter."""
    iterator = iter(batches)
    if warmup:
        train_one_epoch(ctx, iterator, warmup, 0, EpochProgress(), SimpleNamespace(step=0), _NO_HOOKS, 10**9)
    sync(ctx.device)
    reset_peak_memory(ctx.device)
    timed = TimedIterator(iterator)
    progress = EpochProgress()
    cpu_start = process_tree_cpu_seconds()
    start = time.perf_counter()
    # train_one_epoch ends with one host sync (the epoch's loss sum), so the clock stops after the work.
    train_one_epoch(ctx, timed, steps, 0, progress, SimpleNamespace(step=0), _NO_HOOKS, 10**9)
    sync(ctx.device)
    total = time.perf_counter() - start
    return StepTiming(steps, progress.samples, total, timed.wait_s, peak_memory_bytes(ctx.device),
                      process_tree_cpu_seconds() - cpu_start)


def loader_batches(loader, sampler=None, start_epoch: int = 0) -> Iterator:
    """Batches from a loader across epochs, forever (the sampler's epoch advances like the trainer's)."""
    epoch = start_epoch
    while True:
        if sampler is not None:
            sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


# ---------------------------------------------------------------- loaders


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
    in the workers, with the same augmentation, workers and prefetch as ours."""
    import torchvision
    from torchvision import transforms as T

    from data.transforms import TV_INTERPOLATION

    d = cfg.data
    transform = T.Compose([
        T.RandomResizedCrop(d.img_size, scale=tuple(d.scale), ratio=tuple(d.ratio),
                            interpolation=TV_INTERPOLATION[d.interpolation]),
        T.RandomHorizontalFlip(d.hflip),
        T.ToTensor(),
        T.Normalize(d.mean, d.std),
    ])
    dataset = torchvision.datasets.ImageFolder(str(Path(d.root).expanduser() / d.train_split), transform=transform)
    extra = {}
    if d.num_workers > 0:
        extra = {"persistent_workers": d.persistent_workers, "prefetch_factor": d.prefetch_factor}
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=d.num_workers,
                                       pin_memory=pin_memory, drop_last=True, **extra)


# ---------------------------------------------------------------- generated photos


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


def sample_photo_crop(rng: np.random.Generator, sources: list) -> "Image.Image":
    """A real photo at an ImageNet-like size: a random crop (60-100% of each side) of one of `sources` (PIL
    images), maybe mirrored or turned, resized so its long side is 400-640 px."""
    from PIL import Image

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
    from PIL import Image

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


def mib(nbytes: int) -> float:
    return round(nbytes / 2**20, 1)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)



# ---------------------------------------------------------------- benchmark.py modes


def settings(cfg, device: torch.device, amp_dtype, batch_size: int, synthetic: bool) -> dict:
    amp = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[amp_dtype]
    return {"model": cfg.model.name, "img_size": cfg.data.img_size, "batch": batch_size, "amp": amp,
            "channels_last": cfg.train.channels_last, "compile": cfg.train.compile,
            "workers": 0 if synthetic else cfg.data.num_workers, "device": str(device), "synthetic": synthetic,
            "torch_threads": torch.get_num_threads()}


def bench_loader(cfg, device: torch.device, batch_size: int, steps: int, rounds: int, baseline: Optional[str]) -> dict:
    """Our training loader (uint8 batches; on CUDA also normalised there, once per batch) against, optionally,
    torchvision's ImageFolder + PIL pipeline (float batches normalised in the workers); timed in
    alternation, whole epochs at a time. On the CPU the normalisation is part of the training step
    (`--mode train`), as in the trainer."""
    from data.build import build_train_data
    from data.transforms import normalize_batch

    pin = pin_memory_for(cfg.data.pin_memory, device)
    data = build_train_data(cfg, batch_size, 0, 1, pin)

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


def bench_train(cfg, device: torch.device, amp_dtype, batch_size: int, steps: int, warmup: int,
                synthetic: bool) -> dict:
    """Real training steps: on the real loader, or (`synthetic`) on one random batch already on the device."""
    if synthetic:
        num_classes = 1000
        batches = repeat(synthetic_batch(batch_size, cfg.data.img_size, num_classes, device))
    else:
        from data.build import build_train_data

        pin = pin_memory_for(cfg.data.pin_memory, device)
        data = build_train_data(cfg, batch_size, 0, 1, pin)
        num_classes = len(data.classes)
        batches = loader_batches(data.train_loader, data.sampler)
    ctx = build_step_context(cfg, num_classes, device, amp_dtype, compile_model=cfg.train.compile)
    timing = time_train_steps(ctx, batches, steps, warmup)
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
    in loader workers, then `engine.inference.predict`; or (`synthetic`) the forward alone on a random
    batch already on the device. Non-synthetic runs go over the validation split's files, repeated to
    at least `steps` batches."""
    from engine.inference import predict

    if synthetic:
        num_classes = 1000
        images = synthetic_batch(batch_size, cfg.data.img_size, num_classes, device, train=False)[0]
        batch = (images, torch.ones(batch_size, dtype=torch.bool), torch.arange(batch_size), [""] * batch_size)
        loader, warm_loader = [batch] * steps, [batch] * max(1, warmup)
    else:
        from data.build import eval_transform, scan_tree
        from data.inference import FileListDataset, build_inference_loader

        pin = pin_memory_for(cfg.data.pin_memory, device)
        _, val_index = scan_tree(cfg)
        num_classes = len(val_index.classes)
        paths = list(val_index.paths) * max(1, ceil_div(steps * batch_size, len(val_index.paths)))
        transform = eval_transform(cfg)
        loader = build_inference_loader(FileListDataset(paths, transform, cfg.data.img_size), batch_size,
                                        cfg.data.num_workers, pin, cfg.data.prefetch_factor)
        warm_loader = build_inference_loader(FileListDataset(paths[:batch_size], transform, cfg.data.img_size),
                                             batch_size, 0, pin)
    model = create_model(cfg.model.name, num_classes, norm=cfg.model.norm, group_norm_groups=cfg.model.group_norm_groups)
    memory_format = torch.channels_last if cfg.train.channels_last else torch.contiguous_format
    model = model.to(device, memory_format=memory_format).eval()
    if cfg.train.compile:
        model = torch.compile(model, dynamic=False)
    k = min(5, num_classes)
    predict(model, warm_loader, device, cfg.data.mean, cfg.data.std, cfg.train.channels_last, amp_dtype, k)
    reset_peak_memory(device)
    sync(device)
    start = time.perf_counter()
    preds = predict(model, loader, device, cfg.data.mean, cfg.data.std, cfg.train.channels_last, amp_dtype, k)
    sync(device)
    seconds = time.perf_counter() - start
    images = int(preds.valid.sum())
    return {"mode": "infer", "img_per_s": round(images / seconds, 2), "images": images,
            "seconds": round(seconds, 3), "peak_memory_mb": mib(peak_memory_bytes(device)),
            "peak_memory_kind": "cuda_max_allocated" if device.type == "cuda" else "process_peak_rss"}
