"""The `model` section: which network, its weights, normalisation, regularisation, the weight EMA and fine-tuning."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from imgcls.core.errors import ConfigError
from imgcls.core.settings import setting


@dataclass
class ModelConfig:
    name: str = setting("resnet50", "a timm model name (resnet18, efficientnet_b0, ...) or tv:<name> for torchvision",
                        allowed="a timm model, tv:NAME, hf-hub:ORG/NAME or local-dir:PATH (checked before any work)")
    weights: Optional[str] = setting(None, "local weights file (.pt / .pth / .safetensors / our checkpoint); "
                                           "mismatched classifier skipped")
    norm: Literal["batch", "group"] = setting("batch", "batch | group (BatchNorm -> GroupNorm, for small per-device "
                                                       "batches)")
    group_norm_groups: int = setting(32, "groups for model.norm=group (reduced to a divisor of each layer's width)",
                                     lo=1)
    sync_bn: bool = setting(False, "SyncBatchNorm under DDP: statistics over the global batch (GPU processes only)")
    drop_rate: float = setting(0.0, "dropout before the classifier (a tv: model without a dropout option refuses "
                                    "it)", lo=0.0, hi=1.0)
    drop_path_rate: float = setting(0.0, "stochastic depth (timm models that support it; tv: models' "
                                         "stochastic_depth_prob)", lo=0.0, hi=1.0)
    ema_decay: Optional[float] = setting(None, "weight EMA after every optimizer step (e.g. 0.9998); validation and "
                                               "best.pt then use it (null: off)", lo=0.0, hi=1.0, lo_open=True)
    ema_every_steps: int = setting(1, "update the EMA every N optimizer steps with the decay raised to the N-th "
                                      "power (torchvision --model-ema-steps)", lo=1)
    ema_warmup: bool = setting(False, "timm EMA warmup: decay min(ema_decay, 1 - (1 + step) ** -2/3), so the average "
                                      "follows closely at first")
    pretrained: bool = setting(False, "start from pretrained weights: timm's for model.name (also hf-hub:ORG/NAME, "
                                      "local-dir:PATH), torchvision's default for tv:; new classifier for our classes")
    freeze: Optional[Literal["backbone"]] = setting(
        None, "null | backbone: train only the classifier (frozen layers: no gradients, BatchNorm statistics kept) "
              "until model.unfreeze_epoch")
    unfreeze_epoch: Optional[int] = setting(None, "with freeze=backbone: everything trains after this many epochs "
                                                  "(null: frozen the whole run)", lo=1)
    # not resume-free: with BatchNorm in training mode the recomputed forward updates the statistics again
    grad_checkpointing: bool = setting(False, "recompute activations in backward (timm set_grad_checkpointing, "
                                              "tv:densenet*): less memory, ~20-30% slower")

    def check(self, cfg) -> None:
        if self.unfreeze_epoch is not None and self.freeze is None:
            raise ConfigError(f"'model.unfreeze_epoch' = {self.unfreeze_epoch} needs 'model.freeze' = backbone "
                              "(the backbone is not frozen otherwise); set model.freeze=backbone or "
                              "model.unfreeze_epoch=null")
        if self.pretrained and self.weights:
            raise ConfigError("'model.pretrained' = true and 'model.weights' are both set: use one source of "
                              "weights (model.pretrained=false with model.weights=FILE, or model.weights=null)")
        if self.norm == "group" and self.sync_bn:
            raise ConfigError("'model.sync_bn' = true has no effect with 'model.norm' = group; set one of them")
        if self.ema_decay is None and (self.ema_every_steps != 1 or self.ema_warmup):
            key = "model.ema_every_steps" if self.ema_every_steps != 1 else "model.ema_warmup"
            raise ConfigError(f"'{key}' needs the weight EMA on: set model.ema_decay (e.g. 0.9998)")
