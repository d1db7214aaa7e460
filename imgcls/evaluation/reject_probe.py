"""How well a fitted reject option rejects, estimated at fit time on generated far-off images: uniform noise,
flat colours, dark strokes on paper, and blocky grey patterns (an 8x8 image upscaled, like a small grey digit).
None of them is a training image of any task; a reject option that keeps many of them will keep real foreign
images too. A briefly trained model's stages have learnt less (docs/advice.md: a 3-epoch photos model
rejected 51.6% of digit images, 10-epoch ones 93-94%; the input view now rejects the digits, not every line
sketch), so the figure is measured for every fit and said in the log, eval.py and infer.py when it is weak
(WEAK_REJECTION).

The images are made with the model's input size and channels, as the eval loader would give them (uint8,
channels first), so the rejector scores them through the model exactly as it scores a user's image.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

PROBE_KINDS = ("noise", "flat colours", "strokes", "grey blocks")
# 12 a kind, all four kinds in one batch: the probe is one forward over 48 images after training (~0.4 s of
# resnet18 at 128 px on two cores, a fifth of the photos recipe's tail), a share rejected known to 1/12 per kind
# and 1/48 on the mean that the warning reads
PROBE_PER_KIND = 12
# below this share of the far-off images rejected (the mean over the kinds), the reject option is called weak.
# Measured with the input view in mahalanobis_layers (docs/advice.md): the 3-epoch photos-like models 86.5% and
# 86.5% (they reject 99-100% of real digit images but 23% of line sketches), the 10-epoch ones 96.9% and 96.9%
# (digits 100%, sketches 93-99%); before it, 44% and 91%. One kind alone may stay lower (flat colours 58-75%
# at 3 epochs).
WEAK_REJECTION = 90.0


def _strokes(rng: np.random.Generator, size: int) -> np.ndarray:
    from PIL import Image, ImageDraw

    paper = int(rng.integers(215, 256))
    image = Image.new("L", (size, size), paper)
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(3, 8))):
        points = [tuple(int(v) for v in rng.integers(0, size, size=2)) for _ in range(3)]
        draw.line(points, fill=int(rng.integers(0, 60)), width=max(1, int(rng.integers(1, 3)) * size // 32))
    return np.asarray(image)


def far_off_image(kind: str, rng: np.random.Generator, size: int, channels: int) -> np.ndarray:
    """One generated image of `kind` (PROBE_KINDS), uint8 [channels, size, size]."""
    if kind == "noise":
        return rng.integers(0, 256, size=(channels, size, size), dtype=np.uint8)
    if kind == "flat colours":
        colour = rng.integers(0, 256, size=(channels, 1, 1))
        return np.broadcast_to(colour, (channels, size, size)).astype(np.uint8)
    if kind == "strokes":
        return np.repeat(_strokes(rng, size)[None], channels, axis=0)
    if kind == "grey blocks":
        small = rng.integers(0, 17, size=(8, 8)) * 15                 # 17 grey levels, as the digits have
        block = np.kron(small, np.ones((size // 8 + 1, size // 8 + 1)))[:size, :size]
        return np.repeat(block[None].astype(np.uint8), channels, axis=0)
    raise ValueError(f"unknown far-off kind {kind!r}; one of {PROBE_KINDS}")


def probe_batches(size: int, channels: int, seed: int, per_kind: int = PROBE_PER_KIND) -> list[tuple]:
    """One loader batch per kind, as `collect_outputs` takes them: (uint8 images, targets, valid, indices)."""
    batches = []
    for k, kind in enumerate(PROBE_KINDS):
        rng = np.random.default_rng([seed, k])
        images = torch.from_numpy(np.stack([far_off_image(kind, rng, size, channels) for _ in range(per_kind)]))
        batches.append((images, torch.zeros(per_kind, dtype=torch.long), torch.ones(per_kind, dtype=torch.bool),
                        torch.arange(per_kind)))
    return batches


def rejection_rates(scores_by_kind: dict[str, torch.Tensor], threshold: float) -> dict[str, float]:
    """kind -> percent of its images whose score falls below `threshold` (rejected)."""
    return {kind: round(100.0 * float((s < threshold).double().mean()), 1) for kind, s in scores_by_kind.items()}


def weak_note(rates: dict[str, float], method: str, limit: float = WEAK_REJECTION) -> Optional[str]:
    """A sentence for the log and eval.py when the mean share rejected over the kinds is under `limit`
    percent; else None."""
    if not rates:
        return None
    mean = sum(rates.values()) / len(rates)
    if mean >= limit:
        return None
    said = ", ".join(f"{kind} {rate:.0f}%" for kind, rate in rates.items())
    return (f"the reject option ({method}) is weak: it rejects only {mean:.0f}% of generated far-off images "
            f"(under {limit:.0f}%: {said}); a briefly trained model's features separate less: train longer "
            f"before relying on --reject, or set --reject-below higher")


def probe_rejector(model: torch.nn.Module, device_input, rejector, size: int, channels: int,
                   seed: int) -> dict[str, float]:
    """The share of each far-off kind that `rejector` (with its threshold) rejects through `model`."""
    from imgcls.evaluation.split_outputs import collect_outputs

    batches = probe_batches(size, channels, seed)
    joined = tuple(torch.cat(parts) for parts in zip(*batches))
    out = collect_outputs(model, [joined], device_input, with_features=rejector.needs_features,
                          with_layers=rejector.needs_layers, layers=rejector.layer_names or None)
    scores = rejector.scores(out.logits, out.features, out.layers)
    counts = np.cumsum([0, *(len(batch[0]) for batch in batches)])
    return rejection_rates({kind: scores[counts[k]:counts[k + 1]] for k, kind in enumerate(PROBE_KINDS)},
                           rejector.threshold)
