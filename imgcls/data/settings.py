"""The `data` section: where the samples come from (data.format, and the keys of each source: data.format=folder,
class-folder trees under data.root, data/sources/source_folder.py; data.format=csv, CSV lists of image paths and
labels, data/sources/source_csv.py; data.format=webdataset, tar shards read as a stream,
data/sources/source_webdataset.py), how images are decoded, augmented and loaded. Also the checks of the data
paths that run before any work (the data root, the files the keys name)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

from imgcls.core.errors import ConfigError
from imgcls.core.files import check_outputs_apart, not_a_regular_file
from imgcls.core.settings import setting


@dataclass
class CsvSourceKeys:
    FORMAT = "csv"
    FORMAT_HELP = "data.train_csv / data.val_csv lists"

    # Paths may move on --resume; the checkpoint's record of the lists' contents decides whether they changed.
    train_csv: Optional[str] = setting(None, "csv: the training list, a header then one row per image (paths "
                                       "relative to data.root, or to the CSV's folder)", resume_free=True)
    val_csv: Optional[str] = setting(None, "csv: the validation list (labels must be training classes)",
                                     resume_free=True)
    csv_path_column: str = setting("path", "csv: the column holding image paths")
    csv_label_column: str = setting("label", "csv: the column holding class names")

    def check_source(self) -> None:
        if not self.train_csv:
            raise ConfigError("'data.format' = csv needs 'data.train_csv' (a CSV file with a header and the columns "
                              f"'{self.csv_path_column}' and '{self.csv_label_column}')")
        if self.val_csv and self.val_fraction is not None:
            raise ConfigError("'data.val_csv' and 'data.val_fraction' are both set: validate on the CSV list or "
                              "hold out a fraction of data.train_csv, not both")
        if not self.val_csv and self.val_fraction is None:
            raise ConfigError("'data.format' = csv needs 'data.val_csv', or 'data.val_fraction' to hold out a "
                              "fraction of data.train_csv")

    def check_unselected(self) -> None:
        if self.train_csv or self.val_csv:
            raise ConfigError(f"'data.train_csv' / 'data.val_csv' are set but 'data.format' = {self.format}; "
                              f"set data.format=csv to train from CSV lists")

@dataclass
class FolderSourceKeys:
    FORMAT = "folder"
    FORMAT_HELP = "class-folder trees under data.root"

    train_split: str = setting("train", "training split folder under data.root")
    val_split: str = setting("val", "validation split folder under data.root")
    builtin: Optional[Literal["digits"]] = setting(
        None, "null, or 'digits': write scikit-learn's digits as a class-folder tree into data.root first")

    def check_source(self) -> None:
        self._check_builtin()

    def check_unselected(self) -> None:
        self._check_builtin()

    def _check_builtin(self) -> None:
        if self.builtin and (self.val_fraction is not None or self.format != "folder"):
            raise ConfigError(f"'data.builtin' = {self.builtin} writes its own train/ and val/ folders: drop "
                              f"data.val_fraction and keep data.format=folder")

@dataclass
class WebDatasetSourceKeys:
    FORMAT = "webdataset"
    FORMAT_HELP = "tar shards"

    # Shard locations may move on --resume (the checkpoint records the shard names and the sample count).
    train_shards: Union[str, list[str], None] = setting(
        None, "webdataset: training shards, a brace pattern (train-{000000..000127}.tar), a list, pipe: or "
              "http(s):// URLs", resume_free=True)
    val_shards: Union[str, list[str], None] = setting(
        None, "webdataset: validation shards (each sample counted once at any world size)", resume_free=True)
    shuffle_buffer: int = setting(1000, "webdataset: in-memory sample shuffle buffer per loader worker (shards "
                                        "are shuffled per epoch too; 0: off)", lo=0)
    train_samples: Optional[int] = setting(None, "webdataset: the epoch length in samples (null: count the "
                                                 "training shards' samples at start)", lo=1)

    def check_source(self) -> None:
        missing = [f"data.{k}" for k in ("train_shards", "val_shards", "classes") if not getattr(self, k)]
        if missing:
            raise ConfigError(f"'data.format' = webdataset needs {', '.join(missing)} (shard patterns such as "
                              f"train-{{000000..000127}}.tar, and the class list, one name per line)")
        if self.val_fraction is not None:
            raise ConfigError("'data.val_fraction' does not apply to shards: write the validation samples as their "
                              "own shards (data.val_shards)")
        if self.sampler == "weighted":
            raise ConfigError("'data.sampler' = weighted needs random access to every sample; a shard stream reads "
                              "in sequence. Use data.sampler=random with data.format=webdataset, or write "
                              "class-balanced shards")
        if self.repeated_augment > 1:
            raise ConfigError(f"'data.repeated_augment' = {self.repeated_augment} needs random access to every "
                              f"sample; a shard stream reads each sample once per epoch. Use "
                              f"data.repeated_augment=1 with data.format=webdataset")

    def check_unselected(self) -> None:
        if self.train_shards or self.val_shards:
            raise ConfigError(f"'data.train_shards' / 'data.val_shards' are set but 'data.format' = {self.format}; "
                              f"set data.format=webdataset to train from shards")

# the data sources' keys, in the order data.format lists them (data/sources/__init__.py registers the sources)
SOURCE_KEYS = (FolderSourceKeys, CsvSourceKeys, WebDatasetSourceKeys)


SOURCE_FORMATS = tuple(keys.FORMAT for keys in SOURCE_KEYS)


MAX_IMG_SIZE = 4096


# torchvision's RandAugment magnitudes are bins 0..30 (num_magnitude_bins=31, as timm's scale)
RANDAUGMENT_MAX_MAGNITUDE = 30


MAX_CHANNELS = 1024  # data.images.MAX_BANDS: a file with more bands is refused before decoding


MIN_STD = 1e-6  # data.std's floor (auto measures bands whose spread is below one 8-bit step: 0.0039)


@dataclass
class DataSourceKeys:
    """The keys every source reads: which source, its root, the held-out split and the class list."""

    root: Optional[str] = setting(None, "folder holding <train_split>/ and <val_split>/, each with one sub-folder "
                                        "per class", resume_free=True)
    format: Literal[SOURCE_FORMATS] = setting(
        "folder", " | ".join(f"{keys.FORMAT} ({keys.FORMAT_HELP})" for keys in SOURCE_KEYS))
    val_fraction: Optional[float] = setting(
        None, "null: the splits are given; 0 < f < 1 (both ends excluded): hold out this stratified fraction of "
              "data.root's one class-folder tree (or data.train_csv)", lo=0.0, hi=1.0, lo_open=True, hi_open=True)
    split_seed: int = setting(0, "seed of the data.val_fraction split (the same split on every machine and run)")
    classes: Optional[str] = setting(None, "a class list file, one name per line, in label order (null: the "
                                           "sorted folder names / CSV labels; needed for shards)", resume_free=True)
    extra_train_csv: Optional[str] = setting(
        None, "more labelled training rows, a path,label CSV (infer.py --pseudo-labels writes one; paths relative to "
              "the CSV's folder), added to the training split of a folder or csv source; never validated on",
        resume_free=True)
    unlabeled: Optional[str] = setting(
        None, "semi-supervised: unlabelled images, a folder (any tree, labels ignored), a CSV of paths (column "
              "data.csv_path_column) or local .tar shards (a pattern as data.train_shards); read like the training "
              "images, never validated on (semi.method)",
        resume_free=True)


@dataclass
class DataConfig(WebDatasetSourceKeys, CsvSourceKeys, FolderSourceKeys, DataSourceKeys):
    img_size: int = setting(224, "the fixed training and evaluation input size (square, pixels)", lo=8,
                            hi=MAX_IMG_SIZE)
    crop_pct: float = setting(0.875, "eval: resize the shorter side to img_size / crop_pct, then centre-crop "
                                     "img_size", lo=0.1, hi=1.0)
    interpolation: Literal["bilinear", "bicubic", "nearest"] = setting(
        "bilinear", "bilinear | bicubic | nearest, for training crops and eval resizing")
    scale: list[float] = setting([0.08, 1.0], "RandomResizedCrop area range, as fractions of the image")
    ratio: list[float] = setting([3 / 4, 4 / 3], "RandomResizedCrop aspect-ratio range")
    hflip: float = setting(0.5, "horizontal-flip probability (0 for digits, text, ...)", lo=0.0, hi=1.0)
    color_jitter: float = setting(0.0, "brightness / contrast / saturation jitter strength (0: off)", lo=0.0,
                                  hi=1.0)
    channels: int = setting(3, "bands per image: 3 reads 8-bit RGB as ever; 1 keeps grayscale one band; any N reads "
                               "multi-band TIFFs and .npy arrays; other than 3, samples keep their depth "
                               "(docs/channels.md)", lo=1, hi=MAX_CHANNELS)
    value_range: Optional[list[float]] = setting(None, "[low, high] of the stored samples, mapped to [0, 1] (null: the "
                                                       "sample type's range; floats as [0, 1]); set, files are read as "
                                                       "float bands also for 3 channels")
    mean: Union[Literal["auto"], list[float]] = setting(
        [0.485, 0.456, 0.406], "normalisation mean, one per channel (R, G, B), in [0, 1]; auto: measured per channel "
                               "on the training split (the default for other than 3 channels)")
    std: Union[Literal["auto"], list[float]] = setting(
        [0.229, 0.224, 0.225], "normalisation std, one per channel (R, G, B); auto: measured on the training split; "
                               "the default for other than 3 channels")
    sampler: Literal["random", "weighted", "sequential"] = setting(
        "random", "random (shuffled) | weighted (class-balanced WeightedRandomSampler) | sequential (fixed order; "
                  "warns)")
    num_workers: int = setting(2, "loader processes (0: load in the main process)", lo=0, hi=256, resume_free=True)
    pin_memory: Optional[bool] = setting(None, "pinned host memory for the copy to the GPU (null: on when training "
                                               "on CUDA)", resume_free=True)
    persistent_workers: bool = setting(True, "keep loader processes alive between epochs", resume_free=True)
    prefetch_factor: int = setting(4, "batches each worker prepares ahead", lo=1, hi=1024, resume_free=True)
    max_bad_fraction: float = setting(0.01, "stop (exit 1) when more than this fraction of a split cannot be read",
                                      lo=0.0, hi=1.0, resume_free=True)
    limit_train_batches: Optional[int] = setting(None, "dry run: at most this many training batches per epoch "
                                                       "(null: all)", lo=1)
    limit_val_batches: Optional[int] = setting(None, "dry run: validate on the first N x train.batch_size images "
                                                     "only, at any world size (null: all)", lo=1, resume_free=True)
    auto_augment: Optional[Literal["randaugment", "trivialaugment", "autoaugment", "augmix"]] = setting(
        None, "null | randaugment | trivialaugment | autoaugment (ImageNet policy) | augmix: torchvision v2 policy "
              "on the uint8 crop")
    auto_augment_magnitude: int = setting(9, "randaugment magnitude (0..30); augmix severity (clipped to 1..10); "
                                             "unused by the others", lo=0, hi=RANDAUGMENT_MAX_MAGNITUDE)
    auto_augment_ops: int = setting(2, "randaugment: ops per image", lo=1)
    repeated_augment: int = setting(1, "each image k times per epoch, each with its own augmentation; the epoch "
                                       "keeps the split's length (random sampler only)", lo=1)
    eval_img_size: Optional[int] = setting(None, "evaluate at this size (FixRes: resize eval_img_size / crop_pct, "
                                                 "centre crop eval_img_size); null: img_size", lo=8)
    random_erasing: float = setting(0.0, "random erasing per image on the device (torchvision RandomErasing: area "
                                         "2-33%, aspect 0.3-3.3), erased pixels 0 after normalisation; the "
                                         "probability (0: off)", lo=0.0, hi=1.0)
    task: str = setting("multiclass", "multiclass (one label per image) | multilabel (zero or more tags per image: "
                                      "csv or webdataset .tags)", allowed="a task registered in tasks/")
    label_delimiter: str = setting(" ", "multilabel: what separates the tags in a CSV label field (a space, as "
                                        "fastai / Kaggle Planet)")

    def check(self, cfg) -> None:
        for key, pair in (("data.scale", self.scale), ("data.ratio", self.ratio)):
            if len(pair) != 2 or not (0 < pair[0] <= pair[1]):
                raise ConfigError(f"'{key}' = {pair} must be two numbers [low, high] with 0 < low <= high")
        if self.scale[1] > 1.0:
            raise ConfigError(f"'data.scale' = {self.scale}: the high end must be <= 1.0 (a fraction of the image "
                              f"area)")
        if not (0.01 <= self.ratio[0] and self.ratio[1] <= 100):
            raise ConfigError(f"'data.ratio' = {self.ratio}: aspect ratios must lie within [0.01, 100]")
        self.check_channels(cfg)
        if self.mean != "auto" and not all(0 <= m <= 1 for m in self.mean):
            raise ConfigError(f"'data.mean' = {self.mean}: every value must be within [0, 1] (pixels are scaled "
                              f"to [0, 1])")
        if self.std != "auto" and not all(MIN_STD <= s <= 1 for s in self.std):
            raise ConfigError(f"'data.std' = {self.std}: every value must be within [{MIN_STD}, 1] (pixels are "
                              f"scaled to [0, 1])")
        if self.repeated_augment > 1 and self.sampler != "random":
            raise ConfigError(f"'data.repeated_augment' = {self.repeated_augment} needs 'data.sampler' = random (it "
                              f"is {self.sampler}): repeats are drawn from a shuffled epoch; set "
                              f"data.repeated_augment=1 for the {self.sampler} sampler")
        if self.extra_train_csv and self.format == "webdataset":
            raise ConfigError("'data.extra_train_csv' adds files to a folder or csv source's training split; with "
                              "data.format=webdataset write the extra samples as shards")
        for keys in SOURCE_KEYS:
            if keys.FORMAT == self.format:
                keys.check_source(self)
            else:
                keys.check_unselected(self)


    def check_channels(self, cfg) -> None:
        """One mean and std per channel (`auto` for a channel count other than 3 whose values are unset: the
        ImageNet values are RGB's); a value range low < high; no colour policy on bands that are not 8-bit RGB."""
        explicit = getattr(cfg, "explicit_keys", set())
        if self.channels != 3:
            if "data.mean" not in explicit and self.mean != "auto" and len(self.mean) == 3:
                self.mean = "auto"
            if "data.std" not in explicit and self.std != "auto" and len(self.std) == 3:
                self.std = "auto"
        for key, values in (("data.mean", self.mean), ("data.std", self.std)):
            if values != "auto" and len(values) != self.channels:
                raise ConfigError(f"'{key}' must hold {self.channels} numbers, one per channel (data.channels="
                                  f"{self.channels}), got {values}")
        if self.value_range is not None and (len(self.value_range) != 2
                                             or not self.value_range[0] < self.value_range[1]):
            raise ConfigError(f"'data.value_range' = {self.value_range} must be two numbers [low, high] with low < "
                              f"high (the stored sample values that map to 0 and 1)")
        if self.channels != 3 or self.value_range is not None:
            refused = [(key, value) for key, value in (("data.auto_augment", self.auto_augment),
                                                       ("data.color_jitter", self.color_jitter)) if value]
            if refused:
                key, value = refused[0]
                raise ConfigError(f"'{key}' = {value}: colour augmentation assumes 8-bit RGB, and data.channels="
                                  f"{self.channels}" + (f", data.value_range={self.value_range}"
                                                        if self.value_range is not None else "")
                                  + f" reads float bands; set {key}=" + ("null" if key == "data.auto_augment"
                                                                         else "0") + " (docs/channels.md)")


def eval_size(data_cfg: DataConfig) -> int:
    """The evaluation input size: `data.eval_img_size`, or `data.img_size` when that is null."""
    return data_cfg.eval_img_size or data_cfg.img_size


def check_data_root(cfg) -> Optional[Path]:
    """The data root must exist (or be creatable from a built-in data set); the files the data keys name
    (CSV lists, the class list) must be regular files, whatever the format."""
    check_named_files(cfg.data)
    if cfg.data.format in ("csv", "webdataset"):
        return _check_list_root(cfg.data)
    if not cfg.data.root:
        raise ConfigError("'data.root' is not set: pass data.root=/path/to/images (a folder with train/ and val/)")
    root = Path(cfg.data.root).expanduser()
    if cfg.data.builtin:
        return root
    if not root.is_dir():
        raise ConfigError(f"'data.root' = {cfg.data.root}: {not_a_folder(root)}")
    if cfg.data.val_fraction is not None:
        return root  # one class-folder tree, split by data.val_fraction
    for split in (cfg.data.train_split, cfg.data.val_split):
        if not (root / split).is_dir():
            raise ConfigError(f"'data.root' = {cfg.data.root}: missing split folder '{split}/' (data.train_split / "
                              f"data.val_split)")
    return root


def scanned_folders(cfg) -> list[Path]:
    """The folders whose files data.format=folder lists as images: the split folders under data.root (the
    root itself with data.val_fraction); none for CSV lists and shards."""
    d = cfg.data
    if d.format != "folder" or not d.root:
        return []
    root = Path(d.root).expanduser()
    return [root] if d.val_fraction is not None else [root / d.train_split, root / d.val_split]


def check_outside_data(cfg, flag: str, path) -> None:
    """ConfigError (exit 2) before any work when an output folder lies inside a folder the data is scanned
    from (scanned_folders): the plots and files written there would be listed as images of a class the next
    time (embed.py refuses the same for its folder)."""
    if path:
        check_outputs_apart({flag: str(path)}, {}, {"data folder": [str(p) for p in scanned_folders(cfg)]})


def not_a_folder(path: Path) -> str:
    """What a path that should be a folder is: "no such folder", or "not a folder (a regular file)", ..."""
    problem = not_a_regular_file(path)
    if problem in ("no such file", "a broken link"):
        return "no such folder" if problem == "no such file" else "no such folder (a broken link)"
    return f"not a folder ({problem or 'a regular file'})"


def check_named_files(d: DataConfig) -> None:
    """Every file a data key names is a regular file (a FIFO would block the read for ever), or ConfigError
    saying what it is instead; shards are checked when they are read."""
    for key in ("train_csv", "val_csv", "classes", "extra_train_csv"):
        value = getattr(d, key)
        problem = not_a_regular_file(value) if value else None
        if problem:
            raise ConfigError(f"'data.{key}' = {value}: {problem}; it must name a regular file")


def _check_list_root(d: DataConfig) -> Optional[Path]:
    if d.root and not Path(d.root).expanduser().is_dir():
        meant = ("the CSV lists' relative paths resolve against it" if d.format == "csv" else
                 "relative shard patterns are read as given; data.root is not used by data.format=webdataset, "
                 "set it to null")
        raise ConfigError(f"'data.root' = {d.root}: {not_a_folder(Path(d.root).expanduser())} ({meant})")
    return Path(d.root).expanduser() if d.root else None
