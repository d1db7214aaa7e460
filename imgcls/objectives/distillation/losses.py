"""The distillation terms, each a function of the student's and the teacher's outputs (the teacher's carry no
gradient). Every term is a mean over the batch, so it adds to the task loss like another loss."""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
