"""WebDataset shards (`data.format: webdataset`): tar files of samples `{key}.jpg|jpeg|png|webp` with
`{key}.cls` (the label as an integer) or `{key}.txt` (the class name), read with the `webdataset` package.
Multi-label shards (`data.task: multilabel`) carry `{key}.tags` instead: the sample's class names, one per
line (UTF-8; empty for an image with no tag), whatever `data.label_delimiter` the CSV list used.

Training streams. Epoch e of rank r: the training shards in a seeded order (seed, e), every world-th one from
position r (disjoint across ranks); of those, loader worker v reads every W-th from position v (W workers,
W = 1 without workers), cycling through them as often as it needs, through a shuffle buffer seeded by
(seed, e, r, v). Batch k of the epoch belongs to worker k mod W, so its samples and their augmentation seeds
(seed, e, r, v, slot) are a pure function of (seed, epoch, rank, k) for a given world size and worker count:
a resumed run re-reads, without decoding, the samples of the batches it must skip and continues at the next
one. Each worker yields exactly its share of the fixed epoch length (`data.train_samples`, or the shards'
sample count), so steps per epoch, the LR schedule and `drop_last` stay defined. We order and split the
shards ourselves rather than with `split_by_node` / `split_by_worker` because the resumed worker must also
be told which batches are its own (see `ShardTrainStream.__iter__`).

A sample that cannot be decoded (or has no image or label) is skipped and counted; its slot takes the next
readable sample of the stream, decoded with the slot's seed, so the positions of all later samples stay put.

Validation streams: rank r reads every world-th validation shard from r, worker v every W-th of those, each
sample once, in order: every sample counts exactly once at any world size.

`python -m imgcls.data.shards --from ROOT_OR_CSV --to OUT --shard-size N` writes a class-folder tree (or a CSV list)
as shards with `webdataset.ShardWriter`, and the class list beside them.
"""
from __future__ import annotations

import argparse
import collections
import logging
import os
import random
import shlex
import tarfile
from pathlib import Path
from typing import Iterator, Optional

import torch
import webdataset as wds
from torch.utils.data import IterableDataset, get_worker_info

from imgcls.core.errors import BadDataError, ConfigError, DataTreeError, ImageDecodeError
from imgcls.data.labels import FORMATS, ClassLabels, TagLabels
from imgcls.data.loaders import mix_seed
from imgcls.data.transforms import blank_for

log = logging.getLogger(__name__)

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp", "tif", "tiff", "npy")  # tif, npy: data.channels bands
POSITION_BITS = 32  # a sample's id: shard number << 32 | position in the shard
MAX_REDRAWS = 20


def expand_shards(spec) -> list[str]:
    """Brace patterns (`train-{000000..000127}.tar`), '::'-joined patterns or a list of them, as webdataset
    expands them; `pipe:` and http(s) URLs pass through."""
    specs = [spec] if isinstance(spec, str) else list(spec or [])
    return [url for item in specs for url in wds.shardlists.expand_urls(item)]


def read_shard(url: str) -> Iterator[dict]:
    """The samples of one shard (dicts of `__key__` and extension -> bytes), by webdataset's tar reader."""
    return wds.tarfile_samples([{"url": url}])


def count_samples(urls: list[str]) -> list[int]:
    """Samples per shard (reads every shard once)."""
    return [sum(1 for _ in read_shard(url)) for url in urls]


def sample_image_and_label(sample: dict, position: dict, labels: ClassLabels):
    """The image bytes and label of a sample, as `labels` reads it; ValueError when it has no image or no
    usable label."""
    image = next((sample[k] for k in IMAGE_KEYS if k in sample), None)
    if image is None:
        raise ValueError(f"no image ({', '.join(IMAGE_KEYS)}) in sample {sample.get('__key__')}")
    return image, labels.read_shard_label(sample, position)


class ShardIndex:
    """What the run knows of a shard set without reading it: classes, shard URLs, the sample count, and names
    for sample ids (`paths[id]`, so unreadable samples are reported like files)."""

    def __init__(self, classes: list[str], urls: list[str], total: int, counts: Optional[list[int]] = None,
                 labels: Optional[ClassLabels] = None):
        self.classes = classes
        self.labels = labels or ClassLabels()  # how samples carry their labels (.cls / .txt, or .tags)
        self.urls = urls
        self.total = total
        self.counts = counts
        self.paths = _SampleNames(urls)

    def __len__(self) -> int:
        return self.total

    @property
    def files(self) -> list[str]:
        """The shard files on this machine the index reads (what no command may write over); `paths` names
        samples, one per id, and is not a list to walk."""
        return [path for path in map(local_path, self.urls) if path is not None]

    @property
    def image_paths(self) -> None:
        """None: the samples are members of tar shards, not image files."""
        return None


class _SampleNames:
    def __init__(self, urls: list[str]):
        self.urls = urls

    def __getitem__(self, sample_id: int) -> str:
        return f"{self.urls[sample_id >> POSITION_BITS]} (sample {sample_id & ((1 << POSITION_BITS) - 1)})"


def worker_slot() -> tuple[int, int]:
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


class ShardTrainStream(IterableDataset):
    """One rank's training stream; also the run's sampler (`set_epoch`, `num_batches`)."""

    def __init__(self, index: ShardIndex, transform, seed: int, batch_size: int, rank: int, world_size: int,
                 num_workers: int, shuffle_buffer: int, shuffle: bool = True):
        self.index = index
        self.transform = transform
        self.seed = seed
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.workers = max(1, num_workers)
        self.shuffle_buffer = shuffle_buffer if shuffle else 0
        self.shuffle = shuffle
        self.position = {name: i for i, name in enumerate(index.classes)}
        self.epoch = 0
        self.start_batch = 0
        if len(index.urls) < world_size * self.workers:
            raise DataTreeError(f"data.train_shards: {len(index.urls)} shard(s) for {world_size} process(es) x "
                                f"{self.workers} loader worker(s); each needs at least one: write smaller shards "
                                f"(python -m imgcls.data.shards --shard-size) or lower data.num_workers")

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch = epoch
        self.start_batch = start_batch

    def num_batches(self) -> int:
        return (self.index.total // self.world_size) // self.batch_size

    def worker_shards(self, virtual: int) -> list[int]:
        order = list(range(len(self.index.urls)))
        if self.shuffle:
            random.Random(mix_seed(self.seed, self.epoch, 0x5A4D)).shuffle(order)
        return order[self.rank::self.world_size][virtual::self.workers]

    def raw_samples(self, virtual: int, epoch_share: int) -> Iterator[tuple[int, dict]]:
        """(sample id, sample) of worker `virtual`'s shards, cycled, through its seeded shuffle buffer (at most
        the worker's `epoch_share` of samples: a larger one would only re-read its cycled shards)."""
        shards = self.worker_shards(virtual)

        def cycled():
            for cycle in range(1 << 62):
                order = list(shards)
                if self.shuffle:
                    random.Random(mix_seed(self.seed, self.epoch, self.rank, virtual, cycle)).shuffle(order)
                for shard in order:
                    for n, sample in enumerate(read_shard(self.index.urls[shard])):
                        yield (shard << POSITION_BITS) | n, sample

        size = min(self.shuffle_buffer, epoch_share)
        if size < 2:
            return cycled()
        rng = random.Random(mix_seed(self.seed, self.epoch, self.rank, virtual, 0xB0F))
        return wds.filters.shuffle(bufsize=size, initial=size, rng=rng)(cycled())

    def __iter__(self):
        actual, workers = worker_slot()
        if workers != self.workers:
            raise RuntimeError(f"ShardTrainStream built for {self.workers} workers runs in {workers}")
        # DataLoader takes batches from its workers in turn from worker 0, so after a resume at batch s, loader
        # worker i plays worker (s + i) mod W, the owner of batch s + i.
        virtual = (self.start_batch + actual) % self.workers
        nb = self.num_batches()
        own = range(virtual, nb, self.workers)
        skip = sum(1 for k in own if k < self.start_batch) * self.batch_size
        quota = len(own) * self.batch_size
        stream = self.raw_samples(virtual, quota)
        ahead: collections.deque = collections.deque()
        for slot in range(quota):
            item = ahead.popleft() if ahead else next(stream)
            if slot < skip:
                continue
            sample_seed = mix_seed(self.seed, self.epoch, self.rank, virtual, slot)
            yield self.decode_slot(item, stream, ahead, sample_seed)

    def decode_slot(self, item, stream, ahead: collections.deque, seed: int):
        """(uint8 image, label, id of the unreadable sample it replaced or -1); an unreadable sample is replaced
        by the next readable one of the stream (looked ahead, so it keeps its own slot too)."""
        first_unreadable, lookahead = -1, 0
        for _ in range(MAX_REDRAWS):
            sample_id, sample = item
            try:
                image_bytes, label = sample_image_and_label(sample, self.position, self.index.labels)
                with torch.random.fork_rng(devices=[]):
                    torch.default_generator.manual_seed(seed)
                    return self.transform(image_bytes, seed), label, first_unreadable
            except (ImageDecodeError, ValueError, OSError):
                if first_unreadable < 0:
                    first_unreadable = sample_id
                if lookahead >= len(ahead):
                    ahead.append(next(stream))
                item = ahead[lookahead]
                lookahead += 1
        raise ImageDecodeError(f"{MAX_REDRAWS} samples in a row could not be read, starting with "
                               f"{self.index.paths[first_unreadable]}")


class ShardEvalStream(IterableDataset):
    """One rank's share of the validation shards, each sample once: (uint8 image, label, valid, id)."""

    def __init__(self, index: ShardIndex, transform, img_size: int, rank: int = 0, world_size: int = 1,
                 limit: Optional[int] = None):
        self.index = index
        self.transform = transform
        self.img_size = img_size
        self.rank = rank
        self.world_size = world_size
        self.limit = limit
        self.position = {name: i for i, name in enumerate(index.classes)}
        counts = index.counts or [0] * len(index.urls)
        self.offsets = [sum(counts[:i]) for i in range(len(counts))]  # global position of each shard's start

    def __iter__(self):
        worker, workers = worker_slot()
        for shard in range(len(self.index.urls))[self.rank::self.world_size][worker::workers]:
            for n, sample in enumerate(read_shard(self.index.urls[shard])):
                if self.limit is not None and self.offsets[shard] + n >= self.limit:
                    break
                yield self.decode(sample, (shard << POSITION_BITS) | n)

    def decode(self, sample: dict, sample_id: int):
        try:
            image_bytes, label = sample_image_and_label(sample, self.position, self.index.labels)
            return self.transform(image_bytes), label, True, sample_id
        except (ImageDecodeError, ValueError, OSError):
            label = self.index.labels.placeholder(len(self.position))
            return blank_for(self.transform, self.img_size), label, False, sample_id


def local_path(url: str) -> Optional[str]:
    """The file a shard URL names on this machine (plain path or `file:`); None for pipes and remote URLs."""
    path = url[len("file:"):] if url.startswith("file:") else url
    return None if "://" in path or path.startswith("pipe:") else path


def shard_damage(url: str) -> Optional[str]:
    """Why a local tar shard is damaged (cut short, or not a tar file), or None. webdataset's reader stops at a
    cut without a word. A whole tar file ends in tar's two zero blocks, which a cut one lacks (its last bytes
    are a member's): that one read decides; only then are the headers walked (the data skipped) to say where
    it was cut."""
    path = local_path(url)
    if path is None or not os.path.isfile(path):
        return None  # a pipe or a URL cannot be checked ahead; a missing file fails when it is read
    size = os.path.getsize(path)
    if size % 512 == 0 and size >= 1024:
        with open(path, "rb") as f:
            f.seek(size - 1024)
            if f.read(1024).count(0) == 1024:
                return None
    end, last = 0, None
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                if member.offset_data + member.size > size:
                    return f"cut short: {member.name} needs {member.offset_data + member.size} bytes, the file has {size}"
                end, last = member.offset_data + -(-member.size // 512) * 512, member.name
    except (tarfile.TarError, OSError) as err:
        if last is not None:
            return f"cut short or damaged after {last} ({type(err).__name__}: {err})"
        return f"not a readable tar file ({type(err).__name__}: {err})"
    with open(path, "rb") as f:
        f.seek(end)
        marker = f.read(1024)
    if len(marker) < 1024 or marker.count(0) != 1024:
        return f"cut short after {last or 'its start'} at byte {size} (no end-of-archive blocks)"
    return None


def readable_prefix(url: str) -> int:
    """How many samples a damaged shard yields before its damage (its reader may stop or raise there)."""
    n = 0
    try:
        for _ in read_shard(url):
            n += 1
    except Exception:  # noqa: BLE001 - the damage itself, whatever tarfile or webdataset call it
        pass
    return n


def drop_damaged(urls: list[str], what: str, max_bad_fraction: Optional[float]) -> list[str]:
    """The shards without damage. A damaged shard is left out whole, named in the log, and its samples count as
    unreadable under the bad-file policy (above `max_bad_fraction` of the set, BadDataError: exit 1)."""
    damaged = {url: why for url in urls if (why := shard_damage(url))}
    if not damaged:
        return urls
    lost = {url: readable_prefix(url) + 1 for url in damaged}  # what it still holds, and the cut one
    listing = "; ".join(f"{url}: {why}" for url, why in damaged.items())
    log.warning("%s: %d damaged shard(s) left out, their %d sample(s) counted as unreadable: %s", what,
                len(damaged), sum(lost.values()), listing)
    kept = [url for url in urls if url not in damaged]
    if max_bad_fraction is not None:
        names = [f"{url} ({damaged[url]})" for url in damaged]
        total = sum(lost.values()) + sum(count_samples(kept))
        if total and sum(lost.values()) / total > max_bad_fraction:
            raise BadDataError(f"{what}: {sum(lost.values())} of {total} samples are in damaged shards, more than "
                               f"data.max_bad_fraction={max_bad_fraction}:\n  " + "\n  ".join(names))
    if not kept:
        raise DataTreeError(f"{what}: every shard is damaged: {listing}")
    return kept


def shard_index(spec, classes: list[str], total: Optional[int], what: str,
                max_bad_fraction: Optional[float] = None, labels: Optional[ClassLabels] = None) -> ShardIndex:
    """The index of a shard set, damaged shards left out (`drop_damaged`); without `total`, the shards are read
    once to count their samples."""
    urls = expand_shards(spec)
    if not urls:
        raise DataTreeError(f"{what}: no shards in {spec!r}")
    urls = drop_damaged(urls, what, max_bad_fraction)
    counts = None
    if total is None:
        try:
            counts = count_samples(urls)
        except Exception as err:  # a missing file, a broken tar, a failing pipe: webdataset's own message
            raise DataTreeError(f"{what}: cannot read the shards {spec!r}: {err}") from err
        total = sum(counts)
        log.info("%s: %d samples in %d shard(s), counted by reading them", what, total, len(urls))
    if total == 0:
        raise DataTreeError(f"{what}: the shards {spec!r} hold no samples")
    return ShardIndex(classes, urls, total, counts, labels)


# ---------------------------------------------------------------- the writer


def write_shards(paths: list[str], listed: list, classes: list[str], out: Path, shard_size: int,
                 seed: int = 0, labels: Optional[ClassLabels] = None) -> list[str]:
    """Write (path, label) pairs as shards `out/shard-000000.tar`, ... (`.<ext>` image bytes as they are on
    disk, the label as `labels` stores it: `.cls`, or for tags `.tags` with the names one per line), in a
    seeded order so every shard mixes the classes; and `out/classes.txt`."""
    labels = labels or ClassLabels()
    out.mkdir(parents=True, exist_ok=True)
    order = list(range(len(paths)))
    random.Random(seed).shuffle(order)
    with wds.ShardWriter(str(out / "shard-%06d.tar"), maxcount=shard_size, verbose=0) as writer:
        for n, i in enumerate(order):
            ext = Path(paths[i]).suffix.lower().lstrip(".")
            ext = "jpg" if ext == "jpeg" else ext
            member = labels.shard_member(listed[i], classes)
            writer.write({"__key__": f"{n:09d}", ext: Path(paths[i]).read_bytes(), **member})
    (out / "classes.txt").write_text("".join(f"{name}\n" for name in classes))
    return sorted(str(p) for p in out.glob("shard-*.tar"))


def shards_pattern(written: list[str]) -> str:
    """One brace pattern for shard-000000.tar ... shard-00000N.tar (the writer numbers them from 0)."""
    if len(written) == 1:
        return written[0]
    folder = Path(written[0]).parent
    return str(folder / f"shard-{{000000..{len(written) - 1:06d}}}.tar")


def next_overrides(written: list[str], source: Path, out: Path) -> str:
    """The train.py overrides that read these shards, quoted for the shell (it would expand a brace pattern):
    data.val_shards when the source is named as a validation split, else data.format, data.classes and
    data.train_shards."""
    name = source.stem.lower()
    pattern = shlex.quote(shards_pattern([str(Path(p).resolve()) for p in written]))
    if name.startswith(("val", "valid")) or name in ("dev", "test"):
        return f"data.val_shards={pattern}"
    classes = shlex.quote(str((out / "classes.txt").resolve()))
    return f"data.format=webdataset data.classes={classes} data.train_shards={pattern}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m imgcls.data.shards", description="Write a class-folder tree or a "
                                     "CSV list (path,label) as WebDataset shards with webdataset.ShardWriter.")
    parser.add_argument("--from", dest="source", required=True, help="a class-folder tree, or a CSV list")
    parser.add_argument("--to", required=True, help="the output folder (shard-000000.tar, ..., classes.txt)")
    parser.add_argument("--shard-size", type=int, default=1000, help="samples per shard")
    parser.add_argument("--root", help="with a CSV: the folder its relative paths resolve against "
                                       "(default: the CSV's folder)")
    parser.add_argument("--seed", type=int, default=0, help="the seed of the order samples are written in")
    parser.add_argument("--overwrite", action="store_true", help="replace the shards and classes.txt already in "
                        "--to (without it, a --to holding anything is refused)")
    parser.add_argument("--multilabel", dest="label_format", action="store_const", const=TagLabels.name,
                        default=ClassLabels.name, help="a CSV list whose label column holds tags "
                                                                  "(data.task=multilabel): written as .tags members")
    parser.add_argument("--label-delimiter", default=" ", help="with --multilabel: what separates the tags "
                                                               "(data.label_delimiter; default a space)")
    args = parser.parse_args(argv)
    from imgcls.core.errors import ConfigError
    from imgcls.data.images import IMAGE_EXTENSIONS

    if args.shard_size < 1:
        raise ConfigError("--shard-size must be >= 1")
    out = Path(args.to)
    old = writable_output(out, args.overwrite)
    source = Path(args.source)
    labels = FORMATS[args.label_format](args.label_delimiter)
    index = source_index(source, args.root, labels)
    unsupported = sorted({Path(p).suffix for p in index.paths if Path(p).suffix.lower() not in
                          tuple("." + k for k in IMAGE_KEYS)})
    if unsupported:
        raise ConfigError(f"--from {source}: shards hold {', '.join(IMAGE_KEYS)} images; found {unsupported} "
                          f"(one of {', '.join(IMAGE_EXTENSIONS)})")
    for path in old:
        path.unlink()
    written = write_shards(index.paths, index.labels, index.classes, out, args.shard_size, args.seed, labels)
    print(f"wrote {len(index)} samples of {len(index.classes)} classes in {len(written)} shard(s) to {out}: "
          f"{Path(written[0]).name}..{Path(written[-1]).name} and classes.txt"
          + (f" (removed the {len(old)} file(s) there before)" if old else ""))
    print(f"train.py overrides: {next_overrides(written, source, out)}")
    return 0


def writable_output(out: Path, overwrite: bool) -> list[Path]:
    """The files to remove before writing into `out`: none for a new or empty folder; with `overwrite`, the
    shards and classes.txt a previous write left (so no old shard joins the new set under a brace pattern).
    ConfigError for a `--to` that is a file, or a folder holding anything without `overwrite`, or holding
    more than shards and classes.txt."""
    from imgcls.core.errors import ConfigError

    if out.exists() and not out.is_dir():
        raise ConfigError(f"--to {out} is a file, not a folder: name a new or empty folder for the shards")
    present = sorted(out.iterdir()) if out.is_dir() else []
    if not present:
        return []
    ours = [p for p in present if p.is_file() and (p.name == "classes.txt" or
                                                   (p.name.startswith("shard-") and p.name.endswith(".tar")))]
    if not overwrite:
        raise ConfigError(f"--to {out} is not empty ({len(present)} entries, {len(ours)} of them shards or "
                          f"classes.txt): old shards would mix with the new set; name a new folder, or pass "
                          f"--overwrite to replace them")
    others = [p.name for p in present if p not in ours]
    if others:
        raise ConfigError(f"--to {out} holds other files than shards and classes.txt ({', '.join(others[:5])}); "
                          f"--overwrite replaces only shards: name a new or empty folder")
    return ours


def source_index(source: Path, root: Optional[str], labels: Optional[ClassLabels] = None):
    """The samples to write: a class-folder tree, or a CSV list (rows of missing files left out and counted;
    its label column read by `labels`: one class, or tags). DataTreeError when none remains, or a class is
    left without a sample."""
    labels = labels or ClassLabels()
    if source.suffix.lower() != ".csv":
        if not labels.folder_tree:
            raise ConfigError("--multilabel: tags come from a CSV list (--from LIST.csv); a class-folder tree "
                              "holds one label per image")
        from imgcls.data.listing import scan_split

        return scan_split(source)
    from imgcls.data.listing import read_csv_rows

    base = Path(root) if root else source.parent
    rows = read_csv_rows(source, "path", "label", allow_empty_label=labels.allows_empty_label)
    classes = labels.classes_of(rows, f"CSV list {source}")
    index, missing = labels.csv_index(source, base, rows, classes, "labels")
    if missing:
        log.warning("%d of %d row(s) of %s name files that do not exist, left out: %s", len(missing),
                    len(rows), source, ", ".join(missing[:10]) + (", ..." if len(missing) > 10 else ""))
    if not len(index):
        raise DataTreeError(f"--from {source}: none of its {len(rows)} row(s) names an existing file "
                            f"(relative paths resolve against {Path(root) if root else source.parent}; "
                            f"--root sets that folder); nothing written")
    labels.check_every_class_present(source, index, missing)
    return index


if __name__ == "__main__":
    import sys

    from imgcls.core.errors import USAGE_ERRORS

    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    try:
        sys.exit(main())
    except USAGE_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
