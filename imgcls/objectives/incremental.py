"""The `incremental` objective of a class-incremental run (`incremental.base`, docs/incremental.md): the task's
loss on every class, plus (`incremental.distill`) the base model's softened outputs on the old classes
distilled into the student's first outputs (Learning without Forgetting, Li and Hoiem 2016). The base model is
a frozen teacher (`objectives.teacher`) that sees the student's batch converted to its preprocessing.

Its validation splits top-1 into the old classes' images and the new ones', and measures the base model's
old-class top-1 once per run, before the first step. With `incremental.align` the new classes' head rows are
scaled to the old rows' mean norm (weight aligning, Zhao et al. 2020): validation runs the aligned model (the
scale applied to the logits) and best.pt holds the aligned weights (`best_weights`); the trained weights in
last.pt are never scaled, so a resumed run continues bitwise.

The base file is checked before any work (`check_base`, exit 2 naming incremental.base): one of our
checkpoints, loaded safely; the same model family, channel count and a single-label task as the config's; not
a file of this run's output directory."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch

import imgcls.compute.distributed as dist_utils
from imgcls.core.errors import CheckpointError, ConfigError, ModelError
from imgcls.core.files import not_a_regular_file
from imgcls.data.settings import eval_size
from imgcls.evaluation.evaluate import evaluate
from imgcls.model_files.loading import load_model_file
from imgcls.model_files.model_file import ModelFile
from imgcls.models.feature_tap import classifier_name
from imgcls.objectives.base import Objective
from imgcls.objectives.distillation import InputConversion, soft_kl
from imgcls.objectives.teacher import Teacher, file_sha256, freeze
from imgcls.tasks import task_of

log = logging.getLogger(__name__)

KEY = "incremental"  # the objective's name: its record in last.pt and best.pt, its section in summary.json


def open_base(source: str) -> ModelFile:
    """The base checkpoint, loaded safely (weights_only); every refusal is exit 2 naming incremental.base."""
    problem = not_a_regular_file(source)
    if problem:
        raise ConfigError(f"'incremental.base' = {source}: {problem}; name the best.pt of the run whose classes "
                          f"are kept")
    try:
        opened = load_model_file(Path(source).expanduser())
    except (CheckpointError, ConfigError, ModelError) as err:
        raise type(err)(f"'incremental.base' = {source}: not a model this program can extend: {err}") from err
    if opened.kind != "checkpoint":
        raise ConfigError(f"'incremental.base' = {source}: a {opened.kind} export cannot be extended (its weights "
                          f"are not trainable here); name the best.pt it was exported from")
    return opened


def check_base(cfg) -> ModelFile:
    """Before any work: the base can be extended by this config (ConfigError, exit 2, naming the key)."""
    source = cfg.incremental.base
    task_of(cfg).check_supported("incremental.base")
    opened = open_base(source)
    try:
        opened.task.check_supported("incremental.base")
    except ConfigError as err:
        raise ConfigError(f"'incremental.base' = {source}: it is a {opened.task.name} model: {err}") from err
    theirs, ours = opened.cfg, cfg
    if theirs.model.name != ours.model.name:
        raise ConfigError(f"'incremental.base' = {source}: it is a {theirs.model.name} model and model.name is "
                          f"{ours.model.name}; an extension keeps the base's model (set model.name="
                          f"{theirs.model.name})")
    if theirs.data.channels != ours.data.channels:
        raise ConfigError(f"'incremental.base' = {source}: it reads {theirs.data.channels}-channel images and "
                          f"data.channels is {ours.data.channels}; set data.channels={theirs.data.channels}")
    base_dir, out_dir = Path(source).expanduser().resolve().parent, Path(cfg.output.dir).expanduser().resolve()
    if base_dir == out_dir or out_dir in base_dir.parents:
        raise ConfigError(f"'incremental.base' = {source} lies in output.dir {cfg.output.dir}, which this run "
                          f"writes; the base is never written: give the extension its own output.dir")
    return opened


# The base checked before any work, kept for the set-up's use of the same file (one load per run)
CHECKED: dict[str, ModelFile] = {}


def checked_base(cfg, fresh: bool = False) -> ModelFile:
    """`check_base`'s answer, kept from the check before any work (`fresh`: checked again)."""
    source = cfg.incremental.base
    if fresh or source not in CHECKED:
        CHECKED.clear()
        CHECKED[source] = check_base(cfg)
    return CHECKED[source]


def base_teacher(opened: ModelFile, source: str, device: torch.device) -> Teacher:
    """The base model frozen on `device`, as a teacher (its classes, preprocessing and content digest)."""
    model = opened.build_model(device, channels_last=False)
    freeze(model)
    identity = {"source": source, "kind": "checkpoint", "sha256": file_sha256(opened.path),
                "num_outputs": len(opened.classes)}
    return Teacher(model, list(opened.classes), [float(m) for m in opened.cfg.data.mean],
                   [float(s) for s in opened.cfg.data.std], int(eval_size(opened.cfg.data)), identity,
                   opened.task.name)


def alignment_gain(weight: torch.Tensor, old: int) -> Optional[float]:
    """Weight aligning's factor for the new rows: the old rows' mean norm over the new rows' (None: no new rows)."""
    if weight.shape[0] <= old:
        return None
    norms = weight.detach().float().flatten(1).norm(dim=1)
    return float(norms[:old].mean() / norms[old:].mean().clamp_min(1e-12))


class SplitProbe(torch.nn.Module):
    """The evaluated model with weight aligning applied to its logits (new columns x gain), and the images
    whose target is an old / a new class counted with their correct top-1 (device sums)."""

    def __init__(self, model: torch.nn.Module, old: int, gain: Optional[float], device: torch.device):
        super().__init__()
        self.model, self.old, self.gain = model, old, gain
        self.training = model.training
        self.sums = torch.zeros(4, dtype=torch.int64, device=device)  # old right, old seen, new right, new seen

    def train(self, mode: bool = True):
        self.model.train(mode)
        self.training = mode
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        logits = self.model(images)
        if self.gain is None:
            return logits
        scale = torch.ones(logits.shape[1], dtype=logits.dtype, device=logits.device)
        scale[self.old:] = self.gain
        return logits * scale

    def count(self, logits: torch.Tensor, targets, valid: torch.Tensor, indices) -> None:
        targets = targets.to(logits.device, non_blocking=True)
        valid = valid.to(logits.device, non_blocking=True)
        right = (logits.argmax(dim=1) == targets) & valid
        is_old = targets < self.old
        self.sums += torch.stack([(right & is_old).sum(), (valid & is_old).sum(), (right & ~is_old).sum(),
                                  (valid & ~is_old).sum()])

    def read(self) -> dict:
        totals = self.sums.clone()
        dist_utils.all_reduce_sum(totals)
        old_right, old_seen, new_right, new_seen = totals.tolist()
        return {"old_top1": 100.0 * old_right / old_seen if old_seen else None,  # None: no such image in the split
                "new_top1": 100.0 * new_right / new_seen if new_seen else None}


class BaseOnStudentInput(torch.nn.Module):
    """The base model as a model of the student's input and classes: its logits, then a very low logit for each
    new class (the base cannot answer one), so the task's sums of every class take them."""

    def __init__(self, objective: "IncrementalObjective"):
        super().__init__()
        self.__dict__["objective"] = objective

    def train(self, mode: bool = True):
        self.training = mode
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        logits = self.objective.base_forward(images).float()
        missing = len(self.objective.classes) - logits.shape[1]
        return torch.nn.functional.pad(logits, (0, missing), value=-1e4) if missing > 0 else logits


class IncrementalObjective(Objective):
    name = KEY
    in_best_file = True

    def __init__(self, base: Teacher, conversion: InputConversion, criterion: torch.nn.Module, classes: list[str],
                 head: Optional[str], cfg_incremental, task):
        super().__init__(criterion)
        self.task = task
        self.base, self.conversion, self.head = base, conversion, head
        self.old = len(base.classes)
        self.classes = list(classes) if classes is not None else list(base.classes)
        c = cfg_incremental
        self.distill, self.weight, self.temperature = c.distill, c.distill_weight, c.temperature
        self.align_setting = c.align
        self.align = c.align is True  # `auto` is decided by `use_memory`
        self.base_old_top1: Optional[float] = None  # measured once per run (kept in last.pt)
        self.extras: dict = {}  # what the set-up adds to summary.json (the exemplar memory's record)

    def __call__(self, model: torch.nn.Module, images: torch.Tensor,
                 targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        logits = model(images)
        loss = self.criterion(logits, targets)
        if self.distill and self.weight > 0:
            old_logits = self.base_forward(images)
            loss = loss + self.weight * soft_kl(logits[:, :self.old], old_logits, self.temperature)
        return loss, {}

    def base_forward(self, images: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.base.model(self.conversion(images))

    def use_memory(self, record: dict) -> None:
        """The run's exemplar memory (its summary record): with `incremental.align: auto`, weight aligning is on
        when no exemplar joins the training split (on digits it then raised old-class top-1 from 22 to 58; with
        exemplars it lowered all-class top-1 from 98.0 to 95.8: docs/incremental.md)."""
        self.extras.update(record)
        if self.align_setting == "auto":
            self.align = record["memory"]["exemplars"] == 0
        log.info("incremental: weight aligning %s%s", "on" if self.align else "off",
                 " (auto: " + ("no" if self.align else "with") + " exemplars)" if self.align_setting == "auto" else "")

    def gain_of(self, model: torch.nn.Module) -> Optional[float]:
        if not self.align or self.head is None:
            return None
        return alignment_gain(getattr(model, "_orig_mod", model).get_submodule(self.head).weight, self.old)

    def prepare(self, val_loader, device_input, classes: list[str]) -> None:
        """The base model's top-1 on the validation images of the old classes, once per run."""
        if self.base_old_top1 is None:
            probe = SplitProbe(BaseOnStudentInput(self), self.old, None, device_input.device)
            evaluate(probe, val_loader, device_input, self.task, classes, on_outputs=probe.count)
            self.base_old_top1 = probe.read()["old_top1"]
        figure = "-" if self.base_old_top1 is None else f"{self.base_old_top1:.2f}"
        log.info("incremental: base %s (%d classes) validated on the old classes: top-1 %s; %d new class(es): %s",
                 self.base.identity["source"], self.old, figure, len(self.classes) - self.old,
                 ", ".join(self.classes[self.old:][:10]))

    def validation_model(self, eval_model: torch.nn.Module):
        probe = SplitProbe(eval_model, self.old, self.gain_of(eval_model), next(eval_model.parameters()).device)
        return probe, probe.count

    def validation_metrics(self, model) -> dict:
        return model.read() if isinstance(model, SplitProbe) else {}

    def best_weights(self, weights: dict) -> dict:
        """best.pt's weights: the new head rows (weight and bias) scaled by the aligning gain."""
        if not self.align or self.head is None:
            return weights
        gain = alignment_gain(weights[f"{self.head}.weight"], self.old)
        if gain is None:
            return weights
        weights = dict(weights)
        for name in (f"{self.head}.weight", f"{self.head}.bias"):
            if name in weights:
                scaled = weights[name].clone()
                scaled[self.old:] *= gain
                weights[name] = scaled
        return weights

    def summary(self) -> dict:
        return {KEY: {"base": self.base.identity["source"], "base_sha256": self.base.identity["sha256"],
                      "old_classes": self.classes[:self.old], "new_classes": self.classes[self.old:],
                      "base_old_top1": self.base_old_top1, "distill": self.distill, "align": self.align,
                      **self.extras}}

    def state_dict(self) -> dict:
        """In last.pt and best.pt: the base's identity, which classes are old (eval.py's split) and its figure."""
        return {"base": {k: v for k, v in self.base.identity.items() if k != "num_outputs"},
                "old_classes": self.classes[:self.old], "base_old_top1": self.base_old_top1}

    def load_state_dict(self, record: dict) -> None:
        self.base_old_top1 = record.get("base_old_top1")

    def check_resume(self, ckpt: dict) -> None:
        saved = (ckpt.get(KEY) or {}).get("base")
        ours = self.base.identity
        if not isinstance(saved, dict):
            raise ConfigError(f"--resume: the checkpoint was not trained as an extension; incremental.base="
                              f"{ours['source']} would be another training (start a new run)")
        if saved.get("sha256") != ours["sha256"]:
            raise ConfigError(f"--resume: incremental.base is another model than the checkpoint's: "
                              f"{saved.get('source')} (sha256 {str(saved.get('sha256'))[:12]}) -> {ours['source']} "
                              f"(sha256 {ours['sha256'][:12]}); resume with the same base, or start a new run")


def check_not_extended(ckpt: dict) -> None:
    """--resume without incremental.base: an extension continues only as one (ConfigError, exit 2)."""
    saved = (ckpt.get(KEY) or {}).get("base")
    if isinstance(saved, dict):
        raise ConfigError(f"--resume: the checkpoint extends {saved.get('source')} (sha256 "
                          f"{str(saved.get('sha256'))[:12]}); set incremental.base to that file to continue it")


def check_same_base_everywhere(source: str, opened: ModelFile) -> None:
    """Under several processes, before any work: every rank opened the same base (nodes may see different files
    under one path; DDP would start every rank from rank 0's weights but distil each from its own base, and rank
    0's memory was herded with its own); ConfigError on every rank, listing their digests, when not."""
    digests = dist_utils.all_gather_objects(file_sha256(opened.path))
    if any(d != digests[0] for d in digests):
        listed = ", ".join(f"rank {rank}: {d[:12]}" for rank, d in enumerate(digests))
        raise ConfigError(f"'incremental.base' = {source}: the processes loaded different bases "
                          f"({listed}); every node must see the same file")


def build_incremental(cfg, classes: Optional[list[str]], student: torch.nn.Module,
                      device: torch.device) -> IncrementalObjective:
    """The run's objective when `incremental.base` is set. `classes` None: a step's cost only (the batch finder)."""
    opened = checked_base(cfg)
    base = base_teacher(opened, cfg.incremental.base, device)
    if classes is not None and list(classes[:len(base.classes)]) != base.classes:
        raise ConfigError(f"'incremental.base' = {cfg.incremental.base}: the run's first classes are not the "
                          f"base's ({', '.join(base.classes[:5])} ...)")
    conversion = InputConversion(cfg.data.mean, cfg.data.std, base.mean, base.std, cfg.data.img_size,
                                 base.size).to(device)
    c = cfg.incremental
    log.info("incremental: base %s (%s, sha256 %s), %s; distillation %s%s",
             c.base, opened.cfg.model.name, base.identity["sha256"][:12], conversion.describe(),
             "on" if c.distill else "off", f" (weight {c.distill_weight:g}, T {c.temperature:g})" if c.distill else "")
    task = task_of(cfg)
    return IncrementalObjective(base, conversion, task.criterion(cfg.train), classes, classifier_name(student), c, task)
