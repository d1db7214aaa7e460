"""The sections of training: `train` (the loop, precision, loss, mixing), `optim` (the optimizer, any timm
knows), `schedule` (the LR after the warmup) and `early_stop`.

The sections of the run directory: `checkpoint` (when last.pt is written) and `output` (where and what the run
writes besides it)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from imgcls.core.errors import ConfigError
from imgcls.core.settings import SEED_LIMIT, setting


@dataclass
class TrainConfig:
    epochs: int = setting(90, "training epochs", lo=1)
    batch_size: Union[int, Literal["auto"]] = setting(128, "per process; 'auto' finds the largest that fits and "
                                                           "keeps the effective batch")
    accum_steps: int = setting(1, "micro-batches per optimizer step; effective batch = batch_size x accum_steps x "
                                  "processes", lo=1)
    amp: Literal["none", "fp16", "bf16", "auto"] = setting(
        "auto", "none | fp16 (CUDA, GradScaler) | bf16 | auto (bf16 on CUDA and on CPUs with AMX, where it runs "
                "faster; else fp16 on CUDA, fp32 on the CPU)")
    label_smoothing: float = setting(0.0, "label smoothing: cross-entropy; multi-label bce/asl targets as timm "
                                          "(1 - s + s/C, s/C)", lo=0.0, hi=1.0)
    clip_grad_norm: Optional[float] = setting(None, "clip the global gradient norm to this (null: off); the norm is "
                                                    "logged either way", lo=0.0, lo_open=True)
    seed: int = setting(0, "one seed fixes order, augmentation and initialisation", lo=0, hi=SEED_LIMIT)
    channels_last: bool = setting(True, "NHWC memory format (faster convolutions; on the CPU not ResNet-18/34 at "
                                        "<= 32 px)")
    compile: bool = setting(False, "torch.compile the model (static shapes)", resume_free=True)
    device: str = setting("auto", "auto | cpu | cuda | cuda:N", resume_free=True)
    nonfinite: Literal["stop", "skip"] = setting("stop", "non-finite loss/gradients: stop (exit 1, keep the last "
                                                         "good checkpoint) | skip the step", resume_free=True)
    max_nonfinite_in_row: int = setting(10, "with skip (and fp16 overflow): stop after this many skipped steps in "
                                            "a row", lo=1, resume_free=True)
    memory_budget_gb: Optional[float] = setting(None, "batch-size finder on CPU: peak RSS the training process may "
                                                      "use (null: 80% of free RAM + its own)", lo=0.0, lo_open=True,
                                                resume_free=True)
    target_effective_batch: Optional[int] = setting(None, "with batch_size=auto: the effective batch kept via "
                                                          "accum_steps (null: optim.base_batch_size)", lo=1)
    threads: Union[int, Literal["auto", "idle_cores"]] = setting(
        "auto", "main-process CPU threads: auto (the usable cores, whatever the load: reproducible), idle_cores "
                "(less those busy at start), or N (a resume: the checkpoint's count, for a bitwise resume); "
                "OMP_NUM_THREADS wins over auto", lo=1, resume_free=True)
    reuse_host_memory: bool = setting(True, "training: glibc malloc keeps freed memory for the next step instead of "
                                            "mapping it afresh (no page faults per step); eval/infer/serve never",
                                      resume_free=True)
    val_interval: int = setting(1, "validate every N epochs, and always after the last; early stopping counts "
                                   "validations", lo=1, resume_free=True)
    mixup_alpha: float = setting(0.0, "mixup on the device: lambda ~ Beta(alpha, alpha) per micro-batch (0: off; "
                                      "e.g. 0.2)", lo=0.0)
    cutmix_alpha: float = setting(0.0, "CutMix on the device, lambda corrected to the pasted box's area (0: off; "
                                       "e.g. 1.0)", lo=0.0)
    mix_prob: float = setting(1.0, "share of micro-batches that are mixed", lo=0.0, hi=1.0)
    mix_switch_prob: float = setting(0.5, "with mixup and CutMix both on: the share of mixed micro-batches that use "
                                          "CutMix", lo=0.0, hi=1.0)
    mix_off_epoch: Optional[int] = setting(None, "mix during the first N epochs only (timm --mixup-off-epoch; null: "
                                                 "the whole run)", lo=1)
    loss: Literal["ce", "focal", "bce", "asl"] = setting(
        "ce", "ce (cross-entropy, soft targets when mixed) | focal (single-label: softmax focal loss, Lin et al. "
              "2017) | bce (binary cross-entropy on one-hot / mixed targets, ResNet strikes back; the multilabel "
              "default) | asl (multilabel: asymmetric loss, Ridnik et al. 2021)")
    focal_gamma: float = setting(2.0, "loss=focal: focusing exponent, (1 - p)^gamma per class of the (smoothed, mixed) "
                                      "target; 0 is cross-entropy", lo=0.0, hi=100.0)
    class_weights: Union[Literal["none", "balanced"], list[float]] = setting(
        "none", "single-label ce / focal: none | balanced (n_samples / (n_classes x count) from the training split's "
                "labels) | a list, one weight >= 0 per class in class order; the loss is the weighted sum / batch size")
    bce_target_thresh: Optional[float] = setting(None, "with loss=bce: targets above this count as 1, the rest 0 "
                                                       "(null: soft targets)", lo=0.0, hi=1.0)
    asl_gamma_neg: float = setting(4.0, "loss=asl: focusing exponent of the negatives (down-weights easy "
                                        "negatives)", lo=0.0, hi=100.0)
    asl_gamma_pos: float = setting(0.0, "loss=asl: focusing exponent of the positives", lo=0.0, hi=100.0)
    asl_clip: float = setting(0.05, "loss=asl: probability margin subtracted from negatives (those below it count "
                                    "not at all)", lo=0.0, hi=1.0)

    def check(self, cfg) -> None:
        if isinstance(self.batch_size, int) and self.batch_size < 1:
            raise ConfigError(f"'train.batch_size' = {self.batch_size} must be >= 1 or 'auto'")
        if self.bce_target_thresh is not None and self.loss != "bce":
            raise ConfigError(f"'train.bce_target_thresh' = {self.bce_target_thresh} applies to train.loss=bce only "
                              f"(train.loss is {self.loss}); set train.loss=bce or remove it")
        if self.focal_gamma != 2.0 and self.loss != "focal":
            raise ConfigError(f"'train.focal_gamma' = {self.focal_gamma} applies to train.loss=focal only "
                              f"(train.loss is {self.loss}); set train.loss=focal or remove it")
        self.check_class_weights()

    def check_class_weights(self) -> None:
        weights = self.class_weights
        if weights == "none":
            return
        if self.loss not in ("ce", "focal"):
            raise ConfigError(f"'train.class_weights' = {weights} applies to train.loss=ce or focal (train.loss is "
                              f"{self.loss}); set one of them or train.class_weights=none")
        if isinstance(weights, list):
            if not weights or any(not math.isfinite(w) or w < 0 for w in weights) or not any(weights):
                raise ConfigError(f"'train.class_weights' = {weights}: one finite weight >= 0 per class, not all 0 "
                                  f"(or none / balanced)")


# keyword arguments of the optimizer that optim.options may not carry: the groups set lr and weight_decay, the
# trainer chooses the kernels, and the options with keys of their own are set by those keys
NOT_OPTIONS = {"params": None, "lr": "optim.lr", "weight_decay": "optim.weight_decay", "fused": None,
               "foreach": None, "momentum": "optim.momentum", "nesterov": "optim.nesterov", "betas": "optim.betas",
               "eps": "optim.eps"}


@dataclass
class OptimConfig:
    name: str = setting("sgd", "any timm.optim optimizer (sgd, adamw, lamb, lars, lion, rmsprop, adan, ...: "
                               "timm.optim.list_optimizers()); an option it does not take, set, exits 2",
                       allowed="a name in timm.optim.list_optimizers() (checked before any work)")
    lr: float = setting(0.1, "peak learning rate at optim.base_batch_size", lo=0.0, hi=1e6, lo_open=True)
    lr_scaling: Literal["linear", "sqrt", "none"] = setting("linear", "linear | sqrt | none: how the peak LR follows "
                                                                      "the effective batch")
    base_batch_size: int = setting(256, "the effective batch optim.lr is meant for", lo=1)
    momentum: float = setting(0.9, "momentum, for the optimizers that take it (sgd, lars, rmsprop, ...)", lo=0.0,
                              hi=1.0)
    nesterov: bool = setting(True, "Nesterov momentum, for the optimizers that take it (sgd, lars, ...)")
    weight_decay: float = setting(5e-5, "on conv / linear weights only; never on biases and norm parameters", lo=0.0,
                                  hi=1.0)
    betas: list[float] = setting([0.9, 0.999], "betas, for the optimizers that take them (adamw, lamb, lion, ...; "
                                               "lion's paper uses [0.9, 0.99]; three numbers for adan)")
    eps: float = setting(1e-8, "epsilon, for the optimizers that take it (adamw, lamb, lars, rmsprop, ...; timm's "
                               "lamb default is 1e-6)", lo=0.0, hi=1.0, lo_open=True)
    options: dict[str, Any] = setting({}, "further keyword arguments of the optimizer, as timm's "
                                          "create_optimizer_v2 takes them (e.g. {trust_clip: true} for lamb, "
                                          "{alpha: 0.9} for rmsprop); an argument it does not take exits 2")
    layer_decay: Optional[float] = setting(None, "layer-wise LR decay (e.g. 0.75): each layer's LR is this times the "
                                                 "one above it, the classifier's 1 (timm models; null: off)",
                                           lo=0.0, hi=1.0, lo_open=True)
    head_lr_scale: float = setting(1.0, "the classifier's LR multiplier (e.g. 10 when fine-tuning a pretrained "
                                        "backbone)", lo=0.0, hi=1e6, lo_open=True)

    def check(self, cfg) -> None:
        """What can be said without timm: training/optim.py's check_optimizer checks the name and the options
        against the optimizer before any work."""
        if not self.name.strip():
            raise ConfigError("'optim.name' = '': name a timm.optim optimizer (sgd, adamw, lamb, ...)")
        if len(self.betas) not in (2, 3) or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"'optim.betas' = {self.betas} must be two numbers in [0, 1) (three for adan)")
        for key, value in self.options.items():
            if not key.isidentifier():
                raise ConfigError(f"'optim.options' = {self.options}: {key!r} is no keyword argument name")
            if key in NOT_OPTIONS:
                instead = f"set {NOT_OPTIONS[key]} instead" if NOT_OPTIONS[key] else "the trainer sets it"
                raise ConfigError(f"'optim.options.{key}' is not allowed: {instead}")


@dataclass
class ScheduleConfig:
    warmup_epochs: float = setting(5.0, "linear warmup length in epochs (fractional allowed), counted in optimizer "
                                        "steps", lo=0.0, hi=1e6)
    warmup_start_factor: float = setting(0.0, "warmup starts from this fraction of the peak LR", lo=0.0, hi=1.0)
    min_lr: float = setting(0.0, "cosine and poly decay to this LR at the last step; the floor of step, multistep, "
                                 "plateau", lo=0.0)
    name: Literal["cosine", "step", "multistep", "poly", "constant", "plateau"] = setting(
        "cosine", "after the warmup: cosine | step | multistep | poly | constant | plateau; per optimizer step")
    milestones: list[float] = setting([30.0, 60.0, 80.0], "multistep: epochs (from the run's start, fractions "
                                                          "allowed) at which the LR is multiplied by gamma")
    gamma: float = setting(0.1, "the factor of each step / multistep / plateau decay", lo=0.0, hi=1.0, lo_open=True)
    step_epochs: float = setting(30.0, "step: multiply the LR by gamma every this many epochs (fractions allowed)",
                                 lo=0.0, lo_open=True)
    power: float = setting(1.0, "poly: LR = peak x (1 - progress) ** power after the warmup", lo=0.0, lo_open=True)
    plateau_patience: int = setting(10, "plateau: decay after this many epochs without a better early_stop.metric "
                                        "(counted after the warmup)", lo=1)

    def check(self, cfg) -> None:
        if self.name == "multistep":
            m = self.milestones
            if not m or m[0] <= 0 or any(b <= a for a, b in zip(m, m[1:])):
                raise ConfigError(f"'schedule.milestones' = {m}: schedule.name=multistep needs a non-empty, "
                                  f"strictly increasing list of epochs > 0 (fractions allowed), e.g. [30, 60, 80]")
        patience = cfg.early_stop.patience
        if self.name == "plateau" and patience is not None and patience <= self.plateau_patience:
            raise ConfigError(f"'early_stop.patience' = {patience} with 'schedule.plateau_patience' = "
                              f"{self.plateau_patience}: early stopping would end the run before the plateau "
                              f"schedule ever lowers the LR; make early_stop.patience larger than "
                              f"schedule.plateau_patience")


@dataclass
class EarlyStopConfig:
    # a metric the task declares selectable (tasks/); checked by its Task
    metric: str = setting("top1", "top1 | top5 | loss | mean_class_acc | mAP (multilabel; its default): picks "
                                  "best.pt and drives early stopping", allowed="a metric data.task declares selectable")
    patience: Optional[int] = setting(None, "stop after this many validations without improvement (null: off)",
                                      lo=1, resume_free=True)
    min_delta: float = setting(0.0, "an improvement must beat the best by more than this", lo=0.0, resume_free=True)

@dataclass
class CheckpointConfig:
    every_steps: int = setting(0, "also save last.pt every N optimizer steps (0: only at epoch ends)", lo=0,
                               resume_free=True)


@dataclass
class OutputConfig:
    dir: str = setting("runs/default", "the run directory", resume_free=True)
    log_interval: int = setting(50, "optimizer steps between log lines / TensorBoard points (each epoch's last step "
                                    "always logs)", lo=1, resume_free=True)
    tensorboard: bool = setting(True, "write TensorBoard event files under <dir>/tensorboard", resume_free=True)
    progress_bar: Union[bool, Literal["auto"]] = setting("auto", "auto (a tqdm bar when stderr is a terminal) | true "
                                                                 "| false", resume_free=True)
    overwrite: bool = setting(False, "a new run in a dir holding another run's checkpoints: false exits 2; true "
                                     "deletes that run's files first", resume_free=True)
    curves: bool = setting(True, "write curves.png (loss, LR, validation metrics per epoch, from metrics.csv) at "
                                 "epoch ends (under 2% of the run's time) and the run's end", resume_free=True)
