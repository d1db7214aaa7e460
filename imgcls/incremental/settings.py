"""The `incremental` section: adding classes to a trained model without forgetting the old ones
(imgcls/incremental, objectives/incremental.py; docs/incremental.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

from imgcls.core.errors import ConfigError
from imgcls.core.settings import setting


@dataclass
class IncrementalConfig:
    """The base is compared by its content digest on --resume (recorded in last.pt), not its path."""
    HELP = "class-incremental training: extend a trained model with new classes (docs/incremental.md)"

    base: Optional[str] = setting(None, "null (off) | the best.pt whose classes are kept, in their order; the new "
                                        "data's other classes are appended (train.py --extend PATH sets it)",
                                  resume_free=True)
    memory_per_class: int = setting(20, "old-class exemplars kept per class, chosen by herding on the base model's "
                                        "embeddings of the base run's training files; 0: none", lo=0, hi=100000)
    distill: bool = setting(True, "distil the base model's outputs on the old classes (Learning without Forgetting)")
    distill_weight: float = setting(1.0, "weight of the distillation term, added to the task loss", lo=0.0, hi=100.0)
    temperature: float = setting(2.0, "softening temperature of the distillation term", lo=0.05, hi=100.0)
    align: Union[bool, Literal["auto"]] = setting(
        "auto", "scale best.pt's new head rows to the old rows' mean norm (weight aligning, Zhao et al. 2020): auto "
                "(only when no old-class exemplar joins the training: measured in docs/incremental.md) | true | false")

    def check(self, cfg) -> None:
        if self.base is None:
            return
        if not self.base.strip():
            raise ConfigError("'incremental.base' = '': name the best.pt whose classes are kept, or null")
        if cfg.distill.teacher:
            raise ConfigError(f"'incremental.base' = {self.base} and 'distill.teacher' = {cfg.distill.teacher}: an "
                              f"extension distils from its base model (incremental.distill); set distill.teacher "
                              f"to null")
        if cfg.semi.method != "none":
            raise ConfigError(f"'incremental.base' = {self.base} and 'semi.method' = {cfg.semi.method}: an extension "
                              f"and semi-supervised training do not combine in one run; extend with labelled images "
                              f"(pseudo-labelled ones through infer.py --pseudo-labels and data.extra_train_csv)")
        if cfg.data.format == "webdataset":
            raise ConfigError(f"'incremental.base' = {self.base}: data.format=webdataset is not supported (its "
                              f"class list is fixed by data.classes); use data.format folder or csv")
