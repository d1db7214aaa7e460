"""`data.unlabeled`: the unlabelled images of semi-supervised training (objectives/semi.py), read by the training
images' own readers (the same decode path, channel and bit-depth rules, unreadable files replaced and counted).

The list: a folder (every image under it, any tree: sub-folder names are not labels), a CSV of paths (the
`data.csv_path_column` column, relative paths against the CSV's folder), or local WebDataset tar shards (a `.tar`
file, a brace pattern or '::'-joined patterns, as `data.train_shards` takes them; labels in them are ignored).
Shards are indexed once at start (`ShardMembers`: each image member's shard, byte offset and size, and its name) and
a member is read by one seek, so shards are random access like files and the stream below is the same. `check_unlabeled` refuses what cannot
work before any work (exit 2): no images, files with another channel count than `data.channels`; it warns when the
folder is (or holds) the training split, whose labels are then thrown away.

The stream: an endless sequence of global positions g = 0, 1, 2, ...; position g reads image
`perm_r[g mod N]` of round r = g div N, where `perm_r` is a permutation of the N images seeded by (train.seed, r).
A process's k-th unlabelled batch of `batch` images holds the positions (k x batch + j) x world + rank, j < batch,
so the world's k-th batches together are the positions k x batch x world ... (k + 1) x batch x world - 1 at any
world size, and each image's two views are seeded by (train.seed, g): two processes read and augment exactly the
images one process reads with twice the batch. Where the stream is is one number, the batches taken (`start`):
what last.pt keeps to resume it.

Each item is two views of one image: the weak one (crop and flip: the pseudo-label's) and the strong one (the
recipe's crop, its auto-augment policy or RandAugment, and random erasing filled with the mean: the view that
learns the pseudo-label)."""
from __future__ import annotations

import hashlib
import logging
import os
import random
import tarfile
from array import array
from pathlib import Path
from typing import Optional

import torch
from torch.utils.data import Dataset, Sampler
from torchvision.transforms import v2

from imgcls.core.errors import ConfigError, ImageDecodeError
from imgcls.data.images import IMAGE_EXTENSIONS, check_bad_fraction
from imgcls.data.listing import csv_paths, list_images, relative_key, report_skipped
from imgcls.data.loaders import Loader, mix_seed, seed_worker
from imgcls.data.settings import not_a_folder
from imgcls.data.shards import IMAGE_KEYS as SHARD_IMAGE_KEYS, expand_shards, local_path
from imgcls.data.transforms import EvalTransform, TrainTransform, auto_augment_policy, reads_bands

log = logging.getLogger(__name__)


WEAK_MIN_SCALE = 0.6   # the weak view's crop keeps at least this share of the area (FixMatch: a 12.5% shift)


PROBED_FILES = 16      # files read before any work to check their channel count


MAX_REDRAWS = 20


_ORDER_STREAM, _VIEW_STREAM = 0x0C1A55, 0x5E31


class ShardMembers:
    """The image members of local tar shards, random access: `members[i]` is image i's name (`shard.tar/member`),
    `read(i)` its bytes. Per image: its name, a shard number (int32), an offset and a size (int64)."""

    def __init__(self, files: list[str]):
        self.files = files
        self.names: list[str] = []
        self.shard, self.offset, self.size = array("i"), array("q"), array("q")
        for number, path in enumerate(files):
            self._index(number, path)

    def _index(self, number: int, path: str) -> None:
        keys = set()
        try:
            with tarfile.open(path, "r:") as tar:
                for member in tar:
                    folder, _, base = member.name.rpartition("/")
                    stem, _, ext = base.partition(".")  # webdataset's key: the name up to the base's first dot
                    key = f"{folder}/{stem}"
                    if not member.isfile() or ext.lower() not in SHARD_IMAGE_KEYS or key in keys:
                        continue  # labels, metadata; one image per sample key
                    keys.add(key)
                    self.names.append(f"{Path(path).name}/{member.name}")
                    self.shard.append(number)
                    self.offset.append(member.offset_data)
                    self.size.append(member.size)
        except (tarfile.TarError, OSError) as err:
            log.warning("data.unlabeled: shard %s cannot be read past %d image(s) (%s: %s); the rest of it is left "
                        "out", path, len(keys), type(err).__name__, err)

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i: int) -> str:
        return self.names[i]

    def read(self, i: int) -> bytes:
        with open(self.files[self.shard[i]], "rb") as f:
            f.seek(self.offset[i])
            data = f.read(self.size[i])
        if len(data) != self.size[i]:
            raise ImageDecodeError(f"{self.names[i]}: the shard is cut short")
        return data


def image_of(paths, i: int):
    """What the transforms read for image i: its file path, or a shard member's bytes."""
    return paths.read(i) if isinstance(paths, ShardMembers) else paths[i]


def shard_files(value: str) -> Optional[list[str]]:
    """The local shard files `data.unlabeled` names, or None when it names no shards (a folder or a CSV).
    ConfigError for pipes, URLs and missing shard files."""
    if Path(value).expanduser().is_dir() or value.lower().endswith(".csv"):
        return None
    urls = expand_shards(value)
    if not urls or not all(url.endswith(".tar") for url in urls):
        return None
    files = [local_path(url) for url in urls]
    remote = [url for url, path in zip(urls, files) if path is None]
    if remote:
        raise ConfigError(f"'data.unlabeled' = {value}: {remote[0]} is not a local file; unlabelled shards are read "
                          f"by offset, so they must be local tar files (a path, a brace pattern or '::'-joined)")
    missing = [path for path in files if not os.path.isfile(path)]
    if missing:
        raise ConfigError(f"'data.unlabeled' = {value}: no shard file {missing[0]}"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return [os.path.expanduser(path) for path in files]


def list_unlabeled(d) -> tuple:
    """(the image paths of `data.unlabeled` or its ShardMembers, the folder, CSV or shard pattern they came from);
    ConfigError (exit 2) when there are none."""
    source = Path(d.unlabeled).expanduser()
    shards = shard_files(str(d.unlabeled))
    if shards is not None:
        paths = ShardMembers(shards)
    elif source.is_file() and source.suffix.lower() == ".csv":
        named = csv_paths(source, d.csv_path_column)
        paths = [p for p in named if os.path.isfile(p)]
        if len(paths) < len(named):
            missing = [p for p in named if not os.path.isfile(p)]
            log.warning("data.unlabeled %s: %d of %d row(s) name files that do not exist, left out: %s", source,
                        len(missing), len(named), ", ".join(missing[:20]) + (", ..." if len(missing) > 20 else ""))
            check_bad_fraction(missing, len(named), f"unlabelled (missing, from {source})", d.max_bad_fraction)
    elif source.is_dir():
        skipped: list[str] = []
        paths = list_images(source, skipped)
        report_skipped(f"data.unlabeled {source}", skipped)
    else:
        raise ConfigError(f"'data.unlabeled' = {d.unlabeled}: {not_a_folder(source)}; give a folder of images, a "
                          f"CSV of their paths or local .tar shards")
    if not len(paths):
        raise ConfigError(f"'data.unlabeled' = {d.unlabeled}: no images found (looked for "
                          f"{', '.join(IMAGE_EXTENSIONS if shards is None else SHARD_IMAGE_KEYS)} "
                          f"{'files, hidden entries skipped' if shards is None else 'members in its shards'})")
    return paths, str(source)


def check_unlabeled(d):
    """The unlabelled paths, checked before any work: some exist; the first readable ones have `data.channels`
    channels (ConfigError naming the file). Warns when the folder is, holds or lies in the training folder."""
    paths, source = list_unlabeled(d)
    probe = EvalTransform(d.img_size, d.crop_pct, d.interpolation, d.channels, d.value_range)
    problems = []
    for i in range(min(PROBED_FILES, len(paths))):
        try:
            probe(image_of(paths, i))
            break
        except (ImageDecodeError, OSError) as err:
            if "data.channels asks" in str(err):
                raise ConfigError(f"'data.unlabeled' = {d.unlabeled}: {paths[i]}: {err}; unlabelled images must have the "
                                  f"channels of the labelled ones") from err
            problems.append(str(err))
    else:
        raise ConfigError(f"'data.unlabeled' = {d.unlabeled}: none of its first {len(problems)} files can be read "
                          f"({problems[0]})")
    training = training_folder(d)
    if training is not None and Path(source).is_dir():
        mine, theirs = Path(os.path.realpath(source)), Path(os.path.realpath(training))
        if mine == theirs or mine in theirs.parents or theirs in mine.parents:
            log.warning("data.unlabeled %s %s the training folder %s: those images have labels, which are ignored "
                        "there (the labelled split teaches them anyway); point data.unlabeled at images without "
                        "labels", source, "is" if mine == theirs else ("holds" if mine in theirs.parents else
                                                                      "lies in"), training)
    if isinstance(paths, ShardMembers) and d.format == "webdataset" and d.train_shards:
        labelled = {os.path.realpath(path) for path in map(local_path, expand_shards(d.train_shards)) if path}
        shared = [path for path in paths.files if os.path.realpath(path) in labelled]
        if shared:
            log.warning("data.unlabeled %s holds %d of the training shards (%s ...): those images have labels, "
                        "which are ignored there; point data.unlabeled at shards without labels", source,
                        len(shared), shared[0])
    return paths


def training_folder(d) -> Optional[Path]:
    """The labelled training folder of a folder source (None for lists and shards)."""
    if d.format != "folder" or not d.root:
        return None
    root = Path(d.root).expanduser()
    return root if d.val_fraction is not None else root / d.train_split


def unlabeled_digest(paths, base: str) -> str:
    """SHA-256 of the list's names under its folder (shard members: `shard.tar/member`): the same unlabelled set on
    any machine."""
    h = hashlib.sha256()
    for path in paths:
        h.update(f"{path if isinstance(paths, ShardMembers) else relative_key(path, Path(base))}\n".encode())
    return h.hexdigest()


class UnlabeledStream(Sampler):
    """One process's share of the endless unlabelled stream (see the module), from its batch `start` on: yields
    (image index, global position)."""

    def __init__(self, n: int, seed: int, batch: int, rank: int = 0, world_size: int = 1, start: int = 0):
        self.n, self.seed, self.batch, self.rank, self.world_size, self.start = n, seed, batch, rank, world_size, start
        self._round, self._perm = -1, None

    def position(self, batch_number: int, j: int) -> int:
        return (batch_number * self.batch + j) * self.world_size + self.rank

    def image_at(self, position: int) -> int:
        round_number = position // self.n
        if round_number != self._round:
            generator = torch.Generator().manual_seed(mix_seed(self.seed, round_number, _ORDER_STREAM))
            self._round, self._perm = round_number, torch.randperm(self.n, generator=generator).tolist()
        return self._perm[position % self.n]

    def __iter__(self):
        batch_number = self.start
        while True:
            for j in range(self.batch):
                g = self.position(batch_number, j)
                yield self.image_at(g), g
            batch_number += 1


class TwoViews:
    """(path, seed) -> (weak uint8 view, strong view): each a function of (file, seed)."""

    def __init__(self, d):
        weak_scale = [max(d.scale[0], WEAK_MIN_SCALE), d.scale[1]]
        if weak_scale[0] > weak_scale[1]:
            weak_scale = [d.scale[1], d.scale[1]]
        self.weak = TrainTransform(d.img_size, weak_scale, d.ratio, d.hflip, 0.0, d.interpolation, None, d.channels,
                                   d.value_range)
        policy = None
        if not reads_bands(d.channels, d.value_range):  # colour policies are for 8-bit RGB (data/settings.py)
            policy = auto_augment_policy(d.auto_augment or "randaugment", d.auto_augment_magnitude,
                                         d.auto_augment_ops, d.interpolation)
        self.strong = TrainTransform(d.img_size, d.scale, d.ratio, d.hflip, d.color_jitter, d.interpolation, policy,
                                     d.channels, d.value_range)
        # erased pixels take the mean, i.e. 0 after normalisation, as the training batch's erasing does
        fill = [255.0 * m for m in d.mean]
        self.erase = v2.RandomErasing(p=1.0, value=fill if reads_bands(d.channels, d.value_range)
                                      else [int(round(v)) for v in fill])

    def __call__(self, path: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            weak = self.weak(path, mix_seed(seed, 1))
            strong = self.erase(self.strong(path, mix_seed(seed, 2)))
        return weak, strong


class UnlabeledDataset(Dataset):
    """(index, position) -> (weak view, strong view, image index read, index of the unreadable file it replaced or
    -1). An unreadable file is replaced by a seeded re-draw from the whole set."""

    def __init__(self, paths, views: TwoViews, seed: int):
        self.paths, self.views, self.seed = paths, views, seed

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, key):
        index, position = key
        seed = mix_seed(self.seed, position, _VIEW_STREAM)
        redraw = random.Random(seed)
        first_unreadable = -1
        for _ in range(MAX_REDRAWS):
            try:
                weak, strong = self.views(image_of(self.paths, index), seed)
                return weak, strong, index, first_unreadable
            except (ImageDecodeError, OSError):
                if first_unreadable < 0:
                    first_unreadable = index
                index = redraw.randrange(len(self.paths))
        raise ImageDecodeError(f"{MAX_REDRAWS} unlabelled files in a row could not be read, starting with "
                               f"{self.paths[first_unreadable]}")


def build_unlabeled_loader(d, paths, seed: int, batch: int, rank: int, world_size: int, start: int,
                           pin_memory: bool) -> Loader:
    """This process's unlabelled batches from its batch `start` on (an endless loader: never len() it)."""
    stream = UnlabeledStream(len(paths), seed, batch, rank, world_size, start)
    options = ({"prefetch_factor": d.prefetch_factor, "worker_init_fn": seed_worker, "persistent_workers": False}
               if d.num_workers else {})
    return Loader(UnlabeledDataset(paths, TwoViews(d), seed), batch_size=batch, sampler=stream,
                  num_workers=d.num_workers, pin_memory=pin_memory, drop_last=True,
                  generator=torch.Generator().manual_seed(seed), **options)
