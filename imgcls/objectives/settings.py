"""The `distill` section: knowledge distillation from a frozen teacher (objectives/distillation)."""
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
