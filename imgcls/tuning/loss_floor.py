"""The lowest training loss a recipe's objective can reach, from the recipe alone: the LR range test's rules
(a 4x divergence, a 10% fall) are measured above it (tuning.arithmetic.lr_suggestion).

Cross entropy against a soft target t is H(t) + KL(t || p) >= H(t): with label smoothing s over C classes
the loss cannot fall below the smoothed one-hot's entropy (0.50 nats for s = 0.1, C = 10), and mixup / CutMix
raise the floor further (a mixed target lam * a + (1 - lam) * b is softer still). Measured from 0, a smoothed
loss that fell from 2.3 to 0.6 has fallen 74%, but above its floor of 0.5 it has fallen 95%; and a run that
broke at 2.0 is not "4x its minimum" from 0 while it is 15x above the floor.

Why the floor and not the plain cross entropy on the hard labels recorded beside the objective: the
hard-label CE of a mixed batch is not defined (two labels per image), the floor needs no change to the
training step, and the range test then smooths the very loss the optimizer follows (the one that diverges).
"""
from __future__ import annotations

import math
import random

from imgcls.tasks import task_of

# the expectation over the mixing's lambda ~ Beta(alpha, alpha): this many seeded draws (an error of ~0.3% of
# the floor, far under the rules' 10% and 4x)
MIX_DRAWS = 4000


def entropy(probabilities: list[float]) -> float:
    return -sum(p * math.log(p) for p in probabilities if p > 0)


def binary_entropy(p: float) -> float:
    return entropy([p, 1.0 - p])


def target_floor(own: float, other: float, classes: int, smoothing: float, loss: str) -> float:
    """The floor of one soft target: weight `own` on one class and `other` on a second (0 when unmixed), then
    smoothed as tasks.losses.smoothed_targets does; its entropy (`ce`) or mean binary entropy per class (`bce`)."""
    rest = smoothing / classes
    weights = [own * (1 - smoothing) + rest, other * (1 - smoothing) + rest] + [rest] * (classes - 2)
    if loss == "ce":
        return entropy(weights)
    return sum(binary_entropy(w) for w in weights) / classes


def mixed_floor(alpha: float, classes: int, smoothing: float, loss: str, seed: int = 0) -> float:
    """The mean floor of targets mixed with lambda ~ Beta(alpha, alpha), the partner of another class with
    probability (C - 1) / C (balanced classes; a partner of the same class leaves the target unmixed)."""
    draws = random.Random(seed)
    total = 0.0
    for _ in range(MIX_DRAWS):
        lam = draws.betavariate(alpha, alpha)
        total += target_floor(lam, 1 - lam, classes, smoothing, loss)
    unmixed = target_floor(1.0, 0.0, classes, smoothing, loss)
    return (classes - 1) / classes * total / MIX_DRAWS + unmixed / classes


def loss_floor(cfg, classes: int) -> tuple[float, str]:
    """The floor of `cfg`'s training loss over `classes` classes and what sets it ('' when it is 0): the
    smoothing and the mixing (train.mix_prob of the micro-batches; with both mixup and CutMix on,
    train.mix_switch_prob of them CutMix, whose lambda is drawn as mixup's); under distillation the task loss
    weighs (1 - distill.alpha) (the distillation terms can reach 0). 0 for multi-label tasks (their tags per
    image are not known here), `asl` (not a proper scoring rule: no entropy floor) and binarised `bce` targets."""
    t = cfg.train
    one_label = task_of(cfg).activation == "softmax"
    if not one_label or classes < 2 or t.loss == "asl" or (t.loss == "bce" and t.bce_target_thresh is not None):
        return 0.0, ""
    unmixed = target_floor(1.0, 0.0, classes, t.label_smoothing, t.loss)
    parts = [f"label smoothing {t.label_smoothing:g} over {classes} classes"] if t.label_smoothing > 0 else []
    floor = unmixed
    alphas = [(a, share) for a, share in ((t.mixup_alpha, 1 - t.mix_switch_prob if t.cutmix_alpha > 0 else 1.0),
                                          (t.cutmix_alpha, t.mix_switch_prob if t.mixup_alpha > 0 else 1.0))
              if a > 0]
    if alphas and t.mix_prob > 0:
        mixed = sum(share * mixed_floor(a, classes, t.label_smoothing, t.loss) for a, share in alphas)
        floor = t.mix_prob * mixed + (1 - t.mix_prob) * unmixed
        parts.append("mixup / CutMix soft targets")
    teacher = getattr(cfg, "distill", None)
    if teacher is not None and teacher.teacher:
        floor *= 1 - teacher.alpha
        if floor > 0:
            parts.append(f"x (1 - distill.alpha={teacher.alpha:g})")
    return (floor, ", ".join(parts)) if floor > 0 else (0.0, "")
