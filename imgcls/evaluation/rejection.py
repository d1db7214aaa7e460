"""The reject option: a score per image that is high for images like the training data and low for
others, and the threshold below which an image is labelled `unknown`. Pure functions of logits and
penultimate features, so infer.py, eval.py and a server share them.

Scores (higher: more in-distribution):
- msp: the largest (calibrated) softmax probability (the baseline);
- energy: logsumexp of the logits (Liu et al., 2020), computable from any export's output;
- knn: minus the distance from the L2-normalised penultimate feature to its k-th nearest neighbour in a
  bank of normalised training features (Sun et al., 2022);
- mahalanobis: minus the smallest Mahalanobis distance to a class mean under the shared covariance of
  the training features (Lee et al., 2018);
- mahalanobis_l2: the same on L2-normalised features (the feature norm of a foreign image can be small,
  which puts it near the class means before normalisation);
- combined: the lowest of the COMBINED_OF scores, each standardised by its spread on the validation split
  (`score_scale`): an image is as foreign as its most foreign-looking score says (the default of
  checkpoints calibrated before mahalanobis_layers);
- mahalanobis_layers: multi-layer feature Mahalanobis (Lee et al., 2018): each stage's output pooled to its
  per-channel mean and standard deviation (`pooled_statistics`), L2-normalised, scored like mahalanobis_l2
  against that stage's own fit, standardised on the validation split, and averaged over the stages: the
  early stages see colour, texture and smoothness, which tell an upscaled 8x8 grey digit from a photo when
  the penultimate features do not. A stage-0 view, `input` (`input_statistics`: the network input's
  per-channel mean and spread, its colour spread and high-frequency energy), is scored the same way (not
  normalised) and weighs INPUT_WEIGHT of the mean: the head cannot spoil it, so a briefly trained model
  rejects grey digits too (docs/advice.md).
The threshold is the score that keeps `coverage` of the validation split. Checkpoints reject by
mahalanobis_layers (docs/advice.md: the measurements that chose it, python -m imgcls.benchmarking.reject_matrix);
exports by energy, computed from the logits that are their only output.

Every sample's logits (and penultimate features, and the stages' pooled statistics) over a labelled split,
kept rather than summed: what the temperature fit, the reject threshold and the feature bank need. Under
DDP each rank passes over its own shard (no padding) and the results are gathered by sample index, so every
sample counts once.

How well a fitted reject option rejects, estimated at fit time on generated far-off images: uniform noise,
flat colours, dark strokes on paper, and blocky grey patterns (an 8x8 image upscaled, like a small grey digit).
None of them is a training image of any task; a reject option that keeps many of them will keep real foreign
images too. A briefly trained model's stages have learnt less (docs/advice.md: a 3-epoch photos model
rejected 51.6% of digit images, 10-epoch ones 93-94%; the input view now rejects the digits, not every line
sketch), so the figure is measured for every fit and said in the log, eval.py and infer.py when it is weak
(WEAK_REJECTION).

The images are made with the model's input size and channels, as the eval loader would give them (uint8,
channels first), so the rejector scores them through the model exactly as it scores a user's image."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from imgcls.compute.device import DeviceInput
from imgcls.models.feature_tap import FeatureTap

METHODS = ("msp", "energy", "knn", "mahalanobis", "mahalanobis_l2", "combined", "mahalanobis_layers")


FEATURE_METHODS = ("knn", "mahalanobis", "mahalanobis_l2", "combined", "mahalanobis_layers")


LAYERS_METHOD = "mahalanobis_layers"


# the scores `combined` takes the lowest of (standardised): chosen by measurement (docs/advice.md)
COMBINED_OF = ("mahalanobis_l2", "energy")


# the method the checkpoint's reject option uses: chosen by measurement (docs/advice.md, python -m
# benchmarking.reject_matrix)
DEFAULT_METHOD = LAYERS_METHOD


# what an exported model's reject option uses: its output is the logits only
LOGITS_METHOD = "energy"


KNN_K = 1


BANK_SIZE = 2048   # training features used (and kept in the checkpoint, fp16: 2048 x 512 is 2 MB)


MAX_LAYERS = 5         # stages the multi-layer score pools (a ViT's 12 blocks: 5 of them, evenly spread)


LAYER_CHANNELS = 128   # channels per stage after group averaging: a stage's fit is at most 256 x 256 (256 KB)


INPUT_STAGE = "input"  # the stage-0 view: statistics of the network input itself (a forward pre-hook)


# the input view's share of mahalanobis_layers (the stages share the rest equally): chosen by measurement with
# python -m imgcls.benchmarking.reject_matrix, 3 and 10 epochs (docs/advice.md); records without `layer_weights` (no
# input view) weigh their stages equally
INPUT_WEIGHT = 0.5


def layer_names(model: torch.nn.Module, most: int = MAX_LAYERS) -> list[str]:
    """What the multi-layer score pools: the input (INPUT_STAGE) and a timm model's stages (`feature_info`),
    at most `most` of them spread evenly from the first to the last; [] for a model without them."""
    stages = stage_names(model, most)
    return [INPUT_STAGE, *stages] if stages else []


def layer_weights(names: list[str]) -> Optional[list[float]]:
    """Each view's weight in mahalanobis_layers: INPUT_WEIGHT for the input, the rest shared by the stages;
    None (equal weights) without an input view."""
    if INPUT_STAGE not in names or len(names) < 2:
        return None
    return [INPUT_WEIGHT if name == INPUT_STAGE else (1 - INPUT_WEIGHT) / (len(names) - 1) for name in names]


def stage_names(model: torch.nn.Module, most: int = MAX_LAYERS) -> list[str]:
    """A timm model's stages (`feature_info`), at most `most` of them spread evenly; [] without them."""
    info = getattr(model, "feature_info", None)
    try:
        stages = [(entry["module"], int(entry["num_chs"])) for entry in info] if info else []
    except (TypeError, KeyError):
        return []
    if len(stages) > most:
        stages = [stages[round(i * (len(stages) - 1) / max(most - 1, 1))] for i in range(most)]
    return [name for name, _ in stages]


def has_modules(model: torch.nn.Module, names: list[str]) -> bool:
    """Whether `model` (or the model a compiled one wraps) has a submodule of every one of `names` (at least one)."""
    model = getattr(model, "_orig_mod", model)
    try:
        return bool(names) and all(name == INPUT_STAGE or model.get_submodule(name) is not None for name in names)
    except AttributeError:
        return False


# Rows of a batch are reduced this many values at a time: a whole batch's temporaries (a stage of 32 x 64 x 64 x 64
# is 32 MB) are fresh pages for every operation (4-14 ms for that stage against 2-4.5 ms in 1 MB pieces, the same
# values bitwise: every statistic is a function of its own row).
ROW_CHUNK_VALUES = 1 << 18


def by_rows(statistics, x: torch.Tensor, values: int = ROW_CHUNK_VALUES) -> torch.Tensor:
    """`statistics` (a per-row function of [N, ...] -> [N, D]) of `x`, applied to as many rows at a time as hold
    at most `values` values (at least one row)."""
    rows = max(1, values // max(1, x[0].numel())) if x.shape[0] else 1
    if rows >= x.shape[0]:
        return statistics(x)
    return torch.cat([statistics(x[i:i + rows]) for i in range(0, x.shape[0], rows)])


def pooled_statistics(activation: torch.Tensor, channels: int = LAYER_CHANNELS) -> torch.Tensor:
    """[N, 2G] per-channel mean and standard deviation over the positions of a stage's output [N, C, ...]
    (channels first: LayerTap moves a channels-last one), the C channels averaged into at most `channels`
    groups G first (which bounds the stage's fit). The standard deviation keeps the low-level statistics
    (colour, texture, smoothness) that a global average alone loses. A row's values do not depend on the rows
    beside it."""
    return by_rows(lambda rows: _pooled_statistics(rows, channels), activation.detach())


def _pooled_statistics(activation: torch.Tensor, channels: int) -> torch.Tensor:
    x = activation.float()
    x = x.flatten(2) if x.dim() > 2 else x[:, :, None]                    # [N, C, P]
    if x.shape[1] > channels:
        x = torch.nn.functional.adaptive_avg_pool1d(x.transpose(1, 2), channels).transpose(1, 2)
    mean = x.mean(dim=2)
    # from the mean square (one pass, fp32; activations of a normalised network have no mean so large against
    # their spread that this loses digits): torch's std over the last dimension took 7-10x as long, a third
    # of the calibration's time for resnet10t at 32 px
    std = ((x * x).mean(dim=2) - mean * mean).clamp_min(0).sqrt()
    return torch.cat([mean, std], dim=1)


def position_mean(x: torch.Tensor) -> torch.Tensor:
    """[N, C] mean over the positions of [N, C, H, W]; 0 where there are none (an input too small for the
    difference taken)."""
    if x.shape[2] * x.shape[3] == 0:
        return x.new_zeros(x.shape[:2])
    return x.mean(dim=(2, 3))


def channel_spread(x: torch.Tensor) -> torch.Tensor:
    """[N, 1, ...] the standard deviation across the channels of [N, C, ...] (C > 1; Bessel's correction, as
    torch.std's), from the deviations from the channel mean, a channel at a time: torch's std over dimension 1
    took 22x as long (48 images of 3 x 128 x 128: 144 ms against 6.4 ms; equal to 2e-7 relative), a mean over
    dimension 1 3x as long as this loop for 3 channels."""
    channels = x.unbind(1)
    mean = sum(channels[1:], channels[0]) / len(channels)
    squares = [(channel - mean) ** 2 for channel in channels]
    return (sum(squares[1:], squares[0]) / (len(channels) - 1)).sqrt().unsqueeze(1)


def input_statistics(images: torch.Tensor) -> torch.Tensor:
    """[N, 5C + 2] (C > 1) or [N, 5] statistics of the network input [N, C, H, W] (normalised, any memory
    layout: the same values): each channel's mean and standard deviation, the mean and standard deviation over
    the positions of the spread across channels (colour: 0 for a grey image), and each channel's mean absolute
    horizontal, vertical and Laplacian difference (high frequencies: an upscaled 8x8 image has few). What the
    first stage of any model sees, whatever its head has learnt."""
    x = images.detach()
    if x.dim() != 4:
        return x.float().flatten(1)[:, :0]
    return by_rows(_input_statistics, x)


def _input_statistics(images: torch.Tensor) -> torch.Tensor:
    # packed channels-first: the shifted differences below took 1.7x as long on a channels-last batch
    x = images.float().contiguous()
    parts = [_pooled_statistics(x, channels=x.shape[1])]     # [N, 2C]: each channel's mean, then deviation
    if x.shape[1] > 1:
        parts.append(_pooled_statistics(channel_spread(x), LAYER_CHANNELS))   # the colour spread's mean, deviation
    dx = position_mean((x[:, :, :, 1:] - x[:, :, :, :-1]).abs())
    dy = position_mean((x[:, :, 1:, :] - x[:, :, :-1, :]).abs())
    laplacian = position_mean((4 * x[:, :, 1:-1, 1:-1] - x[:, :, :-2, 1:-1] - x[:, :, 2:, 1:-1] - x[:, :, 1:-1, :-2]
                               - x[:, :, 1:-1, 2:]).abs())
    return torch.cat([*parts, dx, dy, laplacian], dim=1)


class LayerTap:
    """Records `pooled_statistics` of the named modules' outputs on every forward (the first forward since the
    last take, like FeatureTap), and `input_statistics` of the model's input for INPUT_STAGE. `available` is
    False when a name is missing from the model. A channels-last output (timm's NHWC stages, a ViT's tokens)
    is put channels-first by the stage's `num_chs`."""

    def __init__(self, model: torch.nn.Module, names: list[str]):
        self.names = list(names)
        self.layers: dict[str, torch.Tensor] = {}
        self._handles = []
        model = getattr(model, "_orig_mod", model)  # a compiled model's stages are its original's
        channels = {e["module"]: int(e["num_chs"]) for e in (getattr(model, "feature_info", None) or [])
                    if isinstance(e, dict) and "module" in e}
        self.available = has_modules(model, self.names)
        if self.available:
            for name in self.names:
                if name == INPUT_STAGE:
                    self._handles.append(model.register_forward_pre_hook(self._input_recorder()))
                    continue
                module = model.get_submodule(name)
                self._handles.append(module.register_forward_hook(self._recorder(name, channels.get(name))))

    def _recorder(self, name: str, num_chs: Optional[int]):
        def record(module, inputs, output) -> None:
            if name in self.layers:
                return
            x = output[0] if isinstance(output, (tuple, list)) else output
            if num_chs is not None and x.dim() > 2 and x.shape[1] != num_chs and x.shape[-1] == num_chs:
                x = x.movedim(-1, 1)
            self.layers[name] = pooled_statistics(x)
        return record

    def _input_recorder(self):
        def record(module, inputs) -> None:
            if INPUT_STAGE not in self.layers and inputs and torch.is_tensor(inputs[0]):
                self.layers[INPUT_STAGE] = input_statistics(inputs[0])
        return record

    def take(self) -> Optional[list[torch.Tensor]]:
        """The pooled statistics of the last forward, one [N, D_l] per name (then forgotten); None when a
        named module did not run (a model traced into one graph by BatchNorm folding)."""
        layers, self.layers = self.layers, {}
        if not self.available or any(name not in layers for name in self.names):
            return None
        return [layers[name] for name in self.names]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


TIE = 1e-6  # scores closer than this (relative, at least absolute) are one score


def threshold_for_coverage(scores: torch.Tensor, coverage: float) -> float:
    """A threshold t such that at least `coverage` of `scores` are >= t: midway between the lowest score
    kept and the next one down, so rounding differences between passes (batch size, memory layout) do not
    move a sample across it."""
    if len(scores) == 0:
        return -math.inf
    ordered = scores.double().sort(descending=True).values
    keep = min(len(ordered), max(1, math.ceil(coverage * len(ordered) - 1e-9)))
    # scores equal up to rounding (copies of one image) are kept or rejected together: a threshold between
    # them would fall differently in another pass
    gaps = ordered[keep - 1:-1] - ordered[keep:]
    apart = (gaps > TIE * ordered[keep:].abs().clamp(min=1.0)).nonzero()
    keep = keep + int(apart[0]) if len(apart) else len(ordered)
    if keep == len(ordered):
        lowest = float(ordered[-1])
        return lowest - max(1e-6, 1e-3 * abs(lowest))
    return float((ordered[keep - 1] + ordered[keep]) / 2)


def msp_score(logits: torch.Tensor, temperature: Optional[float] = None) -> torch.Tensor:
    scaled = logits.float() / (temperature or 1.0)
    return scaled.softmax(dim=1).max(dim=1).values


def energy_score(logits: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(logits.float(), dim=1)


def normalise(features: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(features.float(), dim=1)


def knn_score(features: torch.Tensor, bank: torch.Tensor, k: int = KNN_K) -> torch.Tensor:
    """Minus the Euclidean distance between normalised vectors to the k-th nearest bank vector."""
    similarity = normalise(features) @ normalise(bank).T
    kth = similarity.topk(min(k, bank.shape[0]), dim=1).values[:, -1]
    return -(2.0 - 2.0 * kth).clamp(min=0).sqrt()


# Features whose variance around their class means is below this share of their mean square are constant up
# to float rounding (constant-colour images): their covariance is rounding noise, and its inverse (1e15) would
# make the scores of the same image differ between passes (a batch of 1 or 8) by whole units
DEGENERATE_VARIANCE = 1e-8


def variance_share(features: torch.Tensor, labels: torch.Tensor, num_classes: int) -> float:
    """The features' total variance around their class means over their mean square (0 when all are zero)."""
    x = features.double()
    return centred_share(x, x - class_means(x, labels, num_classes)[labels])


def class_means(x: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """[C, D] the mean of each class's rows of `x` [N, D] (0 for a class without any)."""
    means = torch.zeros(num_classes, x.shape[1], dtype=x.dtype).index_add_(0, labels, x)
    return means / torch.bincount(labels, minlength=num_classes).clamp(min=1).to(x.dtype)[:, None]


def centred_share(x: torch.Tensor, centred: torch.Tensor) -> float:
    """variance_share from the rows `x` and the same rows less their class means."""
    if not len(x):
        return 0.0
    mean_square = float((x * x).sum(dim=1).mean())
    return float((centred * centred).sum(dim=1).mean()) / mean_square if mean_square > 0 else 0.0


def mahalanobis_fit(features: torch.Tensor, labels: torch.Tensor, num_classes: int,
                    shrinkage: str = "ridge") -> tuple[torch.Tensor, torch.Tensor]:
    """Class means [C, D] and the precision matrix [D, D] of the shared (tied) covariance, in float64, shrunk
    towards a scaled identity: by a small ridge (it inverts when features outnumber samples; the fit on up to
    2,048 training images), or by Ledoit-Wolf's estimate (`shrinkage="ledoit_wolf"`: the fit on a few hundred
    validation images, where a ridge overfits); wholly when the fit is degenerate (`variance_share` under
    DEGENERATE_VARIANCE): then the distance is the Euclidean one in units of the features' mean square per
    dimension, which rounding cannot blow up."""
    x = features.double()
    means = class_means(x, labels, num_classes)
    centred = x - means[labels]
    covariance = centred.T @ centred / max(len(x), 1)
    eye = torch.eye(x.shape[1], dtype=torch.float64)
    if centred_share(x, centred) < DEGENERATE_VARIANCE:
        scale = (x * x).sum(dim=1).mean().clamp(min=1e-12) / x.shape[1] if len(x) else torch.tensor(1.0)
        return means.float(), (eye / scale).float()
    if shrinkage == "ledoit_wolf":
        weight, target = ledoit_wolf_shrinkage(centred, covariance)
        covariance = (1 - weight) * covariance + weight * target * eye
    else:
        covariance = covariance + 1e-3 * covariance.diagonal().mean().clamp(min=1e-12) * eye
    return means.float(), torch.linalg.inv(covariance).float()


def ledoit_wolf_shrinkage(centred: torch.Tensor, covariance: Optional[torch.Tensor] = None) -> tuple[float, float]:
    """(weight, mu): Ledoit and Wolf's (2004) closed-form shrinkage of the covariance of the centred samples
    [N, D] (`covariance`, their x.T @ x / N, when the caller has it) towards mu x identity, mu the mean variance
    (scikit-learn's `ledoit_wolf` with assume_centered=True: the same numbers)."""
    x = centred.double()
    n, d = x.shape
    if n == 0 or d == 0:
        return 1.0, 1.0
    covariance = x.T @ x / n if covariance is None else covariance.double()
    mu = float(covariance.diagonal().mean())
    delta = float(((covariance - mu * torch.eye(d, dtype=torch.float64)) ** 2).sum()) / d
    squares = x * x
    beta = float((squares.T @ squares).sum() / n - (covariance ** 2).sum()) / (d * n)
    beta = min(beta, delta)
    return (0.0 if beta == 0 else beta / delta), max(mu, 1e-12)


def mahalanobis_score(features: torch.Tensor, means: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    diff = features.double()[:, None, :] - means.double()[None]               # [N, C, D]
    distance = torch.einsum("ncd,de,nce->nc", diff, precision.double(), diff)
    return -distance.min(dim=1).values.float()


# The least spread a score is standardised by: below it the spread is float rounding (identical images), which
# standardising would blow up to whole units. Mahalanobis distances are in whitened units (an in-distribution
# spread is about sqrt(2 x dimensions)); energy in nats.
MIN_SPREAD = {"mahalanobis": 1e-3, "energy": 1e-4}


def score_scale(scores: torch.Tensor, least: float = 1e-12) -> tuple[float, float]:
    """(centre, spread) of a score on the validation split: its median, and the distance from the median down
    to the 5th percentile (the side rejection looks at), so scores of different units compare; a spread
    below `least` (MIN_SPREAD) is taken as 1."""
    values = scores.double()
    centre = float(values.median())
    spread = centre - float(values.quantile(0.05))
    return centre, spread if spread > least else 1.0


def combined_score(parts: list[torch.Tensor], scales: list[tuple[float, float]]) -> torch.Tensor:
    """The lowest of the standardised scores (score - centre) / spread: the most foreign-looking view wins."""
    return torch.stack([standardised(p, s) for p, s in zip(parts, scales)]).min(dim=0).values.float()


def layer_view(x: torch.Tensor, name: Optional[str]) -> torch.Tensor:
    """What a stage's fit sees: its pooled statistics L2-normalised; the input's statistics as they are (their
    scale is what tells a flat grey image from a photo)."""
    return x.float() if name == INPUT_STAGE else normalise(x)


def layer_fits(layers: list[torch.Tensor], labels: torch.Tensor, num_classes: int,
               names: Optional[list[str]] = None, shrinkage: str = "ridge") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One `mahalanobis_fit` per stage (`layer_view`: `names` says which is the input)."""
    names = names or [None] * len(layers)
    return [mahalanobis_fit(layer_view(x, name), labels, num_classes, shrinkage) for x, name in zip(layers, names)]


def layer_scores(layers: list[torch.Tensor], fits: list, names: Optional[list[str]] = None) -> list[torch.Tensor]:
    """Each stage's Mahalanobis score (minus the distance to the nearest class mean) under its own fit."""
    names = names or [None] * len(layers)
    return [mahalanobis_score(layer_view(x, name), means.to(x.device), precision.to(x.device))
            for x, name, (means, precision) in zip(layers, names, fits)]


def standardised(score: torch.Tensor, scale: tuple[float, float]) -> torch.Tensor:
    centre, spread = scale
    return (score.double() - centre) / spread


def multilayer_score(per_layer: list[torch.Tensor], scales: list[tuple[float, float]],
                     weights: Optional[list[float]] = None) -> torch.Tensor:
    """mahalanobis_layers: the weighted mean (`layer_weights`; None: the plain mean) of the stages' scores, each
    standardised by its validation spread (the mean had the better worst case than the lowest over two
    trainings: docs/advice.md)."""
    stacked = torch.stack([standardised(p, s) for p, s in zip(per_layer, scales)])
    if weights is None:
        return stacked.mean(dim=0).float()
    return (stacked * torch.tensor(weights, dtype=stacked.dtype, device=stacked.device)[:, None]).sum(dim=0).float()


def seeded_subset(n: int, size: int, seed: int) -> list[int]:
    """`size` of range(n) (all when n <= size), drawn by `seed`, in ascending order."""
    if n <= size:
        return list(range(n))
    generator = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(n, generator=generator)[:size].tolist())


class Rejector:
    """The stored reject record (`calibration` in best.pt) as a scorer: `scores(logits, features)`,
    `rejected(scores)`. `threshold` may be replaced by hand (`--reject-below`). `fits`: name -> (class means,
    precision) of `mahalanobis` (raw features) and `mahalanobis_l2`; `scales`: name -> (centre, spread) of the
    parts of `combined`, which are `combined_of`; `layers`: the stage names, their fits and validation scales
    of `mahalanobis_layers`."""

    def __init__(self, method: str, threshold: float, temperature: Optional[float] = None,
                 bank: Optional[torch.Tensor] = None, k: int = KNN_K, fits: Optional[dict] = None,
                 scales: Optional[dict] = None, combined_of: tuple = COMBINED_OF, layers: Optional[dict] = None):
        if method not in METHODS:
            raise ValueError(f"unknown reject method {method!r}; one of {METHODS}")
        self.method, self.threshold, self.temperature = method, float(threshold), temperature
        self.bank = bank.float() if bank is not None else None
        self.k, self.fits, self.scales, self.combined_of = k, fits or {}, scales or {}, tuple(combined_of)
        layers = layers or {}
        self.layer_names = list(layers.get("names", []))
        self.layer_fits, self.layer_scales = list(layers.get("fits", [])), list(layers.get("scales", []))
        self.layer_weights = layers.get("weights")

    @property
    def needs_features(self) -> bool:
        return self.method in FEATURE_METHODS

    @property
    def needs_layers(self) -> bool:
        return self.method == LAYERS_METHOD

    def scores(self, logits: torch.Tensor, features: Optional[torch.Tensor] = None,
               layers: Optional[list[torch.Tensor]] = None) -> torch.Tensor:
        return self.score(self.method, logits, features, layers)

    def score(self, name: str, logits: torch.Tensor, features: Optional[torch.Tensor],
              layers: Optional[list[torch.Tensor]] = None) -> torch.Tensor:
        if name == "msp":
            return msp_score(logits, self.temperature)
        if name == "energy":
            return energy_score(logits)
        if name == LAYERS_METHOD:
            if layers is None:
                raise ValueError(f"the {name} score needs the pooled outputs of the stages {self.layer_names}")
            return multilayer_score(layer_scores(layers, self.layer_fits, self.layer_names),
                                    [tuple(s) for s in self.layer_scales], self.layer_weights)
        if features is None:
            raise ValueError(f"the {name} score needs penultimate features")
        if name == "knn":
            return knn_score(features, self.bank.to(features.device), self.k)
        if name in ("mahalanobis", "mahalanobis_l2"):
            means, precision = (t.to(features.device) for t in self.fits[name])
            return mahalanobis_score(normalise(features) if name == "mahalanobis_l2" else features, means, precision)
        parts = [self.score(part, logits, features).to(features.device) for part in self.combined_of]
        return combined_score(parts, [tuple(self.scales[part]) for part in self.combined_of])

    def rejected(self, scores: torch.Tensor) -> torch.Tensor:
        return scores < self.threshold


def rejector_from_record(record: dict, method: Optional[str] = None) -> Rejector:
    """A Rejector from a checkpoint's / export's `calibration` record, for `method` (default: the record's)."""
    method = method or record["method"]
    fits = {name: (record[means], record[precision]) for name, means, precision in
            (("mahalanobis", "class_means", "precision"), ("mahalanobis_l2", "class_means_l2", "precision_l2"))
            if record.get(means) is not None}
    layers = {"names": record.get("layer_names", []),
              "fits": list(zip(record.get("layer_means", []), record.get("layer_precisions", []))),
              "scales": record.get("layer_scales", []), "weights": record.get("layer_weights")}
    return Rejector(method, record["thresholds"][method], record.get("temperature"),
                    bank=record.get("feature_bank"), k=int(record.get("knn_k", KNN_K)), fits=fits,
                    scales=record.get("score_scales"), combined_of=tuple(record.get("combined_of", COMBINED_OF)),
                    layers=layers)

@dataclass
class SplitOutputs:
    logits: torch.Tensor               # [N, C] float32, the readable samples in index order
    labels: torch.Tensor               # [N] int64
    indices: torch.Tensor              # [N] the samples' indices in the split
    features: Optional[torch.Tensor]   # [N, D] float32, or None (with_features off, or a model without them)
    layers: Optional[list] = None      # one [N, D_l] per stage (rejection.pooled_statistics), or None

    def __len__(self) -> int:
        return len(self.labels)

    def select(self, rows: torch.Tensor) -> "SplitOutputs":
        """The samples at positions `rows`."""
        return SplitOutputs(self.logits[rows], self.labels[rows], self.indices[rows],
                            self.features[rows] if self.features is not None else None,
                            [x[rows] for x in self.layers] if self.layers is not None else None)


def joined_outputs(first: SplitOutputs, second: SplitOutputs) -> SplitOutputs:
    """`first`'s samples, then `second`'s (the features and stages only where both have them)."""
    both = first.features is not None and second.features is not None
    return SplitOutputs(torch.cat([first.logits, second.logits]), torch.cat([first.labels, second.labels]),
                        torch.cat([first.indices, second.indices]),
                        torch.cat([first.features, second.features]) if both else None,
                        joined_layers([first.layers, second.layers]))


def joined_layers(parts: list) -> Optional[list]:
    """Batches' per-stage statistics joined stage by stage; None when any batch has none."""
    if not parts or any(p is None for p in parts):
        return None
    return [torch.cat([p[i] for p in parts]) for i in range(len(parts[0]))]


@torch.no_grad()
def collect_outputs(model: torch.nn.Module, loader, device_input: DeviceInput, with_features: bool,
                    with_layers: bool = False, layers: Optional[list[str]] = None) -> SplitOutputs:
    """This rank's readable samples of `loader` (batches of images, targets, valid, indices), in fp32 on the CPU;
    `with_layers`: also the pooled statistics of the stages `layers` names (default rejection.layer_names: a
    record's own names where it was fitted on others)."""
    was_training = model.training
    model.eval()
    logits_out, labels_out, indices_out, features_out, layers_out = [], [], [], [], []
    tap = FeatureTap(model) if with_features else None
    layer_tap = LayerTap(model, layer_names(model) if layers is None else layers) if with_layers else None
    try:
        for images, targets, valid, indices in loader:
            images = device_input.prepare(images)
            with device_input.autocast():
                logits = model(images)
            features = tap.take() if tap is not None else None
            keep = valid.bool()
            logits_out.append(logits.float().cpu()[keep])
            labels_out.append(torch.as_tensor(targets)[keep].long())
            indices_out.append(torch.as_tensor(indices)[keep].long())
            if features is not None:
                features_out.append(features.float().cpu()[keep])
            if layer_tap is not None:
                layers = layer_tap.take()
                layers_out.append([x.cpu()[keep] for x in layers] if layers is not None else None)
    finally:
        model.train(was_training)
        for t in (tap, layer_tap):
            if t is not None:
                t.close()
    if not logits_out:
        return SplitOutputs(torch.zeros(0, 0), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), None)
    features = torch.cat(features_out) if features_out else None
    return SplitOutputs(torch.cat(logits_out), torch.cat(labels_out), torch.cat(indices_out), features,
                        joined_layers(layers_out))


def gather_outputs(outputs: SplitOutputs) -> SplitOutputs:
    """Every rank's samples, in index order, on every rank (a no-op in one process). The eval shards hold
    disjoint indices with no padding, so each sample appears once."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, outputs)
        parts = [p for p in parts if len(p)]
        if not parts:
            return outputs
        features = torch.cat([p.features for p in parts]) if all(p.features is not None for p in parts) else None
        outputs = SplitOutputs(torch.cat([p.logits for p in parts]), torch.cat([p.labels for p in parts]),
                               torch.cat([p.indices for p in parts]), features,
                               joined_layers([p.layers for p in parts]))
    order = outputs.indices.argsort()
    return SplitOutputs(outputs.logits[order], outputs.labels[order], outputs.indices[order],
                        outputs.features[order] if outputs.features is not None else None,
                        [x[order] for x in outputs.layers] if outputs.layers is not None else None)


class OutputRecorder:
    """`evaluate(on_outputs=...)`'s receiver: keeps every readable sample's logits, label, index and (for a
    model with a timm classifier) penultimate features on the host, and the pooled statistics of the stages
    `layers` names (the reject record's). Close it to remove its taps."""

    def __init__(self, model: torch.nn.Module, with_features: bool = True, layers: Optional[list[str]] = None):
        self.tap = FeatureTap(model) if with_features else None
        self.layer_tap = LayerTap(model, layers) if with_features and layers else None
        self.parts: list[SplitOutputs] = []

    def __call__(self, logits, targets, valid, indices) -> None:
        keep = valid.bool().cpu()
        features = self.tap.take() if self.tap is not None else None
        layers = self.layer_tap.take() if self.layer_tap is not None else None
        self.parts.append(SplitOutputs(logits.float().cpu()[keep], torch.as_tensor(targets).cpu()[keep].long(),
                                       torch.as_tensor(indices).cpu()[keep].long(),
                                       features.float().cpu()[keep] if features is not None else None,
                                       [x.cpu()[keep] for x in layers] if layers is not None else None))

    def outputs(self) -> SplitOutputs:
        if not self.parts:
            return SplitOutputs(torch.zeros(0, 0), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                                None)
        features = (torch.cat([p.features for p in self.parts])
                    if all(p.features is not None for p in self.parts) else None)
        return SplitOutputs(torch.cat([p.logits for p in self.parts]), torch.cat([p.labels for p in self.parts]),
                            torch.cat([p.indices for p in self.parts]), features,
                            joined_layers([p.layers for p in self.parts]))

    def close(self) -> None:
        for tap in (self.tap, self.layer_tap):
            if tap is not None:
                tap.close()

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

    batches = probe_batches(size, channels, seed)
    joined = tuple(torch.cat(parts) for parts in zip(*batches))
    out = collect_outputs(model, [joined], device_input, with_features=rejector.needs_features,
                          with_layers=rejector.needs_layers, layers=rejector.layer_names or None)
    scores = rejector.scores(out.logits, out.features, out.layers)
    counts = np.cumsum([0, *(len(batch[0]) for batch in batches)])
    return rejection_rates({kind: scores[counts[k]:counts[k + 1]] for k, kind in enumerate(PROBE_KINDS)},
                           rejector.threshold)


REJECT_SCORE_OUTPUT = "reject_score"  # an export's second output: the checkpoint's multi-layer reject score


class LogitsAndRejectScore(torch.nn.Module):
    """The model's logits and its mahalanobis_layers reject score from one pass, as one traceable module, so an
    export rejects as the checkpoint does: the stages' outputs are caught by forward hooks, pooled
    (`_pooled_statistics`; the input's `_input_statistics`) and scored against the record's fits and validation
    scales, which become constants of the exported graph. In float32 (the checkpoint scores in float64: the
    scores agree to float32 rounding)."""

    def __init__(self, model: torch.nn.Module, record: dict):
        super().__init__()
        self.model = model
        self.names = list(record["layer_names"])
        channels = {e["module"]: int(e["num_chs"]) for e in (getattr(model, "feature_info", None) or [])
                    if isinstance(e, dict) and "module" in e}
        for i, (means, precision) in enumerate(zip(record["layer_means"], record["layer_precisions"])):
            self.register_buffer(f"means_{i}", torch.as_tensor(means).float())
            self.register_buffer(f"precision_{i}", torch.as_tensor(precision).float())
        self.scales = [(float(c), float(s)) for c, s in record["layer_scales"]]
        weights = record.get("layer_weights") or [1.0 / len(self.names)] * len(self.names)
        self.weights = [float(w) for w in weights]
        self._taken: dict[str, torch.Tensor] = {}
        for name in self.names:
            if name != INPUT_STAGE:
                model.get_submodule(name).register_forward_hook(self._recorder(name, channels.get(name)))

    def _recorder(self, name: str, num_chs: Optional[int]):
        def record(module, inputs, output) -> None:
            x = output[0] if isinstance(output, (tuple, list)) else output
            if num_chs is not None and x.dim() > 2 and x.shape[1] != num_chs and x.shape[-1] == num_chs:
                x = x.movedim(-1, 1)
            self._taken[name] = _pooled_statistics(x, LAYER_CHANNELS)
        return record

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._taken = {}
        logits = self.model(images)
        return logits, self.score(images)

    def score(self, images: torch.Tensor) -> torch.Tensor:
        """[N] the score of the pass just run on `images` (the stages' outputs its hooks caught)."""
        total = None
        for i, name in enumerate(self.names):
            x = _input_statistics(images) if name == INPUT_STAGE else normalise(self._taken[name])
            diff = x[:, None, :] - getattr(self, f"means_{i}")[None]                        # [N, C, D]
            distance = (torch.matmul(diff, getattr(self, f"precision_{i}")) * diff).sum(-1)   # [N, C]
            centre, spread = self.scales[i]
            part = (-distance.min(dim=1).values - centre) / spread * self.weights[i]
            total = part if total is None else total + part
        self._taken = {}
        return total


def carries_layers_score(record: Optional[dict], model: torch.nn.Module) -> bool:
    """Whether an export of `model` can carry the record's reject score (`LogitsAndRejectScore`): the record
    rejects by mahalanobis_layers and the model has its stages."""
    return bool(record and record.get("method") == LAYERS_METHOD and record.get("layer_names")
                and record.get("layer_means") is not None and has_modules(model, record["layer_names"]))
