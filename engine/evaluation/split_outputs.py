"""Every sample's logits (and penultimate features) over a labelled split, kept rather than summed: what
the temperature fit, the reject threshold and the feature bank need. Under DDP each rank passes over its
own shard (no padding) and the results are gathered by sample index, so every sample counts once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.evaluation.rejection import FeatureTap
from engine.runtime.device import DeviceInput


@dataclass
class SplitOutputs:
    logits: torch.Tensor               # [N, C] float32, the readable samples in index order
    labels: torch.Tensor               # [N] int64
    indices: torch.Tensor              # [N] the samples' indices in the split
    features: Optional[torch.Tensor]   # [N, D] float32, or None (with_features off, or a model without them)

    def __len__(self) -> int:
        return len(self.labels)


@torch.no_grad()
def collect_outputs(model: torch.nn.Module, loader, device_input: DeviceInput, with_features: bool) -> SplitOutputs:
    """This rank's readable samples of `loader` (batches of images, targets, valid, indices), in fp32 on the CPU."""
    was_training = model.training
    model.eval()
    logits_out, labels_out, indices_out, features_out = [], [], [], []
    tap = FeatureTap(model) if with_features else None
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
    finally:
        model.train(was_training)
        if tap is not None:
            tap.close()
    if not logits_out:
        return SplitOutputs(torch.zeros(0, 0), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), None)
    features = torch.cat(features_out) if features_out else None
    return SplitOutputs(torch.cat(logits_out), torch.cat(labels_out), torch.cat(indices_out), features)


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
                               torch.cat([p.indices for p in parts]), features)
    order = outputs.indices.argsort()
    return SplitOutputs(outputs.logits[order], outputs.labels[order], outputs.indices[order],
                        outputs.features[order] if outputs.features is not None else None)


class OutputRecorder:
    """`evaluate(on_outputs=...)`'s receiver: keeps every readable sample's logits, label, index and (for a
    model with a timm classifier) penultimate features on the host. Close it to remove its feature tap."""

    def __init__(self, model: torch.nn.Module, with_features: bool = True):
        self.tap = FeatureTap(model) if with_features else None
        self.parts: list[SplitOutputs] = []

    def __call__(self, logits, targets, valid, indices) -> None:
        keep = valid.bool().cpu()
        features = self.tap.take() if self.tap is not None else None
        self.parts.append(SplitOutputs(logits.float().cpu()[keep], torch.as_tensor(targets).cpu()[keep].long(),
                                       torch.as_tensor(indices).cpu()[keep].long(),
                                       features.float().cpu()[keep] if features is not None else None))

    def outputs(self) -> SplitOutputs:
        if not self.parts:
            return SplitOutputs(torch.zeros(0, 0), torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                                None)
        features = (torch.cat([p.features for p in self.parts])
                    if all(p.features is not None for p in self.parts) else None)
        return SplitOutputs(torch.cat([p.logits for p in self.parts]), torch.cat([p.labels for p in self.parts]),
                            torch.cat([p.indices for p in self.parts]), features)

    def close(self) -> None:
        if self.tap is not None:
            self.tap.close()
