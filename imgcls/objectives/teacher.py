"""The teacher: loaded once from `distill.teacher` by the loaders that eval.py and `model.pretrained` use,
frozen (eval mode, no gradients), with its classes, its preprocessing and its identity (what last.pt
records so that --resume can refuse another teacher), and its predictions kept per validation image
(`TeacherPredictions`).

Sources: one of our checkpoints (a .pt file: best.pt), a timm folder (`local-dir:PATH` or a folder path, as
export.py --format timm or timm's save_for_hf write it), or a timm / `hf-hub:` model name with its pretrained
weights (the hub cache, as `model.pretrained`)."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch

import imgcls.compute.distributed as dist_utils
from imgcls.core.errors import CheckpointError, ConfigError, ModelError
from imgcls.data.settings import eval_size
from imgcls.model_files.loading import load_model_file
from imgcls.models.factory import (LOCAL_DIR_PREFIX, check_model_name, load_pretrained, pretrained_preprocessing,
                                   weight_file)
from imgcls.tasks import get_task, task_of

log = logging.getLogger(__name__)


@dataclass
class Teacher:
    model: torch.nn.Module      # frozen, eval mode, on the run's device
    classes: Optional[list[str]]  # in output order; None when the source names none
    mean: list[float]
    std: list[float]
    size: int                   # its input size (its recorded eval preprocessing)
    identity: dict              # {"source", "kind", "sha256"[, "config_sha256"]}: what --resume compares
    task: str = "multiclass"    # the data.task it was trained for (a timm model name: ImageNet's, multiclass)
    activation_bytes: int = 0   # its largest activation for one image at `size` (what a batch of it costs)
    channels: int = 3           # the input channels it reads (its data.channels; a timm model's input_size)

    @property
    def num_outputs(self) -> int:
        return int(self.identity["num_outputs"])


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def weights_sha256(model: torch.nn.Module) -> str:
    """A digest of the model's tensors (names, shapes, dtypes and values), for a teacher that is not one file."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def teacher_kind(source: str) -> str:
    if source.startswith(LOCAL_DIR_PREFIX) or Path(source).expanduser().is_dir():
        return "timm folder"
    if Path(source).expanduser().is_file():
        return "checkpoint"
    return "timm model"


PATH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".onnx", ".pt2", ".json", ".xml")


def missing_source(source: str) -> Optional[str]:
    """Why `source` names a file or folder that is not there (None for a model name or an existing path): a
    path that does not exist is not looked up as a timm model name."""
    if source.startswith("hf-hub:"):
        return None
    path = Path(source.removeprefix(LOCAL_DIR_PREFIX)).expanduser()
    looks_like_path = (source.startswith(LOCAL_DIR_PREFIX) or "/" in source or "\\" in source
                       or source.startswith((".", "~")) or path.suffix.lower() in PATH_SUFFIXES)
    if looks_like_path and not path.exists():
        return (f"'distill.teacher' = {source}: no such file or folder ({path.absolute()}); name a checkpoint "
                f"(best.pt), a timm folder (local-dir:PATH) or a timm / hf-hub: model name")
    return None


@contextlib.contextmanager
def named_as_teacher(source: str):
    """Errors raised while loading the teacher name `distill.teacher`: the loaders name the keys of the file
    they read ('model.name', 'data.mean'), which are the teacher's, not the student's config."""
    try:
        yield
    except (ConfigError, CheckpointError, ModelError) as err:
        message = str(err)
        if "'distill.teacher'" in message:
            raise
        message = message.replace(f"'model.name' = {source}: ", "")
        raise type(err)(f"'distill.teacher' = {source}: the teacher does not load: {message} (in the teacher's "
                        f"own record)") from err


def forward_profile(model: torch.nn.Module, size: int, device: torch.device, channels: int = 3) -> tuple[int, int]:
    """(its output count, its largest activation's bytes) for one image of `channels` bands at `size` px."""
    largest = [0]

    def keep(module, args, output):
        if isinstance(output, torch.Tensor):
            largest[0] = max(largest[0], output.numel() * output.element_size())

    handles = [m.register_forward_hook(keep) for m in model.modules() if not any(True for _ in m.children())]
    try:
        with torch.no_grad():
            outputs = model(torch.zeros(1, channels, size, size, device=device))
    finally:
        for handle in handles:
            handle.remove()
    return int(outputs.shape[1]), largest[0]


def output_count(model: torch.nn.Module, size: int, device: torch.device) -> int:
    return forward_profile(model, size, device)[0]


# The teacher checked before any work, kept for the set-up's load of the same source (one load per run)
CHECKED: dict[str, Teacher] = {}


def load_teacher(source: str, device: torch.device) -> Teacher:
    """The frozen teacher of `distill.teacher` on `device`. A source that does not load is a ConfigError /
    CheckpointError / ModelError (exit 2) naming `distill.teacher`."""
    checked = CHECKED.pop(source, None)
    if checked is not None:
        checked.model.to(device)
        return checked
    problem = missing_source(source)
    if problem:
        raise ConfigError(problem)
    with named_as_teacher(source):
        return open_teacher(source, device)


def open_teacher(source: str, device: torch.device) -> Teacher:
    kind = teacher_kind(source)
    if kind == "timm model":
        check_model_name(source)
        model = load_pretrained(SimpleNamespace(name=source))
        preprocessing = pretrained_preprocessing(source, model)
        input_size = (getattr(model, "pretrained_cfg", None) or {}).get("input_size", (3, 224, 224))
        size, channels = int(input_size[-1]), int(input_size[0])
        labels = list((getattr(model, "pretrained_cfg", None) or {}).get("label_names") or []) or None
        mean, std, classes, task = preprocessing["data.mean"], preprocessing["data.std"], labels, "multiclass"
        model = model.to(device)
        digests = {"sha256": weights_sha256(model)}
    else:
        path = Path(source.removeprefix(LOCAL_DIR_PREFIX)).expanduser()
        if kind == "checkpoint" and path.suffix.lower() in (".onnx", ".pt2"):
            raise ConfigError(f"'distill.teacher' = {source}: an exported {path.suffix} model cannot teach (the "
                              f"teacher runs in torch on the training device); use its best.pt or a timm folder")
        opened = load_model_file(path)
        model = opened.build_model(device, channels_last=False)
        mean, std, size = list(opened.cfg.data.mean), list(opened.cfg.data.std), eval_size(opened.cfg.data)
        channels = int(opened.cfg.data.channels)
        classes, task = list(opened.classes), opened.task.name
        digests = folder_digests(path) if kind == "timm folder" else {"sha256": file_sha256(path)}
    freeze(model)
    try:
        outputs, activation = forward_profile(model, size, device, channels)
    except RuntimeError as err:
        raise ConfigError(f"'distill.teacher' = {source}: the teacher does not run on a {channels}-channel {size} px "
                          f"image ({str(err).splitlines()[0]})") from err
    identity = {"source": source, "kind": kind, **digests, "num_outputs": outputs}
    return Teacher(model, classes, [float(m) for m in mean], [float(s) for s in std], int(size), identity, task,
                   activation, channels)


def folder_digests(folder: Path) -> dict:
    """A timm folder is its weights and its config.json (preprocessing, input size, labels): both are hashed,
    so a changed config.json is another teacher on --resume."""
    config = folder / "config.json"
    return {"sha256": file_sha256(weight_file(folder)),
            **({"config_sha256": file_sha256(config)} if config.is_file() else {})}


def teacher_change(saved: dict, ours: dict) -> Optional[str]:
    """How the teacher recorded in last.pt (`saved`) differs from this run's (`ours`), or None when it is the
    same: the weights' digest, and a timm folder's config.json where both record one."""
    if saved.get("sha256") != ours["sha256"]:
        return (f"{saved.get('source')} (sha256 {str(saved.get('sha256'))[:12]}) -> {ours['source']} "
                f"(sha256 {ours['sha256'][:12]})")
    if "config_sha256" in saved and saved.get("config_sha256") != ours.get("config_sha256"):
        return (f"{ours['source']}: the same weights, but its config.json (preprocessing, input size, labels) "
                f"changed (sha256 {str(saved['config_sha256'])[:12]} -> {str(ours.get('config_sha256'))[:12]})")
    return None


def check_teacher(cfg, classes: Optional[list[str]] = None) -> Teacher:
    """Before any work: load `distill.teacher` (on the CPU) and refuse one that cannot teach this student
    (ConfigError, exit 2, naming distill.teacher): not loadable, another task, other classes (when `classes`
    are known); warn when its input size makes every step costly. Kept for the run's next load of it."""
    source = cfg.distill.teacher
    CHECKED.pop(source, None)  # loaded afresh: a copy kept by a set-up that stopped early may be stale
    teacher = load_teacher(source, torch.device("cpu"))
    problem = teacher_mismatch(teacher, cfg, classes)
    if problem:
        raise ConfigError(f"'distill.teacher' = {source}: this teacher cannot teach the student: {problem}")
    warn_costly_size(source, teacher.size, teacher.activation_bytes, cfg.data.img_size, cfg.train.batch_size)
    CHECKED.clear()
    CHECKED[source] = teacher
    return teacher


def teacher_mismatch(teacher: Teacher, cfg, classes: Optional[list[str]]) -> Optional[str]:
    """Why the teacher cannot teach the student of `cfg` (None when it can): other input channels, another task,
    or (with `classes` known) other classes."""
    channels = getattr(cfg.data, "channels", 3)  # a data section without the key reads RGB
    if teacher.channels != channels:
        return (f"it reads {teacher.channels}-channel images and the student's data.channels={channels}: "
                f"the teacher sees the student's batches, so both read the same bands")
    theirs, ours = get_task(teacher.task), task_of(cfg)
    if theirs is not ours:
        return (f"it was trained for data.task={theirs.name} and the student trains for data.task={ours.name}: "
                f"a {theirs.title} model's outputs go through a {theirs.activation}, the student's through a "
                f"{ours.activation}; use a {ours.title} teacher")
    return class_mismatch(teacher, classes) if classes is not None else None


# A teacher whose input holds more than this many times the student's pixels is said aloud: its forward
# runs in every training step at its own size (2048 px behind a 32 px student: 3 GB at batch 2)
COSTLY_PIXEL_RATIO = 16


@functools.lru_cache(maxsize=None)
def warn_costly_size(source: str, teacher_size: int, activation_bytes: int, student_size: int, batch) -> None:
    ratio = (teacher_size / student_size) ** 2
    if ratio <= COSTLY_PIXEL_RATIO:
        return
    per_image = activation_bytes / 2**20
    at_batch = (f", {per_image * batch / 1024:.2f} GiB at train.batch_size={batch}" if isinstance(batch, int)
                else "")
    log.warning("distill.teacher %s runs at %d px, %.0fx the pixels of the student's %d px: in every training "
                "step its largest activation alone takes %.0f MiB per image%s. A teacher recorded at a size "
                "nearer the student's costs less", source, teacher_size, ratio, student_size, per_image, at_batch)


def check_same_teacher_everywhere(teacher: Teacher) -> None:
    """Under several processes: every rank loaded the same teacher (nodes may see different files under one
    path); ConfigError on every rank, listing their digests, when not."""
    digests = dist_utils.all_gather_objects([teacher.identity["sha256"], teacher.identity.get("config_sha256")])
    if any(d != digests[0] for d in digests):
        listed = ", ".join(f"rank {rank}: {d[0][:12]}{'/' + d[1][:12] if d[1] else ''}" for rank, d in enumerate(digests))
        raise ConfigError(f"'distill.teacher' = {teacher.identity['source']}: the processes loaded different "
                          f"teachers ({listed}); every node must see the same file")


def freeze(model: torch.nn.Module) -> None:
    """Eval mode (BatchNorm uses its running statistics, dropout is off) and no gradients, for good."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)


def class_mismatch(teacher: Teacher, classes: list[str]) -> Optional[str]:
    """Why the teacher cannot teach these classes (None when it can): another head size, no class names, or the
    first class whose name or position differs."""
    if teacher.num_outputs != len(classes):
        return (f"its classifier has {teacher.num_outputs} outputs, the student's {len(classes)} classes "
                f"({', '.join(classes[:5])}{', ...' if len(classes) > 5 else ''})")
    if teacher.classes is None:
        return ("it records no class names, so its outputs cannot be matched to the student's classes (a teacher "
                "trained here records them: its best.pt, or export.py --format timm)")
    for index, (theirs, ours) in enumerate(zip(teacher.classes, classes)):
        if theirs != ours:
            return f"class {index} is '{theirs}' for the teacher and '{ours}' for the student (names and order must match)"
    return None


MAX_BYTES = 256 << 20  # the most the kept predictions may take (an int32 per image single-label: 67M images)


class TeacherPredictions:
    """The teacher's `task.prediction` row per validation image, by the image's index in the split (this
    rank's shard only: the rows of other ranks' images are never read). `ready` once a whole pass is stored.
    A split whose rows would pass MAX_BYTES, or a batch without indices, is not kept: the teacher then runs
    at every validation."""

    def __init__(self, max_bytes: int = MAX_BYTES):
        self.max_bytes = max_bytes
        self.rows: Optional[torch.Tensor] = None
        self.ready = False    # a whole pass stored: validations read the rows instead of running the teacher
        self.given_up = False

    def usable(self) -> bool:
        return self.ready and not self.given_up

    def store(self, indices: Optional[torch.Tensor], predictions: torch.Tensor) -> None:
        if self.given_up:
            return
        if indices is None:
            self.given_up, self.rows = True, None
            return
        if len(indices) == 0:
            return
        needed = int(indices.max()) + 1  # indices come from the loader, on the host: no device sync
        if self.rows is None or needed > len(self.rows):
            row_bytes = predictions.element_size() * max(predictions[0].numel(), 1)
            if needed * row_bytes > self.max_bytes:
                self.given_up, self.rows = True, None
                return
            size = min(max(needed, 2 * len(self.rows) if self.rows is not None else needed),
                       self.max_bytes // row_bytes)
            grown = torch.zeros((size, *predictions.shape[1:]), dtype=predictions.dtype, device=predictions.device)
            if self.rows is not None:
                grown[:len(self.rows)] = self.rows
            self.rows = grown
        self.rows[indices.to(self.rows.device, non_blocking=True)] = predictions

    def lookup(self, indices: torch.Tensor) -> torch.Tensor:
        return self.rows[indices.to(self.rows.device, non_blocking=True)]

    def pass_done(self) -> None:
        """A validation pass ended normally: what it stored covers this rank's whole shard."""
        self.ready = self.ready or self.rows is not None  # rows exist once stored, never after giving up
