"""Map-style datasets that return fixed-size uint8 tensors.

Training items are addressed by `(index, seed)` from `TrainSampler`; an unreadable file is replaced by
a seeded re-draw from the same class (so the class mix is unchanged) and reported through the item.
Evaluation items are never substituted: an unreadable file yields a zero image with `valid = False`.
"""
from __future__ import annotations

import random

import torch
from torch.utils.data import Dataset

from imgcls.data.file_list import describe_failure
from imgcls.data.listing.folder import ImageIndex
from imgcls.data.images import ImageDecodeError
from imgcls.data.transforms import blank_for

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
            except ImageDecodeError:
                if first_unreadable < 0:
                    first_unreadable = index
                index = redraw.choice(self.by_class[label])
        raise ImageDecodeError(f"{MAX_REDRAWS} files of class '{self.index.label_name(label)}' in a row could "
                               f"not be read, starting with {self.index.paths[first_unreadable]}")

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
