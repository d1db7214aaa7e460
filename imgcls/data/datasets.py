"""Inference inputs: command-line paths expanded to a file list, a dataset over it, and a loader whose
every batch has exactly `batch_size` images (the last one padded), so the model sees one shape.

An unreadable file yields a zero image with `valid = False` and the reason, never an exception: the
run goes on and the file gets an error row.

Map-style datasets that return fixed-size uint8 tensors.

Training items are addressed by `(index, seed)` from `TrainSampler`; an unreadable file is replaced by
a seeded re-draw from the same class (so the class mix is unchanged) and reported through the item.
Evaluation items are never substituted: an unreadable file yields a zero image with `valid = False`."""
from __future__ import annotations

import glob
import os
import random
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from imgcls.data.images import IMAGE_EXTENSIONS, ImageDecodeError
from imgcls.data.listing import DataTreeError, ImageIndex, csv_paths, list_images, report_skipped
from imgcls.data.loaders import seed_worker
from imgcls.data.transforms import blank_for

_GLOB_CHARS = set("*?[")


def expand_inputs(inputs: list[str]) -> list[str]:
    """Files as given (whatever their extension), CSV lists (the files of their `path` column, relative to
    the CSV's folder), folders recursively (image extensions, hidden entries skipped), globs (`**` allowed)
    expanded the same way. Duplicates are kept once, in first-seen order.
    A path that does not exist, or a glob that matches nothing, is a DataTreeError (exit 2)."""
    found: list[str] = []
    missing: list[str] = []
    skipped: list[str] = []
    for item in inputs:
        if item.lower().endswith(".csv") and os.path.isfile(item):  # a CSV list: the files of its path column
            found.extend(csv_paths(item))
        elif os.path.isdir(item):
            found.extend(list_images(Path(item), skipped, file_links_out=True))
        elif os.path.exists(item):
            found.append(item)
        elif _GLOB_CHARS & set(item):
            matches = sorted(glob.glob(item, recursive=True))
            if not matches:
                missing.append(item)
            for match in matches:
                found.extend(list_images(Path(match), skipped, file_links_out=True) if os.path.isdir(match) else [match])
        else:
            missing.append(item)
    if missing:
        raise DataTreeError(f"no such file or folder (or the pattern matches nothing): {', '.join(missing)}")
    report_skipped("inputs", skipped)
    unique = list(dict.fromkeys(found))
    if not unique:
        raise DataTreeError(f"no image files found in {', '.join(inputs)} (looked for "
                            f"{', '.join(IMAGE_EXTENSIONS)} files, hidden entries skipped)")
    return unique


class FileListDataset(Dataset):
    """paths -> (uint8 image, valid, index, error message or '')."""

    def __init__(self, paths: list[str], transform, img_size: int):
        self.paths = paths
        self.transform = transform
        self.img_size = img_size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        path = self.paths[i]
        try:
            return self.transform(path), True, i, ""
        except (ImageDecodeError, OSError) as err:  # OSError: permission denied, file gone since listing, ...
            return blank_for(self.transform, self.img_size), False, i, describe_failure(path, err)


def describe_failure(path: str, err: Exception) -> str:
    """Why a file could not be read, without repeating its path (an image's bytes: the reason alone)."""
    if isinstance(path, (bytes, bytearray, memoryview)):
        return str(err).removeprefix("<image bytes>: ")
    try:
        if os.path.isfile(path) and os.path.getsize(path) == 0:
            return "empty file"
    except OSError:
        pass
    text = str(err) if isinstance(err, ImageDecodeError) else f"{type(err).__name__}: {err}"
    return text.removeprefix(f"{path}: ")


class PaddedCollate:
    """Stack a batch and pad it with zero images to `batch_size`. Returns (images [batch_size, 3, H, W]
    uint8, valid [n] bool, indices [n] int64, errors [n] str) for the n real items."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size

    def __call__(self, items):
        images = torch.stack([item[0] for item in items])
        pad = self.batch_size - images.shape[0]
        if pad > 0:
            images = torch.cat([images, images.new_zeros((pad,) + images.shape[1:])])
        valid = torch.tensor([item[1] for item in items], dtype=torch.bool)
        indices = torch.tensor([item[2] for item in items], dtype=torch.int64)
        return images, valid, indices, [item[3] for item in items]


def build_inference_loader(dataset: FileListDataset, batch_size: int, num_workers: int, pin_memory: bool,
                           prefetch_factor: int = 4) -> DataLoader:
    """In order, no shuffling; workers decode while the model runs (none for a single batch, where
    there is nothing to overlap, and never more than there are batches). The batch is at most the number
    of inputs: one image is not padded to a batch of 4096 (every batch still has one shape)."""
    batch_size = max(1, min(batch_size, len(dataset)))
    batches = -(-len(dataset) // batch_size)
    workers = min(num_workers, batches) if batches > 1 else 0
    options = {"prefetch_factor": prefetch_factor, "worker_init_fn": seed_worker} if workers else {}
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=workers, pin_memory=pin_memory,
                      collate_fn=PaddedCollate(batch_size), drop_last=False, **options)


def inference_batches(paths: list[str], transform, batch_size: int, num_workers: int, device) -> DataLoader:
    """The padded batches of `paths` through a model's eval `transform`, as infer.py, embed.py, search.py and
    the Python API read them (pinned for a CUDA device)."""
    return build_inference_loader(FileListDataset(paths, transform, transform.img_size), batch_size, num_workers,
                                  pin_memory=device.type == "cuda")

MAX_REDRAWS = 20


class TrainDataset(Dataset):
    def __init__(self, index: ImageIndex, transform):
        self.index = index
        self.transform = transform
        # files by label (a class, or a tag set): an unreadable file is replaced by one of the same label
        self.by_class: dict = {}
        for i, label in enumerate(index.labels):
            self.by_class.setdefault(label, []).append(i)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, key):
        """Returns (uint8 image, label, index of the unreadable file it replaced or -1)."""
        index, seed = key if isinstance(key, tuple) else (key, key)
        label = self.index.labels[index]
        redraw = random.Random(seed)
        first_unreadable = -1
        for _ in range(MAX_REDRAWS):
            try:
                with torch.random.fork_rng(devices=[]):
                    # The CPU generator only: torch.manual_seed would also queue seeds for CUDA/XPU/MTIA, which
                    # costs ~1 ms per sample in a worker (a stack trace per lazy call); transforms run on the CPU.
                    torch.default_generator.manual_seed(seed)
                    image = self.transform(self.index.paths[index], seed)
                return image, self.index.target(label), first_unreadable
            except ImageDecodeError as err:
                if first_unreadable < 0:
                    first_unreadable, reason = index, describe_failure(self.index.paths[index], err)
                index = redraw.choice(self.by_class[label])
        raise ImageDecodeError(f"{MAX_REDRAWS} files of class '{self.index.label_name(label)}' in a row could "
                               f"not be read, starting with {self.index.paths[first_unreadable]} ({reason})")

    def failure_reason(self, index: int) -> str:
        """Why file `index` could not be read, in infer.py's words ("empty file", "truncated", ...): read
        again here, as the loader worker that failed on it keeps only the index."""
        path = self.index.paths[index]
        try:
            with torch.random.fork_rng(devices=[]):  # the training run's RNG stream stays untouched
                self.transform(path, 0)
        except (ImageDecodeError, OSError) as err:
            return describe_failure(path, err)
        return "could not be read during training (it reads now)"


class EvalDataset(Dataset):
    def __init__(self, index: ImageIndex, transform, img_size: int):
        self.index = index
        self.transform = transform
        self.img_size = img_size

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int):
        """Returns (uint8 image, label, valid, index)."""
        try:
            return self.transform(self.index.paths[i]), self.index.target(self.index.labels[i]), True, i
        except ImageDecodeError:
            return (blank_for(self.transform, self.img_size),
                    self.index.target(self.index.labels[i]), False, i)


def failure_reason(dataset, index: int) -> str:
    """Why training sample `index` of `dataset` could not be read and what took its place: a file dataset
    reads the file again to say; a shard stream keeps no file to read again."""
    if isinstance(dataset, TrainDataset):
        return f"{dataset.failure_reason(index)}; replaced by another image of its class"
    return "a broken sample in its shard; replaced by the next readable sample"
