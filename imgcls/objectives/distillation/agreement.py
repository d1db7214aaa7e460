"""The teacher on the validation split: its validation before the first step, and the agreement of student
and teacher at each validation. The teacher is frozen and the validation transform deterministic, so the
teacher's prediction for a validation image never changes: `TeacherPredictions` keeps it from the first pass
over the split (`objectives.distillation.teacher.TeacherPredictions`), and later validations count the agreement
without running the teacher (on the quickstart digits that was 40% of each validation's time)."""
from __future__ import annotations

from typing import Optional

import torch

from imgcls.evaluation.evaluate import evaluate
import imgcls.runtime.distributed as dist_utils



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
