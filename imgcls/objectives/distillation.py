"""Knowledge distillation, the `distill` objective: a frozen teacher whose outputs add a term to the student's
loss (`distiller.Distiller`), the teacher's loading and identity (`teacher`), its input conversion
(`conversion`), the loss terms (`losses`) and its validation and agreement with the student (`agreement`).

The distillation terms, each a function of the student's and the teacher's outputs (the teacher's carry no
gradient). Every term is a mean over the batch, so it adds to the task loss like another loss.

The teacher sees the student's batch (the same crop, flip, mixed image) converted on the device to its own
preprocessing: the student's normalisation undone and the teacher's applied (one multiply-add per channel),
and resized to the teacher's input size where it differs.

The teacher on the validation split: its validation before the first step, and the agreement of student
and teacher at each validation. The teacher is frozen and the validation transform deterministic, so the
teacher's prediction for a validation image never changes: `TeacherPredictions` keeps it from the first pass
over the split (`objectives.teacher.TeacherPredictions`), and later validations count the agreement
without running the teacher (on the quickstart digits that was 40% of each validation's time).

`Distiller`, the distillation objective: the frozen teacher, the conversion of the student's batch to the teacher's input, and the loss
term; with `distill.type=feature` also the learned projection of the student's pre-logit features onto the
teacher's, which trains with the student (its parameters are an optimizer group, its weights are in last.pt,
never in best.pt or an export).

The epoch calls it once per micro-batch, inside the student's autocast: the teacher runs under the same
precision, without gradients. The teacher's share of the step time is measured without host syncs: CUDA
events recorded around its forward are read only when a step line is logged (on the CPU the forward is
synchronous and a clock suffices)."""
from __future__ import annotations

import logging
import time
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

import imgcls.compute.distributed as dist_utils
from imgcls.core.errors import ConfigError
from imgcls.evaluation.evaluate import evaluate
from imgcls.models.feature_tap import FeatureTap, classifier_of, feature_width as tapped_width
from imgcls.objectives.base import Objective
from imgcls.objectives.teacher import (Teacher, TeacherPredictions, check_same_teacher_everywhere, load_teacher,
                                       teacher_change, teacher_mismatch)
from imgcls.tasks import task_of
from imgcls.tasks.base import Task


def soft_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) between the temperature-softened class distributions, times T^2 so the gradient's
    size does not shrink with T (Hinton et al. 2015); mean over the batch."""
    t = temperature
    student = F.log_softmax(student_logits.float() / t, dim=1)
    teacher = F.log_softmax(teacher_logits.float() / t, dim=1)
    return F.kl_div(student, teacher, reduction="batchmean", log_target=True) * (t * t)


def hard_ce(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy on the teacher's top class (DeiT's hard distillation)."""
    return F.cross_entropy(student_logits.float(), teacher_logits.argmax(dim=1))


def soft_bce(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Multi-label: binary cross-entropy of the student's tempered sigmoids against the teacher's tempered
    sigmoid probabilities (soft targets), times T^2; mean over classes and batch."""
    t = temperature
    targets = torch.sigmoid(teacher_logits.float() / t)
    return F.binary_cross_entropy_with_logits(student_logits.float() / t, targets) * (t * t)


def hard_bce(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Multi-label: binary cross-entropy against the teacher's tags at probability 0.5."""
    return F.binary_cross_entropy_with_logits(student_logits.float(), (teacher_logits > 0).float())


def feature_distance(projected: torch.Tensor, teacher_features: torch.Tensor, kind: str) -> torch.Tensor:
    """Between the student's projected pre-logit features and the teacher's: `cosine` (1 - cosine similarity,
    mean over the batch) or `mse` (mean squared difference over batch and features)."""
    projected, teacher_features = projected.float(), teacher_features.float()
    if kind == "cosine":
        return (1.0 - F.cosine_similarity(projected, teacher_features, dim=1)).mean()
    return F.mse_loss(projected, teacher_features)


def logit_term(activation: str, kind: str):
    """The term of `distill.type` soft or hard for a task whose probabilities come by `activation` (softmax:
    one label per image; sigmoid: tags): f(student_logits, teacher_logits, T)."""
    terms = {("softmax", "soft"): soft_kl,
             ("softmax", "hard"): lambda s, t, _: hard_ce(s, t),
             ("sigmoid", "soft"): soft_bce,
             ("sigmoid", "hard"): lambda s, t, _: hard_bce(s, t)}
    return terms[(activation, kind)]

class InputConversion(torch.nn.Module):
    """Student-normalised NCHW batch -> teacher-normalised batch at `size` px. x_t = (x_s * std_s + mean_s -
    mean_t) / std_t, i.e. x_s * scale + shift per channel; then a bilinear resize (antialiased when shrinking)
    when the sizes differ."""

    def __init__(self, student_mean: Sequence[float], student_std: Sequence[float], teacher_mean: Sequence[float],
                 teacher_std: Sequence[float], student_size: int, teacher_size: int):
        super().__init__()
        s_mean, s_std = torch.tensor(student_mean, dtype=torch.float64), torch.tensor(student_std, dtype=torch.float64)
        t_mean, t_std = torch.tensor(teacher_mean, dtype=torch.float64), torch.tensor(teacher_std, dtype=torch.float64)
        scale, shift = s_std / t_std, (s_mean - t_mean) / t_std
        self.identity_affine = bool(torch.allclose(scale, torch.ones_like(scale)) and torch.allclose(shift, torch.zeros_like(shift)))
        self.register_buffer("scale", scale.float().view(1, -1, 1, 1), persistent=False)
        self.register_buffer("shift", shift.float().view(1, -1, 1, 1), persistent=False)
        self.size = int(teacher_size)
        self.resizes = int(teacher_size) != int(student_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if not self.identity_affine:
            images = torch.addcmul(self.shift.to(images.dtype), images, self.scale.to(images.dtype))
        if self.resizes:
            images = F.interpolate(images, size=(self.size, self.size), mode="bilinear", align_corners=False,
                                   antialias=images.shape[-1] > self.size)
        return images

    def describe(self) -> str:
        parts = ["mean/std converted" if not self.identity_affine else "same mean/std"]
        parts.append(f"resized to {self.size} px" if self.resizes else f"same size {self.size} px")
        return ", ".join(parts)

class AgreementProbe(torch.nn.Module):
    """The student on each validation batch, and the images on which it agrees with the teacher counted
    (device sums). The teacher runs beside the student until its predictions are kept (`TeacherPredictions`).
    Returns the student's logits, so the validation's metrics are the student's."""

    def __init__(self, student: torch.nn.Module, distiller: "Distiller"):
        super().__init__()
        self.student = student
        self.__dict__["distiller"] = distiller
        self.training = student.training  # evaluate() puts back the mode it found: the student's
        device = next(student.parameters()).device
        self.agree = torch.zeros((), dtype=torch.int64, device=device)
        self.count_all = torch.zeros((), dtype=torch.int64, device=device)
        self.kept = distiller.val_predictions
        self.teacher_runs = not self.kept.usable()
        self.teacher_logits: Optional[torch.Tensor] = None

    def train(self, mode: bool = True):
        self.student.train(mode)  # the teacher stays in eval mode
        self.training = mode
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.teacher_runs:
            self.teacher_logits = self.distiller.teacher_forward(images)
        return self.student(images)

    def count(self, logits: torch.Tensor, targets, valid: torch.Tensor, indices) -> None:
        """evaluate()'s `on_outputs`: the batch's readable images whose predictions agree are counted."""
        task = self.distiller.task
        if self.teacher_runs:
            teacher = task.prediction(self.teacher_logits.float())
            self.kept.store(indices, teacher)
        else:
            teacher = self.kept.lookup(indices)
        valid = valid.to(logits.device, non_blocking=True)
        same = task.same_prediction(task.prediction(logits.float()), teacher) & valid
        self.agree += same.sum()
        self.count_all += valid.sum()

    def read(self) -> float:
        """The agreement in percent over every rank's images (one all-reduce, one host read); the pass is over."""
        # the epoch's training has ended (its last step logged): validation and the save are no step time
        self.distiller.timer.pause()
        self.kept.pass_done()
        totals = torch.stack([self.agree, self.count_all])
        dist_utils.all_reduce_sum(totals)
        agree, count = totals.tolist()
        return 100.0 * agree / count if count else float("nan")


class TeacherOnStudentInput(torch.nn.Module):
    """The teacher as a model of the student's input (for evaluate()): conversion, then the teacher."""

    def __init__(self, distiller: "Distiller"):
        super().__init__()
        self.__dict__["distiller"] = distiller

    def train(self, mode: bool = True):
        self.training = mode  # the teacher stays in eval mode
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.distiller.teacher_forward(images)


def validate_teacher(distiller: "Distiller", loader, device_input, classes: list[str]) -> dict:
    """The teacher's validation on the run's validation split (every rank's shard, summed): its metrics (top1,
    ..., or mAP for multi-label), as the student's are computed. Its predictions are kept for the agreement."""
    kept, task = distiller.val_predictions, distiller.task
    sums, _ = evaluate(TeacherOnStudentInput(distiller), loader, device_input, task, classes,
                       on_outputs=lambda logits, targets, valid, indices: kept.store(indices, task.prediction(logits)))
    kept.pass_done()
    sums.all_reduce()
    metrics = sums.compute()
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

log = logging.getLogger(__name__)


def classifier_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose input is the pooled pre-logit features (models.feature_tap's rule)."""
    head = classifier_of(model)
    if head is None:
        raise ConfigError(f"distill.type=feature: cannot find the classifier of {type(model).__name__} (no "
                          f"get_classifier() with weights and no torchvision fc / classifier / heads); use "
                          f"distill.type=soft or hard")
    return head[1]


def feature_width(model: torch.nn.Module) -> int:
    classifier_module(model)
    return tapped_width(model)


class StepTimer:
    """The teacher's seconds since the last read, without a host sync per step (CUDA events are read at
    `take`, when a log line syncs anyway)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events: list = []
        self.seconds = 0.0
        self.since: Optional[float] = None

    def start(self):
        if self.since is None:
            self.since = time.perf_counter()
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            return begin, end
        return time.perf_counter()

    def stop(self, mark) -> None:
        if self.cuda:
            mark[1].record()
            self.events.append(mark)
        else:
            self.seconds += time.perf_counter() - mark

    def pause(self) -> None:
        """Out of training (a validation pass, a save): the next window starts at the next teacher forward."""
        self.take_share()
        self.since = None

    def take_share(self) -> Optional[float]:
        """The teacher's share of the wall time since the last read (None before its first forward)."""
        if self.since is None:
            return None
        if self.events:
            self.events[-1][1].synchronize()
            self.seconds += sum(b.elapsed_time(e) for b, e in self.events) / 1000
            self.events = []
        now = time.perf_counter()
        share = self.seconds / max(now - self.since, 1e-9)
        self.seconds, self.since = 0.0, now
        return share


class Distiller(Objective):
    """The distillation objective. The teacher and the conversion are plain attributes, never in an
    optimizer, DDP or a state_dict; the projection (type=feature) trains with the student (`parameters`) and
    is saved in last.pt's `distill` record with the teacher's identity and validation (`state_dict`)."""

    name = "distill"

    def __init__(self, teacher: Teacher, conversion: InputConversion, kind: str, temperature: float, alpha: float,
                 task: Task, student: torch.nn.Module, feature_loss: str = "cosine",
                 criterion: Optional[torch.nn.Module] = None):
        super().__init__(criterion)
        self.teacher, self.conversion = teacher, conversion
        self.kind, self.temperature, self.alpha, self.task = kind, temperature, alpha, task
        self.feature_loss = feature_loss
        self.timer = StepTimer(next(teacher.model.parameters()).device)
        self.teacher_metrics: Optional[dict] = None  # its validation, once per run (kept in last.pt)
        self.val_predictions = TeacherPredictions()  # its prediction per validation image, for the agreement
        self.projection: Optional[torch.nn.Linear] = None
        if kind == "feature":
            self.student_tap = FeatureTap(student, keep_graph=True, keep="last")  # trains through it
            self.teacher_tap = FeatureTap(teacher.model, keep_graph=True, keep="last")
            self.projection = torch.nn.Linear(feature_width(student), feature_width(teacher.model))
            self.projection.to(next(student.parameters()).device)

    def __call__(self, model: torch.nn.Module, images: torch.Tensor,
                 targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
        logits = model(images)
        return self.loss(logits, images, self.criterion(logits, targets)), {}

    def teacher_forward(self, images: torch.Tensor) -> torch.Tensor:
        """The teacher's logits for a student-normalised batch (no gradient, eval mode, the caller's autocast)."""
        with torch.no_grad():
            return self.teacher.model(self.conversion(images))

    def loss(self, student_logits: torch.Tensor, images: torch.Tensor, task_loss: torch.Tensor) -> torch.Tensor:
        """(1 - alpha) x the task loss + alpha x the distillation term, for the micro-batch `images` (as the
        student saw them) and the student's outputs on it."""
        mark = self.timer.start()
        teacher_logits = self.teacher_forward(images)
        self.timer.stop(mark)
        if self.kind == "feature":
            teacher_features = self.teacher_tap.take()
            term = feature_distance(self.projection(self.student_tap.take()), teacher_features, self.feature_loss)
        else:
            term = logit_term(self.task.activation, self.kind)(student_logits, teacher_logits, self.temperature)
        return (1.0 - self.alpha) * task_loss + self.alpha * term

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.projection.parameters()) if self.projection is not None else []

    def end_window(self, distributed: bool) -> None:
        """Under DDP: the projection lives outside the DDP wrapper, so its gradients are averaged here, as DDP
        averages the student's."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not distributed or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if dist_utils.is_initialized():
            dist_utils.all_reduce_sum(flat).div_(torch.distributed.get_world_size())
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def interval_logs(self) -> dict:
        """The step line's teacher figure (read at log intervals only)."""
        share = self.timer.take_share()
        return {} if share is None else {"train/teacher_time_frac": share}

    def prepare(self, val_loader, device_input, classes: list[str]) -> None:
        """The teacher is validated once per run, before its first step (kept in last.pt after that)."""
        if self.teacher_metrics is None:
            self.teacher_metrics = validate_teacher(self, val_loader, device_input, classes)
        summary = self.summary()["teacher"]
        figures = ", ".join(f"{k} {summary[k]:.2f}" for k in ("top1", "top5", "mAP") if k in summary)
        log.info("distill: teacher %s validated: %s (%s samples)", summary["source"], figures,
                 summary.get("num_samples"))

    def validation_model(self, eval_model: torch.nn.Module):
        probe = AgreementProbe(eval_model, self)
        return probe, probe.count

    def validation_metrics(self, model) -> dict:
        return {"teacher_agreement": model.read()} if isinstance(model, AgreementProbe) else {}

    def summary(self) -> dict:
        """summary.json's `teacher`: its identity and its validation metrics."""
        identity = {k: v for k, v in self.teacher.identity.items() if k != "num_outputs"}
        return {"teacher": {**identity, **(self.teacher_metrics or {})}}

    # ------------------------------------------------------------ last.pt

    def state_dict(self) -> dict:
        record = {"teacher": dict(self.teacher.identity), "teacher_metrics": dict(self.teacher_metrics or {})}
        if self.projection is not None:
            record["projection"] = {k: v.detach().cpu() for k, v in self.projection.state_dict().items()}
        return record

    def load_state_dict(self, record: dict) -> None:
        """After --resume passed `check_resume`: the projection's weights and the teacher's validation."""
        if self.projection is not None:
            self.projection.load_state_dict(record["projection"])
        self.teacher_metrics = dict(record.get("teacher_metrics") or {}) or None

    def check_resume(self, ckpt: dict) -> None:
        """ConfigError (exit 2) when the checkpoint was distilled from another teacher (or none)."""
        saved = (ckpt.get("distill") or {}).get("teacher")
        ours = self.teacher.identity
        if not isinstance(saved, dict):
            raise ConfigError(f"--resume: the checkpoint was trained without a teacher; distill.teacher="
                              f"{ours['source']} would be another training (start a new run)")
        change = teacher_change(saved, ours)  # the same source whose file changed, or another: another teacher
        if change:
            raise ConfigError(f"--resume: distill.teacher is another teacher than the checkpoint's: {change}; "
                              f"resume with the same teacher, or start a new run")


def check_no_teacher(ckpt: dict) -> None:
    """--resume without distill.teacher: a distilled run continues only distilled (ConfigError, exit 2)."""
    saved = (ckpt.get("distill") or {}).get("teacher")
    if isinstance(saved, dict):
        raise ConfigError(f"--resume: the checkpoint was distilled from {saved.get('source')} (sha256 "
                          f"{str(saved.get('sha256'))[:12]}); set distill.teacher to that teacher to continue it")


def build_distiller(cfg, classes: Optional[list[str]], student: torch.nn.Module, device: torch.device) -> Distiller:
    """The run's `Distiller` (call when `distill.teacher` is set): the teacher loaded and frozen, its classes
    checked against the student's (ConfigError, exit 2, naming the first difference). `classes` None: for
    measuring a step's cost only (tune.py's batch finder on synthetic data), nothing is checked."""
    d = cfg.distill
    teacher = load_teacher(d.teacher, device)
    problem = teacher_mismatch(teacher, cfg, classes)
    if classes is not None:
        check_same_teacher_everywhere(teacher)
    if problem:
        raise ConfigError(f"'distill.teacher' = {d.teacher}: this teacher cannot teach the student: {problem}")
    conversion = InputConversion(cfg.data.mean, cfg.data.std, teacher.mean, teacher.std, cfg.data.img_size,
                                 teacher.size).to(device)
    task = task_of(cfg)
    distiller = Distiller(teacher, conversion, d.type, d.temperature, d.alpha, task, student, d.feature_loss,
                          task.criterion(cfg.train))
    log.info("distill: %s teacher %s (%s, sha256 %s), %s; type %s%s, alpha %g (task loss x %g)", teacher.identity["kind"],
             d.teacher, type(teacher.model).__name__, teacher.identity["sha256"][:12], conversion.describe(), d.type,
             f" (T {d.temperature:g})" if d.type == "soft" else (f" ({d.feature_loss})" if d.type == "feature" else ""),
             d.alpha, 1 - d.alpha)
    return distiller
