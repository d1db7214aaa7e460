"""Where a model's classifier is and what goes into it: one rule for every caller that needs the classifier
(the fine-tuning freeze and head learning rate, feature distillation, the reject option's penultimate
features), and one hook that taps the classifier's input, the pooled pre-logit features (for a timm model
what `forward_head(x, pre_logits=True)` returns), without changing how the model is called.

The rule: a timm model's `get_classifier()` when it has weights (several for a distilled model: all of them,
the first is the one whose input is the features); else a torchvision model's head attribute, `fc`,
`classifier` or `heads`, and inside a Sequential head its last Linear layer (the one whose input is the
penultimate features: mobilenet_v3's classifier holds two). Nothing else: a model that is neither, or an
export whose graph has no modules, has no classifier (None)."""
from __future__ import annotations

from typing import Optional

import torch

TORCHVISION_HEADS = ("fc", "classifier", "heads")


def _with_weights(module) -> bool:
    return isinstance(module, torch.nn.Module) and any(True for _ in module.parameters())


def _last_linear(module: torch.nn.Module) -> Optional[torch.nn.Module]:
    if isinstance(module, torch.nn.Linear) or not isinstance(module, torch.nn.Sequential):
        return module if _with_weights(module) else None
    linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    return linears[-1] if linears else None


def classifier_heads(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of each classifier of `model` by the rule above; [] when it has none."""
    model = getattr(model, "_orig_mod", model)  # a compiled model's modules are its original's
    if hasattr(model, "get_classifier"):
        heads = model.get_classifier()
        heads = [h for h in (heads if isinstance(heads, (tuple, list)) else (heads,)) if _with_weights(h)]
    else:
        heads = [_last_linear(getattr(model, name)) for name in TORCHVISION_HEADS
                 if isinstance(getattr(model, name, None), torch.nn.Module)][:1]
        heads = [h for h in heads if h is not None]
    names = {id(m): name for name, m in model.named_modules()}
    return [(names[id(h)], h) for h in heads if id(h) in names]


def classifier_of(model: torch.nn.Module) -> Optional[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of the classifier whose input is the pooled pre-logit features, or None."""
    heads = classifier_heads(model)
    return heads[0] if heads else None


def classifier_name(model: torch.nn.Module) -> Optional[str]:
    """The classifier's qualified name (found before BatchNorm folding, which keeps submodule names), or None."""
    head = classifier_of(model)
    return head[0] if head is not None else None


def feature_width(model: torch.nn.Module) -> Optional[int]:
    """The width of the pre-logit features (the classifier's input), None without a classifier."""
    head = classifier_of(model)
    if head is None:
        return None
    module = head[1]
    if isinstance(module, torch.nn.Linear):
        return module.in_features
    return next(p for p in module.parameters() if p.ndim == 2).shape[1]


class FeatureTap:
    """The classifier's input on a forward, flattened to [N, D]: the pooled pre-logit features. `head_name`:
    the classifier's name found on the model before it was BatchNorm-folded (torch.fx keeps the names).
    `keep_graph`: the features keep their autograd graph (feature distillation trains through them); else
    they are detached. `keep`: `first` records the first forward since the last `take` (a test-time flip's
    second forward is not the image's), `last` every forward. `available` is False for a model without a
    classifier."""

    def __init__(self, model: torch.nn.Module, head_name: Optional[str] = None, keep_graph: bool = False,
                 keep: str = "first"):
        self.features: Optional[torch.Tensor] = None
        self.keep_graph, self.keep_first = keep_graph, keep == "first"
        name = head_name or classifier_name(model)
        head = None
        if name:
            try:
                head = getattr(model, "_orig_mod", model).get_submodule(name)
            except AttributeError:
                head = None
        self.available = head is not None
        self._handle = head.register_forward_pre_hook(self._record) if self.available else None

    def _record(self, module, args) -> None:
        if self.keep_first and self.features is not None:
            return
        features = args[0].flatten(1)
        self.features = features if self.keep_graph else features.detach()

    def take(self) -> Optional[torch.Tensor]:
        """The features of the recorded forward (then forgotten)."""
        features, self.features = self.features, None
        return features

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def features_and_logits(model: torch.nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(pooled pre-logits features [N, D], logits [N, C]) of one forward pass: what embed.py, search.py,
    eval.py --knn / --linear-probe, export.py --embedding and serve.py /embed read. timm models: the input of
    the classifier as timm defines it, `forward_head(forward_features(x), pre_logits=True)`; other models: the
    classifier's input caught by the one tap (`FeatureTap`)."""
    if hasattr(model, "forward_head") and hasattr(model, "forward_features"):
        pooled = model.forward_features(images)
        return model.forward_head(pooled, pre_logits=True), model.forward_head(pooled)
    tap = FeatureTap(model, keep_graph=True)
    if not tap.available:
        raise TypeError(f"{type(model).__name__} has neither timm's forward_head nor a final classifier (fc, "
                        f"classifier, heads): its pre-logits features cannot be found")
    try:
        logits = model(images)
    finally:
        tap.close()
    return tap.take(), logits
