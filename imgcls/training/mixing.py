"""Random erasing, mixup and CutMix on the batch on the training device, per micro-batch (each micro-batch
of an accumulation window mixes within itself).

Exactness: timm's `Mixup` draws from numpy's global RNG, which a restart does not restore, so a resumed
run would mix differently from the uninterrupted one. Here every draw comes from a `torch.Generator` made
afresh for each micro-batch and seeded by (train.seed, optimizer step, micro-batch in the window, rank),
never from state a restart loses: a killed and resumed run draws exactly what the uninterrupted run drew.
The mixing decision, lambda and CutMix box are host numbers drawn before the batch is touched; the
erasing boxes are drawn on the batch's device. Nothing reads a device value back: no host sync.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from imgcls.data.samplers import mix_seed

ERASE_SCALE = (0.02, 0.33)   # torchvision RandomErasing defaults: area fraction, aspect ratio, attempts
ERASE_RATIO = (0.3, 3.3)
ERASE_ATTEMPTS = 10
_ERASE_STREAM, _MIX_STREAM = 0xE5A5E, 0x313C


@dataclass
class MixDraw:
    """What one micro-batch gets: `mode` None (not mixed), 'mixup' or 'cutmix'; the weight `lam` of each
    image's own label; the CutMix box (top, bottom, left, right), pasted from the batch rolled by one."""

    mode: Optional[str] = None
    lam: float = 1.0
    box: tuple = (0, 0, 0, 0)


def beta_sample(alpha: float, generator: torch.Generator) -> float:
    """Beta(alpha, alpha) as X / (X + Y) of two Gamma(alpha) draws from `generator`."""
    x, y = torch._standard_gamma(torch.full((2,), alpha, dtype=torch.float64), generator=generator).tolist()
    return x / (x + y) if x + y > 0 else 1.0


def cutmix_box(lam: float, height: int, width: int, generator: torch.Generator) -> tuple[tuple, float]:
    """A box of about (1 - lam) of the image around a uniform centre, clipped to the image, and lambda
    corrected to the area actually pasted (timm's rand_bbox and correct_lam)."""
    cut = math.sqrt(1.0 - lam)
    cut_h, cut_w = int(height * cut), int(width * cut)
    cy = int(torch.randint(0, height, (), generator=generator))
    cx = int(torch.randint(0, width, (), generator=generator))
    top, bottom = max(cy - cut_h // 2, 0), min(cy + cut_h // 2, height)
    left, right = max(cx - cut_w // 2, 0), min(cx + cut_w // 2, width)
    return (top, bottom, left, right), 1.0 - (bottom - top) * (right - left) / (height * width)


def draw_mix(generator: torch.Generator, mixup_alpha: float, cutmix_alpha: float, mix_prob: float,
             switch_prob: float, height: int, width: int) -> MixDraw:
    """One micro-batch's mixing: mixed with `mix_prob`; with both alphas on, CutMix with `switch_prob`."""
    u_mix, u_switch = torch.rand(2, generator=generator, dtype=torch.float64).tolist()
    if u_mix >= mix_prob or (mixup_alpha <= 0 and cutmix_alpha <= 0):
        return MixDraw()
    use_cutmix = cutmix_alpha > 0 and (mixup_alpha <= 0 or u_switch < switch_prob)
    if not use_cutmix:
        return MixDraw("mixup", beta_sample(mixup_alpha, generator))
    box, lam = cutmix_box(beta_sample(cutmix_alpha, generator), height, width, generator)
    return MixDraw("cutmix", lam, box)


def apply_mix(images: torch.Tensor, labels: torch.Tensor, draw: MixDraw, num_classes: int):
    """Mix `images` (in place) with the batch rolled by one; soft targets lam * own + (1 - lam) * partner's."""
    partner = images.roll(1, 0)
    if draw.mode == "mixup":
        images.mul_(draw.lam).add_(partner, alpha=1.0 - draw.lam)
    else:
        top, bottom, left, right = draw.box
        images[:, :, top:bottom, left:right] = partner[:, :, top:bottom, left:right]
    # multi-label targets arrive as float multi-hot vectors: mixing mixes the vectors
    own = labels if labels.is_floating_point() else torch.nn.functional.one_hot(labels, num_classes).float()
    return images, torch.lerp(own.roll(1, 0), own, draw.lam)


def erase_boxes(batch: int, height: int, width: int, prob: float, generator: torch.Generator) -> torch.Tensor:
    """(batch, 4) int64 [top, left, h, w] per image, torchvision RandomErasing's draw: with `prob`, the first
    of 10 attempts (area 2-33%, log-uniform aspect 0.3-3.3) that fits; h = w = 0 where none is erased."""
    device = generator.device
    apply = torch.rand(batch, generator=generator, device=device) < prob
    area = height * width * (ERASE_SCALE[0] + (ERASE_SCALE[1] - ERASE_SCALE[0]) *
                             torch.rand(batch, ERASE_ATTEMPTS, generator=generator, device=device))
    log_lo, log_hi = math.log(ERASE_RATIO[0]), math.log(ERASE_RATIO[1])
    aspect = torch.exp(log_lo + (log_hi - log_lo) * torch.rand(batch, ERASE_ATTEMPTS, generator=generator,
                                                                 device=device))
    h, w = torch.round(torch.sqrt(area * aspect)).long(), torch.round(torch.sqrt(area / aspect)).long()
    fits = (h < height) & (w < width)
    first = fits.int().argmax(1, keepdim=True)   # the first attempt that fits (0 when none does)
    h, w = h.gather(1, first).squeeze(1), w.gather(1, first).squeeze(1)
    keep = apply & fits.any(1)
    h, w = torch.where(keep, h, 0), torch.where(keep, w, 0)
    u = torch.rand(batch, 2, generator=generator, device=device)
    top = (u[:, 0] * (height - h + 1)).long()
    left = (u[:, 1] * (width - w + 1)).long()
    return torch.stack([top, left, h, w], 1)


def erase(images: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """Set each image's box to 0 (the normalised mean) in place; boxes from `erase_boxes`."""
    _, _, height, width = images.shape
    top, left, h, w = (boxes[:, i, None] for i in range(4))
    rows = torch.arange(height, device=images.device)
    cols = torch.arange(width, device=images.device)
    in_rows = (rows >= top) & (rows < top + h)
    in_cols = (cols >= left) & (cols < left + w)
    return images.masked_fill_((in_rows[:, :, None] & in_cols[:, None, :])[:, None], 0.0)


@dataclass
class BatchMixing:
    """`data.random_erasing`, then mixup / CutMix (`train.*`), for one micro-batch on the device."""

    num_classes: int
    seed: int
    rank: int = 0
    erase_prob: float = 0.0
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    mix_prob: float = 1.0
    switch_prob: float = 0.5
    off_epoch: Optional[int] = None   # no mixing from this epoch (0-based) on: mixed for the first N epochs

    @classmethod
    def from_config(cls, cfg, num_classes: int, rank: int = 0) -> Optional["BatchMixing"]:
        """None when erasing and mixing are both off."""
        t = cfg.train
        if cfg.data.random_erasing <= 0 and t.mixup_alpha <= 0 and t.cutmix_alpha <= 0:
            return None
        return cls(num_classes, t.seed, rank, cfg.data.random_erasing, t.mixup_alpha, t.cutmix_alpha, t.mix_prob,
                   t.mix_switch_prob, t.mix_off_epoch)

    @property
    def mixes(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0

    def generator(self, stream: int, step: int, micro: int, device: torch.device) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(mix_seed(self.seed, step, micro, self.rank, stream))

    def draw(self, epoch: int, step: int, micro: int, height: int, width: int) -> MixDraw:
        if self.off_epoch is not None and epoch >= self.off_epoch:
            return MixDraw()
        return draw_mix(self.generator(_MIX_STREAM, step, micro, torch.device("cpu")), self.mixup_alpha,
                        self.cutmix_alpha, self.mix_prob, self.switch_prob, height, width)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor, epoch: int, step: int, micro: int):
        """(images, targets) of optimizer step `step`'s micro-batch `micro`: int labels when not mixed,
        (batch, classes) float targets when mixed."""
        batch, _, height, width = images.shape
        if self.erase_prob > 0:
            generator = self.generator(_ERASE_STREAM, step, micro, images.device)
            images = erase(images, erase_boxes(batch, height, width, self.erase_prob, generator))
        draw = self.draw(epoch, step, micro, height, width)
        if draw.mode is None:
            return images, labels
        return apply_mix(images, labels, draw, self.num_classes)
