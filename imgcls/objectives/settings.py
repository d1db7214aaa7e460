"""The `distill` section: knowledge distillation from a frozen teacher (objectives/distillation); the `semi`
section: learning from unlabelled images, FixMatch / FlexMatch (objectives/semi)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from imgcls.core.errors import ConfigError
from imgcls.core.settings import setting


@dataclass
class DistillConfig:
    """Another setting is another training, so --resume refuses it; the teacher is compared by its identity (file
    or weight digest, recorded in last.pt), not its path, so a moved copy of the same teacher resumes."""
    HELP = "knowledge distillation from a frozen teacher (docs/distillation.md)"

    teacher: Optional[str] = setting(None, "null (off) | a checkpoint (runs/big/best.pt) | a timm folder "
                                           "(local-dir:PATH or PATH) | a timm or hf-hub: model name", resume_free=True)
    type: Literal["soft", "hard", "feature"] = setting(
        "soft", "soft (KL of temperature-softened outputs x T^2) | hard (cross-entropy on the teacher's argmax) | "
                "feature (pooled pre-logit features through a learned projection)")
    # below 0.05 the softened logits overflow (1e-300: inf, a non-finite first step); the soft term is stable above
    temperature: float = setting(4.0, "softening temperature T of the soft targets", lo=0.05, hi=100.0)
    alpha: float = setting(0.5, "weight of the distillation term; the task loss gets 1 - alpha", lo=0.0, hi=1.0)
    feature_loss: Literal["cosine", "mse"] = setting("cosine", "type=feature: cosine (1 - cosine similarity) | mse, "
                                                               "between projected student and teacher features")

    def check(self, cfg) -> None:
        if self.teacher is not None and not self.teacher.strip():
            raise ConfigError("'distill.teacher' = '': name a teacher (a best.pt, a timm folder or local-dir:PATH, a "
                              "timm model name) or null to train without distillation")


SEMI_METHODS = ("none", "fixmatch", "flexmatch")


@dataclass
class SemiConfig:
    """Semi-supervised training from `data.unlabeled` (docs/semi_supervised.md). The pseudo-labels come from the
    trained model's own forward on the weak view, never from the EMA."""
    HELP = "learning from unlabelled images: FixMatch / FlexMatch (docs/semi_supervised.md)"

    method: Literal[SEMI_METHODS] = setting(
        "none", "none | fixmatch (pseudo-labels above semi.threshold) | flexmatch (class-wise thresholds that rise "
                "with each class's learning status); needs data.unlabeled")
    threshold: float = setting(0.95, "confidence a weak view's prediction needs to become a pseudo-label (FlexMatch: "
                                     "the ceiling of the class-wise thresholds)", lo=0.0, hi=1.0, lo_open=True)
    weight: float = setting(1.0, "lambda_u: the weight of the unlabelled loss beside the labelled one", lo=0.0)
    ratio: int = setting(7, "mu: unlabelled images per labelled one in each step (FixMatch's 7)", lo=1, hi=64)
    warmup: bool = setting(True, "flexmatch: threshold warm-up (images not yet pseudo-labelled count as a class, "
                                 "so thresholds start low and rise)")
    dist_align: bool = setting(False, "distribution alignment: the weak view's probabilities divided by their running "
                                      "mean and renormalised before thresholding (helps with imbalanced classes)")

    def check(self, cfg) -> None:
        if self.method != "none" and not cfg.data.unlabeled:
            raise ConfigError(f"'semi.method' = {self.method} needs 'data.unlabeled' (a folder of unlabelled images, "
                              f"a CSV of their paths or .tar shards)")
        if self.method == "none" and cfg.data.unlabeled:
            raise ConfigError(f"'data.unlabeled' = {cfg.data.unlabeled} is set but 'semi.method' = none; set "
                              f"semi.method=fixmatch (or flexmatch) to learn from it, or drop data.unlabeled")
        if self.method != "none" and cfg.distill.teacher:
            raise ConfigError(f"'semi.method' = {self.method} and 'distill.teacher' = {cfg.distill.teacher}: "
                              f"distillation and semi-supervised training do not combine in one run; distil a "
                              f"student from a semi-supervised teacher (train it first, then distill.teacher="
                              f"its best.pt)")
