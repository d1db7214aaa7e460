"""Every sample's logits (and penultimate features, and the stages' pooled statistics) over a labelled split,
kept rather than summed: what the temperature fit, the reject threshold and the feature bank need. Under
DDP each rank passes over its own shard (no padding) and the results are gathered by sample index, so every
sample counts once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from imgcls.evaluation.rejection import LayerTap, layer_names
from imgcls.models.feature_tap import FeatureTap
from imgcls.runtime.device import DeviceInput


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
