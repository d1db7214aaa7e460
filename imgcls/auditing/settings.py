"""The `audit` section: audit.py's knobs (never read by training; free to change on --resume)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from imgcls.core.errors import ConfigError
from imgcls.core.settings import SEED_LIMIT, setting


@dataclass
class AuditConfig:
    HELP = "audit.py only (python audit.py --help); training never reads these"

    folds: int = setting(4, "K-fold cross-validation runs that give every image an out-of-sample prediction (0: no "
                            "label-issue search)", lo=0, hi=100, resume_free=True)
    fold_epochs: Optional[int] = setting(None, "epochs of each fold's training run (null: train.epochs)", lo=1,
                                         resume_free=True)
    near_threshold: int = setting(6, "near duplicates: perceptual-hash (64-bit pHash) Hamming distance up to this "
                                     "(0: identical hashes only)", lo=0, hi=64, resume_free=True)
    pixel_threshold: Optional[float] = setting(0.99, "a pHash candidate counts when its 32x32 thumbnails' aligned "
                                                     "correlation reaches this, -1..1 (null: pHash alone); "
                                                     "docs/hardening.md", lo=-1.0, hi=1.0, resume_free=True)
    min_class_images: int = setting(20, "a class with fewer training images than this is named as too small", lo=0,
                                    resume_free=True)
    drop_label_issues: int = setting(0, "--write-clean-csv also leaves out the N most likely label errors of the "
                                        "training split", lo=0, resume_free=True)
    seed: int = setting(0, "the fold assignment (stratified, a hash of seed and path)", lo=0, hi=SEED_LIMIT,
                        resume_free=True)

    def check(self, cfg) -> None:
        if self.folds == 1:
            raise ConfigError("'audit.folds' = 1: cross-validation needs at least 2 folds (each image is predicted "
                              "by a model trained on the others); use 2 or more, or 0 to skip the label-issue search")
